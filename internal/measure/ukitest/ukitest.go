// Package ukitest builds real unified kernel images (UKIs) for tests: Debian's systemd-stub and kernel,
// fetched once by scripts/boot-parts.sh, joined with objcopy the way systemd's documentation shows for
// systems without ukify (Debian 12 has none). Tests of the measurement prediction and the real-boot test
// use the same images.
package ukitest

import (
	"bytes"
	"debug/pe"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// Parts are the files a UKI is made of.
type Parts struct {
	// Stub is systemd-stub (linuxx64.efi.stub from systemd-boot-efi).
	Stub string
	// Kernel is the vmlinuz of the kernel package linux-image-amd64 points to.
	Kernel string
}

// BootParts runs scripts/boot-parts.sh, which downloads the Debian packages into a cache on first use, and
// returns the parts. It fails the test when apt cannot fetch them.
func BootParts(t testing.TB) Parts {
	t.Helper()
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		t.Fatal("ukitest: cannot locate its own source file to find scripts/boot-parts.sh")
	}
	script := filepath.Join(filepath.Dir(file), "..", "..", "..", "scripts", "boot-parts.sh")
	var stdout, stderr bytes.Buffer
	cmd := exec.Command(script)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("scripts/boot-parts.sh failed (it needs apt and the Debian archive to fetch systemd-boot-efi and linux-image-amd64): %v\n%s", err, stderr.String())
	}
	lines := strings.Split(strings.TrimSpace(stdout.String()), "\n")
	dir := lines[len(lines)-1]
	parts := Parts{Stub: filepath.Join(dir, "linuxx64.efi.stub"), Kernel: filepath.Join(dir, "vmlinuz")}
	for _, f := range []string{parts.Stub, parts.Kernel} {
		if _, err := os.Stat(f); err != nil {
			t.Fatalf("scripts/boot-parts.sh printed %s, which lacks a part: %v", dir, err)
		}
	}
	return parts
}

// Section is one section to add to the stub.
type Section struct {
	Name string
	Data []byte
}

// Build adds sections, in the order given, to a copy of stub with objcopy and returns the UKI's path in
// a temporary directory of t. The sections are placed after the stub's last section, each at the next
// address aligned to the stub's SectionAlignment, as systemd's documentation computes them from the stub's
// headers.
func Build(t testing.TB, stub string, sections ...Section) string {
	t.Helper()
	objcopy, err := exec.LookPath("objcopy")
	if err != nil {
		t.Fatal("objcopy not found: install binutils")
	}
	next, align, err := firstFreeAddress(stub)
	if err != nil {
		t.Fatalf("reading the stub's headers: %v", err)
	}
	dir := t.TempDir()
	var args []string
	for i, s := range sections {
		file := filepath.Join(dir, fmt.Sprintf("section%d", i))
		if err := os.WriteFile(file, s.Data, 0o600); err != nil {
			t.Fatal(err)
		}
		args = append(args,
			"--add-section", s.Name+"="+file,
			"--change-section-vma", fmt.Sprintf("%s=%#x", s.Name, next))
		next = alignUp(next+uint64(len(s.Data)), align)
	}
	out := filepath.Join(dir, "uki.efi")
	args = append(args, stub, out)
	if b, err := exec.Command(objcopy, args...).CombinedOutput(); err != nil {
		t.Fatalf("objcopy %s: %v\n%s", strings.Join(args, " "), err, b)
	}
	return out
}

// firstFreeAddress returns the first address after the stub's sections that is aligned to its
// SectionAlignment, and that alignment. Addresses include ImageBase, as objcopy's VMAs do.
func firstFreeAddress(stub string) (next, align uint64, err error) {
	f, err := pe.Open(stub)
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	var base uint64
	switch oh := f.OptionalHeader.(type) {
	case *pe.OptionalHeader64:
		base, align = oh.ImageBase, uint64(oh.SectionAlignment)
	case *pe.OptionalHeader32:
		base, align = uint64(oh.ImageBase), uint64(oh.SectionAlignment)
	default:
		return 0, 0, fmt.Errorf("%s has no optional header", stub)
	}
	if align == 0 {
		return 0, 0, fmt.Errorf("%s has SectionAlignment 0", stub)
	}
	var end uint64
	for _, s := range f.Sections {
		end = max(end, uint64(s.VirtualAddress)+uint64(max(s.VirtualSize, s.Size)))
	}
	return alignUp(base+end, align), align, nil
}

func alignUp(n, align uint64) uint64 { return (n + align - 1) / align * align }

// Cpio returns a newc cpio archive holding one regular file (mode 0644): enough of an initrd to measure,
// in the format the kernel unpacks.
func Cpio(name string, data []byte) []byte { return cpio(name, 0o644, data) }

// CpioExecutable is Cpio with the file executable (mode 0755), as an initrd's /init must be to run.
func CpioExecutable(name string, data []byte) []byte { return cpio(name, 0o755, data) }

func cpio(name string, perm uint32, data []byte) []byte {
	var b bytes.Buffer
	entry := func(name string, mode uint32, data []byte) {
		// newc: magic, then 13 eight-digit hex fields: ino, mode, uid, gid, nlink, mtime, filesize,
		// devmajor, devminor, rdevmajor, rdevminor, namesize (with its NUL), check.
		fmt.Fprintf(&b, "070701%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x",
			1, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(name)+1, 0)
		b.WriteString(name)
		b.WriteByte(0)
		pad(&b)
		b.Write(data)
		pad(&b)
	}
	const regularFile = 0o100000
	entry(name, regularFile|perm, data)
	entry("TRAILER!!!", 0, nil)
	return b.Bytes()
}

// pad fills b to a multiple of four bytes, as newc aligns names and data.
func pad(b *bytes.Buffer) {
	for b.Len()%4 != 0 {
		b.WriteByte(0)
	}
}
