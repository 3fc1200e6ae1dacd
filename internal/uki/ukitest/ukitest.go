// Package ukitest builds real unified kernel images (UKIs) for tests: Debian's systemd-stub and kernel,
// fetched once by scripts/boot-parts.sh, joined by internal/uki as the berth-uki builder joins them. Tests of
// the measurement prediction and the real-boot test use the same images.
package ukitest

import (
	"context"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"testing"

	"github.com/berthlabs/berth/internal/repotest"
	"github.com/berthlabs/berth/internal/uki"
)

// Parts are the files a UKI is made of.
type Parts struct {
	// Stub is systemd-stub (linuxx64.efi.stub from systemd-boot-efi).
	Stub string
	// Kernel is the vmlinuz of the kernel package linux-image-amd64 points to.
	Kernel string
}

// GuestRoot runs scripts/guest-root.sh, which makes the node image's Debian root file system with the
// kernel modules of BootParts' kernel on first use (root, mmdebstrap), and returns its directory.
func GuestRoot(t testing.TB) string {
	t.Helper()
	return repotest.Script(t, "guest-root.sh", "it needs root, mmdebstrap and the Debian archive")
}

// BootParts runs scripts/boot-parts.sh, which downloads the Debian packages into a cache on first use, and
// returns the parts. It fails the test when apt cannot fetch them.
func BootParts(t testing.TB) Parts {
	t.Helper()
	dir := repotest.Script(t, "boot-parts.sh", "it needs apt and the Debian archive to fetch systemd-boot-efi and linux-image-amd64")
	parts := Parts{Stub: filepath.Join(dir, "linuxx64.efi.stub"), Kernel: filepath.Join(dir, "vmlinuz")}
	for _, f := range []string{parts.Stub, parts.Kernel} {
		if _, err := os.Stat(f); err != nil {
			t.Fatalf("scripts/boot-parts.sh printed %s, which lacks a part: %v", dir, err)
		}
	}
	return parts
}

// Section is one section to add to the stub.
type Section = uki.Section

// Build adds sections, in the order given, to a copy of stub with uki.Assemble and returns the UKI's path
// in a temporary directory of t.
func Build(t testing.TB, stub string, sections ...Section) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "uki.efi")
	if err := uki.Assemble(context.Background(), stub, out, sections...); err != nil {
		t.Fatal(err)
	}
	return out
}

// Cpio returns a newc cpio archive holding one regular file (mode 0644): enough of an initrd to measure,
// in the format the kernel unpacks.
func Cpio(name string, data []byte) []byte { return cpio(name, 0o644, data) }

// CpioExecutable is Cpio with the file executable (mode 0755), as an initrd's /init must be to run.
func CpioExecutable(name string, data []byte) []byte { return cpio(name, 0o755, data) }

// cpio panics on a name uki.WriteCpio refuses: tests pass constant names, so that is a bug in the test.
func cpio(name string, perm fs.FileMode, data []byte) []byte {
	b, err := uki.Cpio(uki.Entry{Path: name, Mode: perm, Data: data})
	if err != nil {
		panic(fmt.Sprintf("ukitest: %v", err))
	}
	return b
}
