package ukiinstall

import (
	"fmt"
	"strings"

	"github.com/berthlabs/berth/packer/internal/remote"
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
	fmt.Fprintf(&b, "staging=%s\nesp=%s\nsum=%s\n", remote.Quote(c.StagingDirectory), remote.Quote(c.ESP), sum)
	fmt.Fprintf(&b, `trap 'rm -rf "$staging"' EXIT
cd "$staging"

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
