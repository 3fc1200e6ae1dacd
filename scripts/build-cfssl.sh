#!/usr/bin/env bash
# Builds the CFSSL that the join service's tests run as a remote signer (`cfssl serve`), at the version
# pinned in test/cfssltools/go.mod, into a cache keyed by that version:
#   ${BERTH_CACHE:-$HOME/.cache/berth}/cfssl/<version>/bin/cfssl
# A binary already there is kept. Progress goes to stderr; the only line on stdout is the bin directory,
# so callers can run bin=$(scripts/build-cfssl.sh).
set -euo pipefail

log() { echo "build-cfssl: $*" >&2; }

module_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/../test/cfssltools" && pwd)"
cd "$module_dir"
version=$(go list -m -f '{{.Version}}' github.com/cloudflare/cfssl)

# CI may run without HOME: fall back to a system cache directory.
cache_root="${BERTH_CACHE:-${HOME:+$HOME/.cache/berth}}"
bin_dir="${cache_root:-/var/cache/berth}/cfssl/$version/bin"
mkdir -p "$bin_dir"
exec 9>"$bin_dir/.lock"
flock 9

# `cfssl version` prints "Version: <version without v>" first.
if [ -x "$bin_dir/cfssl" ] && [ "$("$bin_dir/cfssl" version 2>/dev/null | head -n1)" = "Version: ${version#v}" ]; then
	log "cfssl $version already built"
else
	log "building cfssl $version from its module (about 80 seconds with a cold build cache)"
	start=$SECONDS
	# The sqlite certificate database driver is cgo. CFSSL reports the version it was built as; the module
	# version is the release's.
	CGO_ENABLED=1 go build -trimpath -ldflags "-s -w -X github.com/cloudflare/cfssl/cli/version.version=${version#v}" \
		-o "$bin_dir/cfssl.tmp" github.com/cloudflare/cfssl/cmd/cfssl
	mv "$bin_dir/cfssl.tmp" "$bin_dir/cfssl"
	log "cfssl $version built in $((SECONDS - start))s"
fi
echo "$bin_dir"
