#!/usr/bin/env bash
# Builds packer-plugin-amazon (the amazon-ebssurrogate builder of examples/packer/aws.pkr.hcl) at the version
# pinned in test/packertools/amazon/go.mod into a cache; prints its plugins directory (scripts/build-packer-plugin.sh).
exec "$(dirname "${BASH_SOURCE[0]}")/build-packer-plugin.sh" amazon
