// Package e2e holds the node agent's end-to-end tests: a node image built with the real packer and the
// plugin, booted under QEMU with OVMF and a swtpm, whose agent attests to a join service on the host.
// make e2e-measured-boot runs them.
package e2e
