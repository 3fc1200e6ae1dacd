#!/usr/bin/env bash
# Builds the Kubernetes and etcd binaries the real-cluster lab runs, from the versions pinned in
# test/k8stools/go.mod (or the tools module --module names, relative to the repository: test/k8sprevtools
# pins the minor release before, for upgrades; --patch-before stamps them as the patch release before),
# CoreDNS from test/corednstools/go.mod and flanneld from test/flanneltools/go.mod, into a cache keyed by
# the Kubernetes and etcd versions:
#   ${BERTH_CACHE:-$HOME/.cache/berth}/k8s/<kubernetes>-etcd-<etcd>/bin/
# (with --patch-before, <before>-as-<kubernetes>-etcd-<etcd>).
# Binaries already there are kept unless --force is given or the build settings changed. Progress goes to
# stderr; the only line on stdout is the bin directory, so callers can run bin=$(scripts/build-k8s.sh).
set -euo pipefail

usage() {
	echo "usage: $0 [--force] [--module DIR] [--patch-before]" >&2
	exit 2
}

force=false
module=test/k8stools
patch_before=false
while [ $# -gt 0 ]; do
	case "$1" in
	--force) force=true ;;
	--module)
		[ $# -ge 2 ] || usage
		module="$2"
		shift
		;;
	--patch-before) patch_before=true ;;
	*) usage ;;
	esac
	shift
done

log() { echo "build-k8s: $*" >&2; }

# Prints the time since $1 (from EPOCHREALTIME) in seconds with one decimal.
elapsed() {
	local us=$((${EPOCHREALTIME/./} - ${1/./}))
	printf '%d.%ds' $((us / 1000000)) $((us % 1000000 / 100000))
}

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ ! -f "$root/$module/go.mod" ]; then
	log "--module $module: no go.mod in $root/$module"
	exit 2
fi
cd "$root/$module"

# The versions come from go.mod so the cache key cannot drift from what is built. The module's commit
# time stands in for the build date, as SOURCE_DATE_EPOCH does in upstream builds: same input, same binary.
k8s_info=$(go list -m -f '{{.Version}} {{.Time.UTC.Format "2006-01-02T15:04:05Z"}}' k8s.io/kubernetes)
read -r k8s_version k8s_date <<<"$k8s_info"
etcd_version=$(go list -m -f '{{.Version}}' go.etcd.io/etcd/server/v3)
coredns_module_dir="$root/test/corednstools"
coredns_version=$(go -C "$coredns_module_dir" list -m -f '{{.Version}}' github.com/coredns/coredns)
flannel_module_dir="$root/test/flanneltools"
flannel_version=$(go -C "$flannel_module_dir" list -m -f '{{.Version}}' github.com/flannel-io/flannel)
if [[ ! "$k8s_version" =~ ^v([0-9]+)\.([0-9]+)\.([0-9]+)$ ]]; then
	log "k8s.io/kubernetes is pinned to $k8s_version, want a release version vX.Y.Z"
	exit 1
fi
k8s_major="${BASH_REMATCH[1]}"
k8s_minor="${BASH_REMATCH[2]}"
k8s_patch="${BASH_REMATCH[3]}"
cache_name="${k8s_version}-etcd-${etcd_version}"
# --patch-before stamps the binaries with the patch release before the module's: its code under that version,
# which is what a patch upgrade needs of them (kubeadm plans by the versions the binaries report), for the
# cost of linking them again rather than building another release. Its cache names both versions.
if $patch_before; then
	if [ "$k8s_patch" -eq 0 ]; then
		log "--patch-before: $k8s_version is the first release of its minor"
		exit 2
	fi
	before="v$k8s_major.$k8s_minor.$((k8s_patch - 1))"
	cache_name="${before}-as-${k8s_version}-etcd-${etcd_version}"
	k8s_version="$before"
fi

# CI may run without HOME: fall back to a system cache directory.
cache_root="${BERTH_CACHE:-${HOME:+$HOME/.cache/berth}}"
cache_dir="${cache_root:-/var/cache/berth}/k8s/${cache_name}"
bin_dir="$cache_dir/bin"
mkdir -p "$bin_dir"

# Two builds into the same cache would race on the stamp and the binaries.
exec 9>"$cache_dir/.lock"
flock 9

# Without these the binaries report v0.0.0-master, which kubeadm and the version skew checks reject.
# gitCommit stays empty: the module proxy does not say which commit a version was cut from.
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
	ldflags+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=$k8s_major -X $pkg.gitMinor=$k8s_minor"
	ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.gitCommit= -X $pkg.buildDate=$k8s_date"
done
ldflags+=" -X go.etcd.io/etcd/api/v3/version.GitSHA="
# The tags upstream release builds use (hack/lib/golang.sh).
tags="selinux,notest,grpcnotrace"

# name -> package, in build order.
names=(kube-apiserver kube-controller-manager kube-scheduler kube-proxy kubelet kubeadm kubectl etcd coredns flanneld)
declare -A pkgs=(
	[kube-apiserver]=k8s.io/kubernetes/cmd/kube-apiserver
	[kube-controller-manager]=k8s.io/kubernetes/cmd/kube-controller-manager
	[kube-scheduler]=k8s.io/kubernetes/cmd/kube-scheduler
	[kube-proxy]=k8s.io/kubernetes/cmd/kube-proxy
	[kubelet]=k8s.io/kubernetes/cmd/kubelet
	[kubeadm]=k8s.io/kubernetes/cmd/kubeadm
	[kubectl]=k8s.io/kubernetes/cmd/kubectl
	[etcd]=go.etcd.io/etcd/server/v3
	[coredns]=.
	[flanneld]=github.com/flannel-io/flannel
)

# The stamp records everything that shapes the binaries. It is written before building, so the cached
# binaries from other settings go first: every binary present was then built as the stamp says.
stamp="kubernetes $k8s_version
etcd $etcd_version
go $(go env GOVERSION) $(go env GOOS)/$(go env GOARCH)
cgo 0
tags $tags
ldflags $ldflags"
if [ -f "$cache_dir/VERSION" ] && [ "$(cat "$cache_dir/VERSION")" != "$stamp" ]; then
	log "build settings changed since the cached binaries were built: rebuilding all"
	rm -f "${names[@]/#/$bin_dir/}"
fi
printf '%s\n' "$stamp" >"$cache_dir/VERSION"
# CoreDNS's and Flannel's versions are not in the stamp, whose change rebuilds everything: a CoreDNS or a
# flanneld of another version is rebuilt alone. The output is captured, not piped into grep -q: under
# pipefail, grep exiting at the first match fails the pipe whenever the program is still writing (SIGPIPE).
if [ -x "$bin_dir/coredns" ] && [[ "$("$bin_dir/coredns" -version 2>/dev/null)" != *"CoreDNS-${coredns_version#v}"* ]]; then
	rm -f "$bin_dir/coredns"
fi
if [ -x "$bin_dir/flanneld" ] && [ "$("$bin_dir/flanneld" --version 2>&1)" != "$flannel_version" ]; then
	rm -f "$bin_dir/flanneld"
fi

total_start=$EPOCHREALTIME
i=0
for name in "${names[@]}"; do
	i=$((i + 1))
	out="$bin_dir/$name"
	if [ -x "$out" ] && ! $force; then
		log "$name ($i/${#names[@]}) already built"
		continue
	fi
	log "building $name ($i/${#names[@]})…"
	start=$EPOCHREALTIME
	# -p 2 keeps peak memory near 2 GB; kubelet builds without cgo too, so every binary is static.
	# Build beside the target and rename, so an interrupted build never leaves a binary that looks done.
	# CoreDNS and Flannel have modules of their own, so that their dependency graphs never move the
	# versions Kubernetes builds with.
	if [ "$name" = coredns ]; then
		CGO_ENABLED=0 go -C "$coredns_module_dir" build -trimpath -buildvcs=false -p 2 -ldflags "-s -w" \
			-o "$out.tmp" "${pkgs[$name]}"
	elif [ "$name" = flanneld ]; then
		# Its UDP backend is C on amd64, and flanneld links every backend: cgo, linked statically as upstream's
		# Makefile does, with Go's own resolver and user lookup so that the binary never loads glibc's NSS
		# modules, which the image lacks. flanneld --version says "dev" unless the version is set.
		CGO_ENABLED=1 go -C "$flannel_module_dir" build -trimpath -buildvcs=false -p 2 -tags netgo,osusergo \
			-ldflags "-s -w -X github.com/flannel-io/flannel/pkg/version.Version=$flannel_version -extldflags -static" \
			-o "$out.tmp" "${pkgs[$name]}"
	else
		CGO_ENABLED=0 go build -trimpath -buildvcs=false -p 2 -tags "$tags" -ldflags "$ldflags" \
			-o "$out.tmp" "${pkgs[$name]}"
	fi
	mv -f "$out.tmp" "$out"
	log "built $name in $(elapsed "$start")"
done
log "all binaries ready in $(elapsed "$total_start")"

failed=false
for name in "${names[@]}"; do
	case "$name" in
	kubeadm) args=(version -o short) want="$k8s_version" ;;
	kubectl) args=(version --client) want="Client Version: $k8s_version" ;;
	etcd) args=(--version) want="etcd Version: ${etcd_version#v}" ;;
	coredns) args=(-version) want="CoreDNS-${coredns_version#v}" ;;
	flanneld) args=(--version) want="$flannel_version" ;;
	*) args=(--version) want="Kubernetes $k8s_version" ;;
	esac
	if ! got=$("$bin_dir/$name" "${args[@]}" 2>&1); then
		log "$name ${args[*]} failed: $got"
		failed=true
		continue
	fi
	first_line="${got%%$'\n'*}"
	if [[ "$got" != *"$want"* || "$got" == *v0.0.0* || "$got" == *master* ]]; then
		log "$name reports \"$first_line\", want \"$want\""
		failed=true
		continue
	fi
	log "$name: $first_line"
done
if $failed; then
	log "some binaries report the wrong version: rebuild with --force"
	exit 1
fi
echo "$bin_dir"
