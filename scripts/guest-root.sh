#!/usr/bin/env bash
# Makes the root file system of TestMeasuredBootJoin's image (nodeagent/test/e2e/testdata): what berth-agent
# needs at boot, taken from Debian's archive, and the kernel modules of the kernel scripts/boot-parts.sh
# fetched.
#
#   - mmdebstrap --variant=extract of the packages below and their dependencies, no maintainer scripts run:
#     busybox-static (sh and the small tools; its applets are linked into /bin and /sbin where no package
#     has that program), coreutils (what install scripts expect: install, sha256sum), kmod (modprobe),
#     cryptsetup-bin (LUKS2), e2fsprogs (mkfs.ext4), util-linux (blkid) and mount;
#   - the modules the Debian kernel has as modules but a node needs (virtio disks and network, dm-crypt,
#     ext4, the crypto of LUKS2's aes-xts), with everything they depend on, and depmod's index of them;
#   - an empty /dev, /proc, /sys, /run and /tmp: devtmpfs and friends are mounted at boot.
#
# The result is cached in ${BERTH_CACHE:-$HOME/.cache/berth}/guest-root/<key>/root, the key naming this
# script and the kernel; the last line on stdout is that directory. Needs root (mmdebstrap's root mode and
# files owned by root) and the Debian archive.
set -euo pipefail

if [ $# -ne 0 ]; then
	echo "usage: $0" >&2
	exit 2
fi
log() { echo "guest-root: $*" >&2; }

packages=busybox-static,coreutils,kmod,cryptsetup-bin,e2fsprogs,util-linux,mount
modules=(virtio_pci virtio_blk virtio_net dm_crypt ext4 xts af_alg algif_skcipher)
suite=bookworm
mirror=http://deb.debian.org/debian

if [ "$(id -u)" -ne 0 ]; then
	log "needs root: the image's files are owned by root"
	exit 1
fi
export PATH="$PATH:/usr/sbin:/sbin"
for tool in mmdebstrap depmod modprobe; do
	command -v "$tool" >/dev/null || { log "$tool not found: run make deps"; exit 1; }
done

here=$(cd "$(dirname "$0")" && pwd)
parts=$("$here/boot-parts.sh" | tail -n1)
kernel_pkg=$(cd "$parts" && cd "$(dirname "$(readlink vmlinuz)")/.." && pwd)
version=$(basename "$(readlink "$parts/vmlinuz")" | sed 's/^vmlinuz-//')
if [ ! -d "$kernel_pkg/lib/modules/$version" ]; then
	log "$kernel_pkg has no modules for $version"
	exit 1
fi

cache_root="${BERTH_CACHE:-${HOME:+$HOME/.cache/berth}}"
roots="${cache_root:-/var/cache/berth}/guest-root"
key=$( (sha256sum "$0" | cut -d' ' -f1; echo "$version") | sha256sum | cut -c1-16)
out="$roots/$key"
mkdir -p "$roots"
exec 9>"$roots/.lock"
flock 9
if [ -d "$out/root" ]; then
	log "cached: $out/root"
	echo "$out/root"
	exit 0
fi

SECONDS=0
tmp=$(mktemp -d "$roots/.tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
root="$tmp/root"
log "mmdebstrap $suite ($packages)…"
mmdebstrap --quiet --variant=extract --include="$packages" "$suite" "$root" "$mirror" >&2

# The package manager's state and documentation have no use in an initrd.
rm -rf "$root"/usr/share/doc "$root"/usr/share/man "$root"/usr/share/info "$root"/usr/share/locale \
	"$root"/var/cache/apt "$root"/var/lib/apt "$root"/var/lib/dpkg "$root"/var/log/*
rm -rf "$root"/dev "$root"/proc "$root"/sys "$root"/run "$root"/tmp
mkdir -p "$root"/dev "$root"/proc "$root"/sys "$root"/run "$root"/tmp "$root"/usr/local/bin
chmod 1777 "$root"/tmp
# busybox's applets, where the packages have no program of that name.
"$root/bin/busybox" --list-full | grep -vx linuxrc | while read -r applet; do
	[ -e "$root/$applet" ] || [ -L "$root/$applet" ] || { mkdir -p "$(dirname "$root/$applet")"; ln -s /bin/busybox "$root/$applet"; }
done

# The modules and what they depend on, as modprobe resolves them against the whole kernel.
index="$tmp/index"
mkdir -p "$index/lib/modules"
cp -al "$kernel_pkg/lib/modules/$version" "$index/lib/modules/"
depmod -b "$index" "$version"
dest="$root/lib/modules/$version"
mkdir -p "$dest"
for m in "${modules[@]}"; do
	if ! deps=$(modprobe -d "$index" -S "$version" --show-depends "$m"); then
		log "the kernel $version has no module $m"
		exit 1
	fi
	awk '$1 == "insmod" { print $2 }' <<<"$deps" | while read -r ko; do
		rel=${ko#"$index/lib/modules/$version/"}
		mkdir -p "$dest/$(dirname "$rel")"
		cp "$ko" "$dest/$rel"
	done
done
cp "$kernel_pkg/lib/modules/$version"/modules.{order,builtin,builtin.modinfo} "$dest/"
depmod -b "$root" "$version"
log "modules: $(find "$dest" -name '*.ko' | wc -l) for ${modules[*]}"

mv -T "$tmp" "$out"
trap - EXIT
rm -rf "$out/index"
log "made $out/root: $(du -sh "$out/root" | cut -f1) in ${SECONDS}s"
echo "$out/root"
