#!/usr/bin/env bash
# Builds the Packer that the plugin's tests and the image builds run, at the version pinned in
# test/packertools/go.mod, into a cache keyed by that version:
#   ${BERTH_CACHE:-$HOME/.cache/berth}/packer/<version>/bin/packer
# A binary already there is kept. Progress goes to stderr; the only line on stdout is the bin directory,
# so callers can run bin=$(scripts/build-packer.sh).
set -euo pipefail

log() { echo "build-packer: $*" >&2; }

module_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/../test/packertools" && pwd)"
cd "$module_dir"
version=$(go list -m -f '{{.Version}}' github.com/hashicorp/packer)

# CI may run without HOME: fall back to a system cache directory.
cache_root="${BERTH_CACHE:-${HOME:+$HOME/.cache/berth}}"
bin_dir="${cache_root:-/var/cache/berth}/packer/$version/bin"
mkdir -p "$bin_dir"
exec 9>"$bin_dir/.lock"
flock 9

if [ -x "$bin_dir/packer" ] && [ "$("$bin_dir/packer" version 2>/dev/null | head -n1)" = "Packer ${version}" ]; then
	log "packer $version already built"
else
	log "building packer $version from its module (about 3 minutes with a cold build cache)"
	start=$SECONDS
	# Packer reports the version it was built as; the module version is the release's.
	go build -trimpath -ldflags "-s -w -X github.com/hashicorp/packer/version.Version=${version#v} -X github.com/hashicorp/packer/version.VersionPrerelease=" \
		-o "$bin_dir/packer.tmp" github.com/hashicorp/packer
	mv "$bin_dir/packer.tmp" "$bin_dir/packer"
	log "packer $version built in $((SECONDS - start))s"
fi
echo "$bin_dir"
