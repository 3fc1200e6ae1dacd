// Package amazon pins the Amazon plugin that validates examples/packer/aws.pkr.hcl: packer-plugin-amazon
// v1.8.0, built from its module by scripts/build-packer-amazon.sh. It is a module of its own, beside the one
// that pins Packer, so that neither the product's go.mod nor Packer's carries the AWS SDKs.
package amazon
