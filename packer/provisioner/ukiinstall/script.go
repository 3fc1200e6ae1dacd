package ukiinstall

import (
	"fmt"
	"strings"

	"github.com/berthlabs/berth/packer/internal/remote"
	"github.com/berthlabs/berth/packer/internal/verity"
)

// Names of the scripts and of the files in the staging directory.
const (
	collectScript = "collect.sh"
	installScript = "install.sh"
	stagedUKI     = "BOOTX64.EFI"
)

// Files collectScript copies into the staging directory for download.
const (
	stagedKernel    = "kernel"
	stagedInitrd    = "initrd"
	stagedOSRelease = "os-release"
	stagedCmdline   = "cmdline"
)

// collect is the script that copies the machine's kernel, initrd, os-release and, unless cmdline is
// configured, its /proc/cmdline into the staging directory, following links on the machine itself (an
// absolute link means nothing from outside it), and hands the copies to the communicator's user: with
// execute_command's sudo the copies are root's, and the download runs as that user.
func (c *Config) collect() string {
	var b strings.Builder
	b.WriteString("#!/bin/sh\n# Written by the berth-uki-install provisioner of packer-plugin-berth.\nset -eu\n")
	fmt.Fprintf(&b, "staging=%s\n", remote.Quote(c.StagingDirectory))
	b.WriteString(`collect() {
	real=$(readlink -f -- "$2") || real=
	if [ -z "$real" ] || [ ! -f "$real" ]; then
		echo "berth-uki-install: $3 $2 is not a regular file on this machine" >&2
		exit 1
	fi
	cp -- "$real" "$staging/$1"
	echo "$3: $2 is $real"
}
`)
	fmt.Fprintf(&b, "collect %s %s kernel\n", stagedKernel, remote.Quote(c.Kernel))
	fmt.Fprintf(&b, "collect %s %s initrd\n", stagedInitrd, remote.Quote(c.Initrd))
	fmt.Fprintf(&b, "collect %s %s os_release\n", stagedOSRelease, remote.Quote(c.OSRelease))
	if c.Cmdline == "" {
		fmt.Fprintf(&b, "cat /proc/cmdline >\"$staging/%s\"\necho \"cmdline: /proc/cmdline is $(cat /proc/cmdline)\"\n", stagedCmdline)
	}
	b.WriteString(`chown -R "${SUDO_UID:-$(id -u)}" "$staging"
`)
	return b.String()
}

// install is the script that checks the staged UKI against the SHA-256 of the one assembled, installs it
// as the ESP's removable-media boot loader and checks it there, and removes the staging directory, also
// when it fails.
func (c *Config) install(sum string) string {
	var b strings.Builder
	b.WriteString("#!/bin/sh\n# Written by the berth-uki-install provisioner of packer-plugin-berth.\nset -eu\n")
	fmt.Fprintf(&b, "staging=%s\nsum=%s\n", remote.Quote(c.StagingDirectory), sum)
	if c.VerifiedRoot != nil {
		// The image's ESP, which seal made, mounted for the copy.
		fmt.Fprintf(&b, "device=%s\nesp=%s\n", remote.Quote(c.VerifiedRoot.Device), imageESPDir)
		b.WriteString(`esp_part=$(lsblk -lnpo NAME "$(readlink -f -- "$device")" | sed -n 2p)
mkdir -p "$esp"
mount -t vfat "$esp_part" "$esp"
trap 'umount "$esp" && rmdir "$esp"; rm -rf "$staging"' EXIT
`)
	} else {
		fmt.Fprintf(&b, "esp=%s\ntrap 'rm -rf \"$staging\"' EXIT\n", remote.Quote(c.ESP))
	}
	fmt.Fprintf(&b, `cd "$staging"

# What arrived is what was assembled and predicted; nothing is installed otherwise.
echo "$sum  %[1]s" | sha256sum -c >/dev/null || { echo "berth-uki-install: the staged UKI differs from the one assembled; nothing was installed" >&2; exit 1; }

# The ESP itself is never made here: a missing one means esp names the wrong directory, and a UKI written
# there would not be on the partition the firmware reads.
if [ ! -d "$esp" ]; then
	echo "berth-uki-install: the EFI system partition $esp is not a directory on this machine: set esp to its mount point" >&2
	exit 1
fi
target="$esp/EFI/BOOT/BOOTX64.EFI"
mkdir -p "$esp/EFI/BOOT"
# Copied beside the target and renamed over it, so an interrupted copy never leaves half a boot loader.
cp -- %[1]s "$target.new"
mv -f -- "$target.new" "$target"
sync
echo "$sum  $target" | sha256sum -c >/dev/null || { echo "berth-uki-install: $target differs from the UKI after the copy" >&2; exit 1; }
echo "installed $target (sha256 $sum)"
`, stagedUKI)
	return b.String()
}

// Names of the verified root's scripts and of the record sealScript leaves for download.
const (
	prepareScript = "prepare.sh"
	sealScript    = "seal.sh"
	stagedVerity  = "verity"
)

// verityTools are what the verified root's scripts run, each with the Debian package that has it.
var verityTools = [][2]string{
	{"veritysetup", "cryptsetup-bin"}, {"mkfs.erofs", "erofs-utils"}, {"mkfs.vfat", "dosfstools"},
	{"sfdisk", "fdisk"}, {"update-initramfs", "initramfs-tools"}, {"findmnt", "util-linux"},
	{"lsblk", "util-linux"}, {"blockdev", "util-linux"}, {"blkid", "util-linux"}, {"partx", "util-linux"},
	{"od", "coreutils"},
}

// prepare is the script that, for a verified root, checks the tools and the device, then runs
// verity.InitrdScript: the machine's initrds (which collect then fetches) learn to open the root.
func (c *Config) prepare() string {
	var b strings.Builder
	b.WriteString("#!/bin/sh\n# Written by the berth-uki-install provisioner of packer-plugin-berth.\nset -eu\n")
	fmt.Fprintf(&b, "device=%s\n", remote.Quote(c.VerifiedRoot.Device))
	b.WriteString(`fail() { echo "berth-uki-install: $*" >&2; exit 1; }
export PATH="$PATH:/usr/sbin:/sbin"
`)
	for _, t := range verityTools {
		fmt.Fprintf(&b, "command -v %s >/dev/null || fail \"verified_root needs %s (Debian package %s) on this machine\"\n", t[0], t[0], t[1])
	}
	b.WriteString(`if [ ! -b "$device" ] && command -v udevadm >/dev/null; then
	# A link that a udev rule installed by this build makes (aws.pkr.hcl's /dev/disk/by-ebs-name/sdf)
	# appears only once udev has applied its rules to the disks already attached.
	udevadm control --reload || true
	udevadm trigger --action=change --subsystem-match=block || true
	udevadm settle --timeout=30 || true
fi
[ -b "$device" ] || fail "verified_root.device $device is not a block device on this machine"
dev=$(readlink -f -- "$device")
[ "$(lsblk -dno TYPE "$dev")" = disk ] || fail "verified_root.device $device ($dev) is not a whole disk: the image's partition table goes on it"
root_disk=$(lsblk -no PKNAME "$(findmnt -no SOURCE /)" || true)
[ "/dev/$root_disk" != "$dev" ] || fail "verified_root.device $device is the disk this machine runs from: attach a second disk for the image"
if lsblk -no MOUNTPOINT "$dev" | grep -q .; then
	fail "verified_root.device $device has mounted file systems: it is overwritten with the image"
fi
echo "verified root: the image goes on $dev ($(($(blockdev --getsize64 "$dev") >> 20)) MiB)"

`)
	b.WriteString(verity.InitrdScript(c.ESP))
	return b.String()
}

// ESP's size on the image's disk: room for a UKI with a large initrd, and for the next.
const imageESPMiB = 64

// Where the verified root's scripts mount the root's snapshot and the image's ESP: outside the staging
// directory (see seal), removed with rmdir, which refuses a directory that is still a mount.
const (
	snapshotDir = "/run/berth-uki-install.root"
	imageESPDir = "/run/berth-uki-install.esp"
)

// seal is the script that writes the image onto the verified root's device: a GPT with an EFI system
// partition (empty until install) and the root partition, which holds the machine's root file system as
// erofs followed by its dm-verity hash tree. It leaves in the staging directory the partition's UUID, the
// data blocks, the hash tree's offset, the root hash and the salt, for the command line.
func (c *Config) seal() string {
	var b strings.Builder
	b.WriteString("#!/bin/sh\n# Written by the berth-uki-install provisioner of packer-plugin-berth.\nset -eu\n")
	fmt.Fprintf(&b, "staging=%s\ndevice=%s\nesp_mib=%d\n", remote.Quote(c.StagingDirectory), remote.Quote(c.VerifiedRoot.Device), imageESPMiB)
	b.WriteString(`fail() { echo "berth-uki-install: $*" >&2; exit 1; }
export PATH="$PATH:/usr/sbin:/sbin"
dev=$(readlink -f -- "$device")
# The root file system alone, without what is mounted on it (/proc, /boot/efi, ...). Never inside the
# staging directory, which is removed with rm -rf: through this bind, that would remove the machine's root.
snapshot=` + snapshotDir + `
mkdir -p "$snapshot"
mount --bind / "$snapshot"
trap 'umount "$snapshot" && rmdir "$snapshot"' EXIT
sync

sfdisk --quiet --wipe always "$dev" <<TABLE
label: gpt
size=${esp_mib}MiB, type=C12A7328-F81F-11D2-BA4B-00A0C93EC93B, name=esp
type=4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709, name=berth-root
TABLE
partx --update "$dev" 2>/dev/null || blockdev --rereadpt "$dev"
udevadm settle 2>/dev/null || true
esp_part=$(lsblk -lnpo NAME "$dev" | sed -n 2p)
root_part=$(lsblk -lnpo NAME "$dev" | sed -n 3p)
[ -b "$esp_part" ] && [ -b "$root_part" ] || fail "the partitions of $dev did not appear"

# What is only this build's (the staging directory, temporary files) stays out.
staging_rel=${staging#/}
echo "verified root: making the erofs root file system..."
mkfs.erofs --quiet -zlz4 --exclude-path="$staging_rel" --exclude-regex='^(tmp|var/tmp)/.' "$root_part" "$snapshot" ||
	fail "mkfs.erofs failed: is $root_part large enough for the root file system?"
# The superblock (at 1024) counts 4 KiB blocks at byte 36.
blocks=$(od -An -tu4 -j 1060 -N 4 "$root_part" | tr -d ' ')
[ -n "$blocks" ] && [ "$blocks" -gt 0 ] || fail "no erofs superblock on $root_part after mkfs.erofs"
offset=$((blocks * 4096))
echo "verified root: hashing $((offset >> 20)) MiB..."
veritysetup format "$root_part" "$root_part" --no-superblock --data-blocks="$blocks" --hash-offset="$offset" \
	>"$staging/veritysetup.out" || fail "veritysetup format failed: is $root_part large enough for the hash tree too?"
roothash=$(sed -n 's/^Root hash:[[:space:]]*//p' "$staging/veritysetup.out")
salt=$(sed -n 's/^Salt:[[:space:]]*//p' "$staging/veritysetup.out")
partuuid=$(blkid -p -s PART_ENTRY_UUID -o value "$root_part" | tr 'A-F' 'a-f')
[ -n "$roothash" ] && [ -n "$salt" ] && [ -n "$partuuid" ] || fail "no root hash, salt or partition UUID: $(cat "$staging/veritysetup.out")"
mkfs.vfat -n ESP "$esp_part" >/dev/null
sync
echo "$partuuid:$blocks:$offset:$roothash:$salt" >"$staging/` + stagedVerity + `"
chown -R "${SUDO_UID:-$(id -u)}" "$staging/` + stagedVerity + `"
echo "verified root: $((offset >> 20)) MiB of erofs on $root_part, root hash $roothash"
`)
	return b.String()
}
