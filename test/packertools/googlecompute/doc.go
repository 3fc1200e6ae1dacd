// Package googlecompute pins the Google Compute plugin that validates examples/packer/gcp.pkr.hcl:
// packer-plugin-googlecompute v1.1.6 (v1.2.0 is refused by the module proxy), built from its module by
// scripts/build-packer-googlecompute.sh. It is a module of its own, beside the one that pins Packer, so that
// neither the product's go.mod nor Packer's carries Google's API clients.
package googlecompute
