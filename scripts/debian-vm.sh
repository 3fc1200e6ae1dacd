#!/usr/bin/env bash
# Makes a Debian 12 virtual machine disk that stands in for a cloud's Debian image in Packer builds on this
# machine (examples/packer/qemu.pkr.hcl): a GPT raw disk with an empty EFI system partition (mounted on
# /boot/efi) and an ext4 root from mmdebstrap (systemd, udev, openssh-server, linux-image-cloud-amd64 and its
# initramfs-tools initrd, DHCP by systemd-networkd), root's SSH login by a key made here. It also carries
# the Debian packages a node needs (berth-node's default packages): on a cloud, berth-node installs them from
# the archive, but the tests that build this machine reach no archive. The machine boots it
# with the kernel and initrd given to QEMU directly, as a cloud's boot loader would hand them over, so the
# image has no boot loader until berth-uki-install installs a UKI.
#
# Cached by this script's hash in ${BERTH_CACHE:-$HOME/.cache/berth}/debian-vm/<key>; the only line on stdout
# is that directory, with disk.raw, vmlinuz, initrd.img, cmdline (the kernel command line to boot with) and
# key (the SSH private key). Needs root (mmdebstrap runs the packages' scripts in a chroot), mmdebstrap,
# sfdisk, mkfs.ext4, mkfs.vfat, mtools and Debian's archive. About 2.5 minutes the first time.
set -euo pipefail

log() { echo "debian-vm: $*" >&2; }

if [ "$(id -u)" -ne 0 ]; then
	log "needs root: mmdebstrap installs packages in a chroot"
	exit 1
fi
export PATH="$PATH:/usr/sbin:/sbin"
for tool in mmdebstrap sfdisk mkfs.ext4 mkfs.vfat mmd ssh-keygen; do
	command -v "$tool" >/dev/null || { log "$tool not found: run make deps"; exit 1; }
done

suite=bookworm
mirror=http://deb.debian.org/debian
packages=systemd-sysv,udev,dbus,kmod,linux-image-cloud-amd64,initramfs-tools,openssh-server,ca-certificates
# packer/provisioner/node's DefaultPackages.
packages+=,containerd,runc,containernetworking-plugins,conntrack,socat,ethtool,iptables,cryptsetup-bin
# What berth-uki-install's verified_root runs on the build machine.
packages+=,erofs-utils,dosfstools,fdisk
# Fixed ids: the command line and fstab name the file systems by them.
root_uuid=6b1e9a62-3c5e-4d7b-9d0e-2f8a1c4b5e70
esp_id=B3E70001

cache_root="${BERTH_CACHE:-${HOME:+$HOME/.cache/berth}}"
vms="${cache_root:-/var/cache/berth}/debian-vm"
key=$(sha256sum "$0" | cut -c1-16)
out="$vms/$key"
mkdir -p "$vms"
exec 9>"$vms/.lock"
flock 9
if [ -f "$out/disk.raw" ]; then
	log "cached: $out"
	echo "$out"
	exit 0
fi

SECONDS=0
tmp=$(mktemp -d "$vms/.tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
root="$tmp/root"
log "mmdebstrap $suite ($packages)…"
mmdebstrap --quiet --variant=minbase --include="$packages" \
	--customize-hook='chroot "$1" systemctl enable systemd-networkd' "$suite" "$root" "$mirror" >&2

# Only QEMU's virtio machines boot this disk, so its initrds need only the modules of this machine's root
# (and what berth-uki-install's verified root adds by name): under TCG, initramfs-tools' default of most
# modules takes minutes to rebuild an initrd. A cloud image keeps its default, which boots any instance type.
sed -i 's/^MODULES=.*/MODULES=dep/' "$root/etc/initramfs-tools/initramfs.conf"
ssh-keygen -q -t ed25519 -N '' -C berth-build -f "$tmp/key"
install -d -m 0700 "$root/root/.ssh"
install -m 0600 "$tmp/key.pub" "$root/root/.ssh/authorized_keys"
echo berth-vm >"$root/etc/hostname"
mkdir -p "$root/boot/efi"
cat >"$root/etc/fstab" <<FSTAB
UUID=$root_uuid / ext4 defaults 0 1
UUID=${esp_id:0:4}-${esp_id:4:4} /boot/efi vfat umask=0077 0 2
FSTAB
mkdir -p "$root/etc/systemd/network"
printf '[Match]\nName=en*\n\n[Network]\nDHCP=yes\n' >"$root/etc/systemd/network/80-dhcp.network"

cp -L "$root/vmlinuz" "$tmp/vmlinuz"
cp -L "$root/initrd.img" "$tmp/initrd.img"
echo "root=UUID=$root_uuid ro console=ttyS0" >"$tmp/cmdline"

log "making the disk…"
esp_sectors=131072 # 64 MiB
# Room for a node's container images twice (the archives the image keeps and containerd's store), sparse.
root_mib=3072
root_start=$((2048 + esp_sectors))
truncate -s "${root_mib}M" "$tmp/root.img"
mkfs.ext4 -q -F -U "$root_uuid" -L root -d "$root" "$tmp/root.img"
mkfs.vfat -C -i "$esp_id" -n ESP "$tmp/esp.img" $((esp_sectors / 2)) >/dev/null
mmd -i "$tmp/esp.img" ::/EFI
truncate -s $(((root_start + root_mib * 2048 + 2048) * 512)) "$tmp/disk.raw"
printf 'label: gpt\nstart=2048, size=%d, type=C12A7328-F81F-11D2-BA4B-00A0C93EC93B\nstart=%d, type=0FC63DAF-8483-4772-8E79-3D69D8477DE4\n' \
	"$esp_sectors" "$root_start" | sfdisk --quiet "$tmp/disk.raw"
dd if="$tmp/esp.img" of="$tmp/disk.raw" bs=512 seek=2048 conv=notrunc,sparse status=none
dd if="$tmp/root.img" of="$tmp/disk.raw" bs=512 seek="$root_start" conv=notrunc,sparse status=none

mkdir -p "$out"
mv "$tmp/disk.raw" "$tmp/vmlinuz" "$tmp/initrd.img" "$tmp/cmdline" "$tmp/key" "$out/"
log "made $out in ${SECONDS}s"
echo "$out"
