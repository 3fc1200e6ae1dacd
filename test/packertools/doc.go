// Package packertools pins the Packer that Berth's plugin tests and image builds run: v1.9.4, the last
// release under the MPL, built from its module by scripts/build-packer.sh. It is a module of its own so that
// Packer's dependencies stay out of the product's go.mod.
package packertools
