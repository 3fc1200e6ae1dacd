// Package verity is what every Berth image with a verified root shares, whoever writes the root (the
// berth-uki-install provisioner on a build machine's second disk, the berth-uki builder into its raw disk):
// the initramfs-tools pieces that open it through dm-verity, and the kernel command line that carries its
// parameters, so that the UKI's measurements cover every byte of the root.
package verity

import (
	_ "embed"
	"fmt"
	"regexp"
	"slices"
	"strings"

	"github.com/berthlabs/berth/packer/internal/remote"
)

// RootDevice is the root the initrd opens; Panic is the reboot delay a command line without panic= gets.
const (
	RootDevice = "/dev/mapper/berth-root"
	Panic      = "panic=30"
)

// The initramfs-tools pieces that open a verified root (initramfs/): installed into the image's root by
// InitrdScript, built into the initrd the UKI embeds.
var (
	//go:embed initramfs/hook
	InitramfsHook string
	//go:embed initramfs/local-top
	InitramfsLocalTop string
	//go:embed initramfs/init-bottom
	InitramfsInitBottom string
)

// recordPattern is a verified root's record: partition UUID, data blocks, hash offset, root hash and salt.
var recordPattern = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}:[1-9][0-9]*:[1-9][0-9]*:[0-9a-f]{64}:[0-9a-f]{64}$`)

// Record is the berth.verity= value the local-top piece reads:
// <partition UUID>:<data blocks>:<hash offset in bytes>:<root hash>:<salt>, all lower-case.
func Record(partUUID string, blocks, hashOffset int64, rootHash, salt string) string {
	return fmt.Sprintf("%s:%d:%d:%s:%s", strings.ToLower(partUUID), blocks, hashOffset, rootHash, salt)
}

// Cmdline is line with its root items (root=, rootfstype=, rootflags=, ro, rw) replaced by the verified
// root's, and berth.verity= with record. Without panic=, it gets one: the initrd then reboots instead of
// offering a shell on the console when the root does not open, and the kernel reboots after a block failed
// verification, instead of halting; a shell would run with the image's measurements.
func Cmdline(line, record string) (string, error) {
	record = strings.TrimSpace(record)
	if !recordPattern.MatchString(record) {
		return "", fmt.Errorf("the verified root's record %q is not <partition UUID>:<data blocks>:<hash offset>:<sha256 root hash>:<salt>", record)
	}
	var kept, initArgs []string
	panicSet := false
	items := strings.Fields(line)
	// What follows -- is init's, not the kernel's: the root's items go before it.
	if i := slices.Index(items, "--"); i >= 0 {
		items, initArgs = items[:i], items[i:]
	}
	for _, item := range items {
		switch {
		case item == "ro" || item == "rw" || strings.HasPrefix(item, "root=") || strings.HasPrefix(item, "rootfstype=") ||
			strings.HasPrefix(item, "rootflags=") || strings.HasPrefix(item, "berth.verity="):
			continue
		case strings.HasPrefix(item, "panic="):
			panicSet = true
		}
		kept = append(kept, item)
	}
	kept = append(kept, "root="+RootDevice, "rootfstype=erofs", "ro", "berth.verity="+record)
	if !panicSet {
		kept = append(kept, Panic)
	}
	return strings.Join(append(kept, initArgs...), " "), nil
}

// InitrdScript is shell, run as root on the image's root (a build machine, or a chroot of a root
// directory), that teaches its initramfs-tools to open a verified root, rebuilds its initrds, and drops the
// fstab entries of / and of esp: the image has neither the build's root nor its ESP, and systemd would wait
// for them and stop in emergency mode. It needs initramfs-tools, veritysetup and awk there.
func InitrdScript(esp string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "esp=%s\n", remote.Quote(esp))
	b.WriteString("install -d /etc/initramfs-tools/hooks /etc/initramfs-tools/scripts/local-top /etc/initramfs-tools/scripts/init-bottom\n")
	for _, f := range []struct{ path, content string }{
		{"/etc/initramfs-tools/hooks/berth-verity", InitramfsHook},
		{"/etc/initramfs-tools/scripts/local-top/berth-verity", InitramfsLocalTop},
		{"/etc/initramfs-tools/scripts/init-bottom/berth-verity", InitramfsInitBottom},
	} {
		fmt.Fprintf(&b, "cat >%s <<'BERTH_EOF'\n%sBERTH_EOF\nchmod 0755 %[1]s\n", f.path, f.content)
	}
	b.WriteString(`update-initramfs -u -k all

if [ -f /etc/fstab ]; then
	awk -v esp="$esp" '/^[[:space:]]*(#|$)/ || ($2 != "/" && $2 != esp)' /etc/fstab >/etc/fstab.berth
	cat /etc/fstab.berth >/etc/fstab
	rm -f /etc/fstab.berth
fi
`)
	return b.String()
}
