#!/usr/bin/env bash
# Builds amazon-ec2-metadata-mock, AWS's IMDS emulator that the IMDSv2 client's tests run against, at the
# version pinned in test/awstools/go.mod, into a cache keyed by that version:
#   ${BERTH_CACHE:-$HOME/.cache/berth}/imds-mock/<version>/bin/ec2-metadata-mock
# A binary already there is kept. Progress goes to stderr; the only line on stdout is the bin directory,
# so callers can run bin=$(scripts/build-imds-mock.sh).
set -euo pipefail

log() { echo "build-imds-mock: $*" >&2; }

module_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/../test/awstools" && pwd)"
cd "$module_dir"
version=$(go list -m -f '{{.Version}}' github.com/aws/amazon-ec2-metadata-mock)

# CI may run without HOME: fall back to a system cache directory.
cache_root="${BERTH_CACHE:-${HOME:+$HOME/.cache/berth}}"
bin_dir="${cache_root:-/var/cache/berth}/imds-mock/$version/bin"
mkdir -p "$bin_dir"
exec 9>"$bin_dir/.lock"
flock 9

# `ec2-metadata-mock --version` prints the release's version (embedded from the module), without a newline.
if [ -x "$bin_dir/ec2-metadata-mock" ] && [ "$("$bin_dir/ec2-metadata-mock" --version 2>/dev/null)" = "$version" ]; then
	log "ec2-metadata-mock $version already built"
else
	log "building ec2-metadata-mock $version from its module (about 30 seconds with a cold build cache)"
	start=$SECONDS
	# Pure Go: no cgo, so the binary does not depend on the host's libc.
	CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" \
		-o "$bin_dir/ec2-metadata-mock.tmp" github.com/aws/amazon-ec2-metadata-mock/cmd/ec2-metadata-mock
	mv "$bin_dir/ec2-metadata-mock.tmp" "$bin_dir/ec2-metadata-mock"
	log "ec2-metadata-mock $version built in $((SECONDS - start))s"
fi
echo "$bin_dir"
