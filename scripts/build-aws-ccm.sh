#!/usr/bin/env bash
# Builds the AWS cloud controller manager (k8s.io/cloud-provider-aws), which the AWS lab runs against its EC2
# endpoint, at the version pinned in test/ccmtools/go.mod, into a cache keyed by that version:
#   ${BERTH_CACHE:-$HOME/.cache/berth}/aws-ccm/<version>/bin/aws-cloud-controller-manager
# A binary already there is kept. Progress goes to stderr; the only line on stdout is the bin directory,
# so callers can run bin=$(scripts/build-aws-ccm.sh).
set -euo pipefail

log() { echo "build-aws-ccm: $*" >&2; }

module_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/../test/ccmtools" && pwd)"
cd "$module_dir"
version=$(go list -m -f '{{.Version}}' k8s.io/cloud-provider-aws)

# CI may run without HOME: fall back to a system cache directory.
cache_root="${BERTH_CACHE:-${HOME:+$HOME/.cache/berth}}"
bin_dir="${cache_root:-/var/cache/berth}/aws-ccm/$version/bin"
mkdir -p "$bin_dir"
exec 9>"$bin_dir/.lock"
flock 9

bin="$bin_dir/aws-cloud-controller-manager"
# `--version` prints "Kubernetes <version>", the version the build stamped.
if [ -x "$bin" ] && [ "$("$bin" --version 2>/dev/null)" = "Kubernetes $version" ]; then
	log "aws-cloud-controller-manager $version already built"
else
	log "building aws-cloud-controller-manager $version from its module (about 3 minutes after the lab's Kubernetes, which shares most of its packages)"
	start=$SECONDS
	# The same flags as scripts/build-k8s.sh, so that the Kubernetes packages both link come from the build cache.
	CGO_ENABLED=0 go build -trimpath -p 2 -ldflags "-s -w -X k8s.io/component-base/version.gitVersion=$version" \
		-o "$bin.tmp" k8s.io/cloud-provider-aws/cmd/aws-cloud-controller-manager
	mv "$bin.tmp" "$bin"
	log "aws-cloud-controller-manager $version built in $((SECONDS - start))s"
fi
echo "$bin_dir"
