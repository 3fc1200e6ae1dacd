#!/usr/bin/env bash
# Builds packer-plugin-googlecompute (the googlecompute builder of examples/packer/gcp.pkr.hcl) at the version
# pinned in test/packertools/googlecompute/go.mod into a cache; prints its plugins directory
# (scripts/build-packer-plugin.sh).
exec "$(dirname "${BASH_SOURCE[0]}")/build-packer-plugin.sh" googlecompute
