// Package awstools pins amazon-ec2-metadata-mock, AWS's own emulator of the EC2 instance metadata service,
// that the IMDSv2 client's tests run against (nodeagent/internal/platform/aws/imds), built from its module by
// scripts/build-imds-mock.sh. It is a module of its own so that the mock's dependencies (cobra, viper and
// theirs) stay out of the product's go.mod.
package awstools
