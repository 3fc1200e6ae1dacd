#!/usr/bin/env bash
# Builds Kubernetes' end-to-end test binary (e2e.test, the conformance suite), the ginkgo runner that runs it
# in parallel, and agnhost and nnp (programs of the suite's test images) from the Kubernetes version pinned in
# test/k8stools/go.mod, beside the binaries scripts/build-k8s.sh makes, with the same settings so that the
# packages they share are compiled once. Progress goes to stderr; the only line on stdout is the bin
# directory: bin=$(scripts/build-e2e.sh).
set -euo pipefail

log() { echo "build-e2e: $*" >&2; }

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin_dir=$("$root/scripts/build-k8s.sh")
cd "$root/test/k8stools"

# The settings build-k8s.sh recorded: the version stamp, the tags, the ldflags.
ldflags=$(sed -n 's/^ldflags //p' "$bin_dir/../VERSION")
tags=$(sed -n 's/^tags //p' "$bin_dir/../VERSION")
k8s_version=$(sed -n 's/^kubernetes //p' "$bin_dir/../VERSION")

exec 9>"$bin_dir/../.lock"
flock 9

# Built for another Kubernetes version (build-k8s.sh rebuilt its own binaries): build them all again.
if [ -x "$bin_dir/e2e.test" ] && ! "$bin_dir/e2e.test" --version 2>/dev/null | grep -qF "$k8s_version"; then
	log "e2e.test is not $k8s_version: rebuilding"
	rm -f "$bin_dir/e2e.test" "$bin_dir/agnhost" "$bin_dir/nnp" "$bin_dir/ginkgo"
fi

# build NAME PACKAGE GO-COMMAND...: the command with -o and the package appended.
build() {
	local name=$1 pkg=$2
	shift 2
	if [ -x "$bin_dir/$name" ]; then
		log "$name already built"
		return
	fi
	log "building $name…"
	local start=$SECONDS
	CGO_ENABLED=0 "$@" -o "$bin_dir/$name.tmp" "$pkg"
	mv -f "$bin_dir/$name.tmp" "$bin_dir/$name"
	log "built $name in $((SECONDS - start)) s"
}

build e2e.test k8s.io/kubernetes/test/e2e go test -c -vet=off -trimpath -buildvcs=false -p 2 -tags "$tags" -ldflags "$ldflags"
build agnhost k8s.io/kubernetes/test/images/agnhost go build -trimpath -buildvcs=false -p 2 -tags "$tags" -ldflags "$ldflags"
build nnp k8s.io/kubernetes/test/images/nonewprivs go build -trimpath -buildvcs=false -p 2 -tags "$tags" -ldflags "$ldflags"
build ginkgo github.com/onsi/ginkgo/v2/ginkgo go build -trimpath -buildvcs=false -p 2

if ! version=$("$bin_dir/e2e.test" --version 2>&1) || [[ "$version" != *"$k8s_version"* ]]; then
	log "e2e.test reports \"${version%%$'\n'*}\", want $k8s_version"
	exit 1
fi
echo "$bin_dir"
