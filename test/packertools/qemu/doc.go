// Package qemu pins the QEMU plugin that builds examples/packer/qemu.pkr.hcl: packer-plugin-qemu v1.0.9, the
// only version the module proxy serves, built from its module by scripts/build-packer-qemu.sh. It is a module
// of its own so that neither the product's go.mod nor Packer's carries the plugin's dependencies.
package qemu
