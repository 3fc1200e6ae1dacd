#!/usr/bin/env bash
# Builds Prometheus's promtool, which checks docs/alerts.yaml and the Grafana dashboard's queries
# (`promtool check rules`, `promtool test rules`), at the version pinned in test/promtools/go.mod, into a
# cache keyed by that version:
#   ${BERTH_CACHE:-$HOME/.cache/berth}/promtool/<version>/bin/promtool
# A binary already there is kept. Progress goes to stderr; the only line on stdout is the bin directory,
# so callers can run bin=$(scripts/build-promtool.sh).
set -euo pipefail

log() { echo "build-promtool: $*" >&2; }

module_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/../test/promtools" && pwd)"
cd "$module_dir"
version=$(go list -m -f '{{.Version}}' github.com/prometheus/prometheus)

# CI may run without HOME: fall back to a system cache directory.
cache_root="${BERTH_CACHE:-${HOME:+$HOME/.cache/berth}}"
bin_dir="${cache_root:-/var/cache/berth}/promtool/$version/bin"
mkdir -p "$bin_dir"
exec 9>"$bin_dir/.lock"
flock 9

# `promtool --version` prints "promtool, version <version without v> (...)" first.
if [ -x "$bin_dir/promtool" ] && "$bin_dir/promtool" --version 2>/dev/null | head -n1 | grep -qF "version ${version#v} "; then
	log "promtool $version already built"
else
	log "building promtool $version from its module (about 5 minutes with a cold build cache)"
	start=$SECONDS
	CGO_ENABLED=0 go build -trimpath -ldflags "-s -w -X github.com/prometheus/common/version.Version=${version#v}" \
		-o "$bin_dir/promtool.tmp" github.com/prometheus/prometheus/cmd/promtool
	mv "$bin_dir/promtool.tmp" "$bin_dir/promtool"
	log "promtool $version built in $((SECONDS - start))s"
fi
echo "$bin_dir"
