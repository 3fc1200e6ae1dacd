#!/usr/bin/env bash
# Fetches, without installing, the Debian packages that a real UKI (unified kernel image) is made of:
# systemd-boot-efi (systemd-stub, linuxx64.efi.stub) and the kernel package that linux-image-amd64 points
# to. Each package is downloaded with apt-get download and unpacked with dpkg-deb -x into
#   ${BERTH_CACHE:-$HOME/.cache/berth}/boot-parts/<package>_<version>/
# and a directory named after both holds two links into them: linuxx64.efi.stub and vmlinuz. Progress goes
# to stderr; the last line on stdout is that directory, so callers can run parts=$(scripts/boot-parts.sh).
#
# The versions are apt's candidates. Asking apt-cache takes ~0.6 s on machines without apt's binary cache,
# so the answer is remembered together with the state of apt's lists and sources: as long as those are
# unchanged, a cached run asks nothing and touches no network.
set -euo pipefail

if [ $# -ne 0 ]; then
	echo "usage: $0" >&2
	exit 2
fi

log() { echo "boot-parts: $*" >&2; }

stub_package=systemd-boot-efi
stub_path=usr/lib/systemd/boot/efi/linuxx64.efi.stub
kernel_meta=linux-image-amd64

# CI may run without HOME: fall back to a system cache directory.
cache_root="${BERTH_CACHE:-${HOME:+$HOME/.cache/berth}}"
parts_root="${cache_root:-/var/cache/berth}/boot-parts"
mkdir -p "$parts_root"

# Two runs into the same cache would race on the downloads and the resolution file.
exec 9>"$parts_root/.lock"
flock 9

eval "$(apt-config shell lists Dir::State::lists/d sources Dir::Etc::sourcelist/f \
	source_parts Dir::Etc::sourceparts/d prefs Dir::Etc::preferences/f prefs_parts Dir::Etc::preferencesparts/d)"

# What apt's candidates depend on: the package lists, the sources and the pinning preferences.
apt_state() {
	local files=()
	shopt -s nullglob
	files+=("$lists"*_Packages* "$sources" "$source_parts"* "$prefs" "$prefs_parts"*)
	shopt -u nullglob
	stat -c '%n %s %Y' "${files[@]}" 2>/dev/null || true
}

# Prints "<stub package> <version>" and "<kernel package> <version>", or fails when apt does not know them
# (no lists yet, or lists without these packages).
resolve() {
	local out
	out=$(apt-cache show --no-all-versions "$stub_package" "$kernel_meta" 2>/dev/null) || return 1
	awk -v stub="$stub_package" -v meta="$kernel_meta" '
		/^Package: / { pkg = $2 }
		/^Version: / && pkg == stub { print stub, $2; found++ }
		/^Depends: / && pkg == meta {
			# linux-image-amd64 depends on exactly one kernel package, pinned with "(= version)".
			if (match($0, /^Depends: [^ ,|]+ \(= [^)]+\)/)) {
				split(substr($0, 10, RLENGTH - 9), f, /[ ()=]+/)
				print f[1], f[2]; found++
			}
		}
		END { exit found == 2 ? 0 : 1 }
	' <<<"$out"
}

resolution="$parts_root/resolved"
state=$(apt_state)
if [ -f "$resolution" ] && [ "$(sed '/^--$/,$d' "$resolution")" == "$state" ]; then
	parts=$(sed '1,/^--$/d' "$resolution")
else
	if ! parts=$(resolve); then
		log "apt does not know $stub_package and $kernel_meta: running apt-get update"
		apt-get update >&2
		state=$(apt_state)
		if ! parts=$(resolve); then
			log "apt still has no candidate for $stub_package or $kernel_meta after apt-get update: check the sources"
			exit 1
		fi
	fi
	printf '%s\n--\n%s\n' "$state" "$parts" >"$resolution.tmp"
	mv -f "$resolution.tmp" "$resolution"
fi

# Downloads package $1 at version $2 into the current directory. Lists older than the archive name .debs
# that are gone (404), and missing lists name nothing: both are fixed by apt-get update, nothing else is.
download() {
	local err
	if err=$(apt-get download "$1=$2" 2>&1 >/dev/null); then
		return 0
	fi
	if ! grep -qE "404|Unable to locate package|Can't select|has no candidate|not found" <<<"$err"; then
		log "apt-get download $1=$2 failed (is the package archive reachable?): $err"
		return 1
	fi
	log "apt-get download $1=$2 failed for stale or missing lists: running apt-get update"
	apt-get update >&2
	if ! err=$(apt-get download "$1=$2" 2>&1 >/dev/null); then
		log "apt-get download $1=$2 failed after apt-get update: $err"
		return 1
	fi
}

dirs=()
while read -r package version; do
	dir="$parts_root/${package}_$version"
	dirs+=("$dir")
	# A package directory only ever appears complete: it is unpacked beside it and renamed.
	if [ -d "$dir" ]; then
		log "$package $version already unpacked"
		continue
	fi
	log "downloading $package $version…"
	tmp=$(mktemp -d "$parts_root/.tmp.XXXXXX")
	trap 'rm -rf "$tmp"' EXIT
	(cd "$tmp" && download "$package" "$version")
	debs=("$tmp"/*.deb)
	if [ ${#debs[@]} -ne 1 ] || [ ! -f "${debs[0]}" ]; then
		log "apt-get download $package=$version left ${#debs[@]} files, want one .deb"
		exit 1
	fi
	dpkg-deb -x "${debs[0]}" "$tmp/root"
	mv -T "$tmp/root" "$dir"
	rm -rf "$tmp"
	trap - EXIT
	log "unpacked $package $version"
done <<<"$parts"

stub_dir="${dirs[0]}"
kernel_dir="${dirs[1]}"
if [ ! -f "$stub_dir/$stub_path" ]; then
	log "$stub_dir has no $stub_path"
	exit 1
fi
shopt -s nullglob
kernels=("$kernel_dir"/boot/vmlinuz-*)
shopt -u nullglob
if [ ${#kernels[@]} -ne 1 ]; then
	log "$kernel_dir/boot holds ${#kernels[@]} vmlinuz files, want one"
	exit 1
fi

set_dir="$parts_root/$(basename "$stub_dir")+$(basename "$kernel_dir")"
if [ ! -d "$set_dir" ]; then
	tmp=$(mktemp -d "$parts_root/.tmp.XXXXXX")
	ln -s "../$(basename "$stub_dir")/$stub_path" "$tmp/linuxx64.efi.stub"
	ln -s "../$(basename "$kernel_dir")/boot/$(basename "${kernels[0]}")" "$tmp/vmlinuz"
	mv -T "$tmp" "$set_dir"
fi
echo "$set_dir"
