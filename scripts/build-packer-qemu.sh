#!/usr/bin/env bash
# Builds packer-plugin-qemu (the qemu builder of examples/packer/qemu.pkr.hcl) at the version pinned in
# test/packertools/qemu/go.mod into a cache; prints its plugins directory (scripts/build-packer-plugin.sh).
exec "$(dirname "${BASH_SOURCE[0]}")/build-packer-plugin.sh" qemu
