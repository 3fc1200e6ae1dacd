package uki

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	packersdk "github.com/hashicorp/packer-plugin-sdk/packer"
)

func TestPrepare(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	existing := filepath.Join(dir, "existing")
	if err := os.Mkdir(existing, 0o755); err != nil {
		t.Fatal(err)
	}
	valid := func(extra map[string]any) map[string]any {
		raw := map[string]any{"stub": file, "kernel": file, "cmdline": "console=ttyS0",
			"output_directory": filepath.Join(dir, "out")}
		for k, v := range extra {
			raw[k] = v
		}
		return raw
	}
	for _, tc := range []struct {
		name string
		raw  map[string]any
		want string
	}{
		{"valid", valid(nil), ""},
		{"no stub", valid(map[string]any{"stub": ""}), "stub is required"},
		{"missing kernel", valid(map[string]any{"kernel": filepath.Join(dir, "nope")}), "kernel: stat"},
		{"kernel is a directory", valid(map[string]any{"kernel": dir}), "is not a regular file"},
		{"no cmdline", valid(map[string]any{"cmdline": " "}), "cmdline is required"},
		{"bad name", valid(map[string]any{"name": "../x"}), `name "../x"`},
		{"relative destination", valid(map[string]any{"initrd_files": []map[string]any{{"source": file, "destination": "init"}}}),
			`initrd_files[0]: destination "init": want a clean absolute path`},
		{"root destination", valid(map[string]any{"initrd_files": []map[string]any{{"source": file, "destination": "/"}}}),
			`destination "/"`},
		{"unclean destination", valid(map[string]any{"initrd_files": []map[string]any{{"source": file, "destination": "/a/../init"}}}),
			`destination "/a/../init"`},
		{"same destination twice", valid(map[string]any{"initrd_files": []map[string]any{
			{"source": file, "destination": "/init"}, {"source": file, "destination": "/init"}}}),
			"initrd_files[1]: destination /init is also initrd_files[0]'s"},
		{"missing source", valid(map[string]any{"initrd_files": []map[string]any{{"destination": "/init"}}}),
			"initrd_files[0]: source is required"},
		{"bad mode", valid(map[string]any{"initrd_files": []map[string]any{{"source": file, "destination": "/init", "mode": "0999"}}}),
			`initrd_files[0]: mode "0999"`},
		{"mode too wide", valid(map[string]any{"initrd_files": []map[string]any{{"source": file, "destination": "/init", "mode": "04755"}}}),
			`mode "04755"`},
		{"missing appended initrd", valid(map[string]any{"initrd_append": []string{file, filepath.Join(dir, "nope")}}),
			"initrd_append[1]: stat"},
		{"missing root directory", valid(map[string]any{"root_directory": filepath.Join(dir, "nope")}), "root_directory: stat"},
		{"root directory is a file", valid(map[string]any{"root_directory": file}), "is not a directory"},
		{"verified root", valid(map[string]any{"verified_root": true, "kernel": "", "root_directory": existing}), ""},
		{"verified root with a kernel", valid(map[string]any{"verified_root": true, "root_directory": existing}),
			"kernel: verified_root boots the root's own kernel"},
		{"verified root without a root", valid(map[string]any{"verified_root": true, "kernel": ""}), "verified_root needs root_directory"},
		{"verified root with initrd_append", valid(map[string]any{"verified_root": true, "kernel": "", "root_directory": existing,
			"initrd_append": []string{file}}), "initrd_append: verified_root boots the root's own initrd"},
		{"no kernel without a verified root", valid(map[string]any{"kernel": ""}), "kernel is required"},
		{"bad disk size", valid(map[string]any{"disk_size": "64X"}), `disk_size: "64X"`},
		{"negative disk size", valid(map[string]any{"disk_size": "-1M"}), `disk_size: "-1M"`},
		{"existing output directory", valid(map[string]any{"output_directory": existing}), "exists: remove it, or run packer build -force"},
		{"existing output directory with -force", valid(map[string]any{"output_directory": existing, "packer_force": true}), ""},
		{"working directory as output", valid(map[string]any{"output_directory": "./", "packer_force": true}), "want a directory of its own"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := &Builder{}
			_, _, err := b.Prepare(tc.raw)
			if (err == nil) != (tc.want == "") || (err != nil && !strings.Contains(err.Error(), tc.want)) {
				t.Errorf("Prepare = %v, want %q", err, tc.want)
			}
		})
	}
}

func TestPrepareDefaults(t *testing.T) {
	file := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(file, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	b := &Builder{}
	raw := map[string]any{"stub": file, "kernel": file, "cmdline": "quiet", "packer_build_name": "local",
		"initrd_files": []map[string]any{{"source": file, "destination": "/init"}, {"source": file, "destination": "/etc/x", "mode": "600"}}}
	if _, _, err := b.Prepare(raw); err != nil {
		t.Fatal(err)
	}
	c := b.config
	if c.Name != "berth" || c.OutputDirectory != "output-local" || c.OSRelease != DefaultOSRelease || b.config.diskSize != 0 {
		t.Errorf("defaults: name %q, output_directory %q, os_release %q, disk size %d", c.Name, c.OutputDirectory, c.OSRelease, b.config.diskSize)
	}
	if b.config.modes[0] != 0o755 || b.config.modes[1] != 0o600 {
		t.Errorf("modes %v, want 0755 by default and 0600 as given", b.config.modes)
	}
}

func TestParseSize(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64
	}{
		{"64", 64 << 20}, {"64M", 64 << 20}, {"512k", 512 << 10}, {"1G", 1 << 30}, {"2T", 2 << 40},
		{"", 0}, {"M", 0}, {"0", 0}, {"1.5G", 0}, {"64MB", 0}, {"99999999999T", 0},
	} {
		got, err := parseSize(tc.in)
		if got != tc.want || (err == nil) != (tc.want != 0) {
			t.Errorf("parseSize(%q) = %d, %v; want %d", tc.in, got, err, tc.want)
		}
	}
}

// TestDocsListEveryOption keeps the hand-written documentation in step with Config: every option of the
// HCL2 spec that packer-sdc generates is documented, with the options of initrd_files blocks, and nothing
// else is.
func TestDocsListEveryOption(t *testing.T) {
	doc, err := os.ReadFile("../../docs/builders/uki.mdx")
	if err != nil {
		t.Fatal(err)
	}
	_, reference, _ := strings.Cut(string(doc), "## Configuration Reference")
	reference, _, _ = strings.Cut(reference, "## Example Usage")
	documented := map[string]bool{}
	for _, line := range strings.Split(reference, "\n") {
		if name, ok := strings.CutPrefix(strings.TrimLeft(line, " "), "- `"); ok {
			name, _, _ = strings.Cut(name, "`")
			documented[name] = true
		}
	}
	options := map[string]bool{}
	for name := range (&Builder{}).ConfigSpec() {
		if !strings.HasPrefix(name, "packer_") {
			options[name] = true
		}
	}
	for name := range new(FlatInitrdFile).HCL2Spec() {
		options[name] = true
	}
	for name := range options {
		if !documented[name] {
			t.Errorf("option %s is not documented in packer/docs/builders/uki.mdx", name)
		}
		delete(documented, name)
	}
	for name := range documented {
		t.Errorf("packer/docs/builders/uki.mdx documents %s, which is no option", name)
	}
}

// TestDiskReproducible makes the disk of one UKI twice, more than a FAT time step apart, and finds the same bytes; and
// sfdisk reads back an ESP at the partition the builder copied the file system to.
func TestDiskReproducible(t *testing.T) {
	dir := t.TempDir()
	uki := filepath.Join(dir, "berth.efi")
	if err := os.WriteFile(uki, bytes.Repeat([]byte("berth uki "), 100_000), 0o644); err != nil {
		t.Fatal(err)
	}
	var disks [2][]byte
	for i := range disks {
		if i > 0 {
			time.Sleep(2100 * time.Millisecond) // FAT stores times to two seconds
		}
		raw := filepath.Join(dir, fmt.Sprintf("disk%d.raw", i))
		l, err := newLayout(1_000_000, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := makeDisk(context.Background(), raw, uki, l); err != nil {
			t.Fatal(err)
		}
		data, err := os.ReadFile(raw)
		if err != nil {
			t.Fatal(err)
		}
		disks[i] = data
	}
	if !bytes.Equal(disks[0], disks[1]) {
		t.Error("the same UKI made two different disks")
	}
	parts, err := partitions(context.Background(), filepath.Join(dir, "disk0.raw"), espType)
	if err != nil || parts[0].start != 2048 || parts[0].sectors <= 0 {
		t.Errorf("ESP at %+v (%v); want it at sector 2048", parts, err)
	}
}

// TestDiskWithVerifiedRoot seals a small root with the real mkfs.erofs and veritysetup, lays out a disk with
// it, and checks that the disk's second partition is the root's image, that veritysetup verifies that
// partition with nothing but the record the command line gets, and refuses it once one byte changed.
func TestDiskWithVerifiedRoot(t *testing.T) {
	for _, tool := range []string{"mkfs.erofs", "veritysetup", "sfdisk", "mkfs.vfat", "mcopy"} {
		if _, err := lookTool(tool); err != nil {
			t.Skipf("%v: make deps installs it", err)
		}
	}
	dir := t.TempDir()
	tree := filepath.Join(dir, "root")
	for name, data := range map[string]string{"etc/os-release": "ID=debian\n", "usr/bin/kubelet": strings.Repeat("kubelet ", 200_000), "tmp/build-only": "x"} {
		if err := os.MkdirAll(filepath.Dir(filepath.Join(tree, name)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(tree, name), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	ctx := context.Background()
	root, err := sealRoot(ctx, packersdk.TestUi(t), tree, filepath.Join(dir, "root.img"))
	if err != nil {
		t.Fatal(err)
	}
	uki := filepath.Join(dir, "berth.efi")
	if err := os.WriteFile(uki, bytes.Repeat([]byte("berth uki "), 100_000), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := newLayout(1_000_000, root, 64<<20); err == nil || !strings.Contains(err.Error(), "and the verified root") {
		t.Errorf("a 64 MiB disk for an ESP of 64 MiB and a root: %v, want it refused", err)
	}
	l, err := newLayout(1_000_000, root, 0)
	if err != nil {
		t.Fatal(err)
	}
	raw := filepath.Join(dir, "berth.raw")
	if err := makeDisk(ctx, raw, uki, l); err != nil {
		t.Fatal(err)
	}
	parts, err := partitions(ctx, raw, espType, rootType)
	if err != nil {
		t.Fatal(err)
	}
	if parts[0].start != 2048 || parts[0].sectors*512 != imageESPSize {
		t.Errorf("ESP at %+v, want sector 2048 and %d bytes", parts[0], imageESPSize)
	}
	image, err := os.ReadFile(root.image)
	if err != nil {
		t.Fatal(err)
	}
	disk, err := os.ReadFile(raw)
	if err != nil {
		t.Fatal(err)
	}
	part := disk[parts[1].start*512 : (parts[1].start+parts[1].sectors)*512]
	if !bytes.Equal(part[:len(image)], image) {
		t.Fatal("the root's partition does not start with the root's image")
	}
	out, err := exec.Command("sfdisk", "--part-uuid", raw, "2").Output()
	if err != nil || !strings.EqualFold(strings.TrimSpace(string(out)), root.uuid) {
		t.Errorf("partition 2's UUID is %q (%v), want %s", out, err, root.uuid)
	}

	// The record as the initrd's local-top reads it.
	fields := strings.Split(root.record, ":")
	if len(fields) != 5 || !strings.EqualFold(fields[0], root.uuid) {
		t.Fatalf("record %q does not name the partition %s", root.record, root.uuid)
	}
	verify := func(p []byte) error {
		f := filepath.Join(dir, "part")
		if err := os.WriteFile(f, p, 0o644); err != nil {
			t.Fatal(err)
		}
		out, err := exec.Command("veritysetup", "verify", f, f, fields[3], "--no-superblock", "--data-blocks="+fields[1],
			"--hash-offset="+fields[2], "--salt="+fields[4]).CombinedOutput()
		if err != nil {
			return fmt.Errorf("%v: %s", err, out)
		}
		return nil
	}
	if err := verify(part); err != nil {
		t.Errorf("veritysetup verify of the root's partition with the record: %v", err)
	}
	changed := bytes.Clone(part)
	changed[len(image)/3] ^= 1
	if err := verify(changed); err == nil {
		t.Error("veritysetup verified the root's partition with one byte changed")
	}
	// The build's own files in /tmp are no part of the image.
	extract := filepath.Join(dir, "extract")
	if out, err := exec.Command("fsck.erofs", "--extract="+extract, root.image).CombinedOutput(); err != nil {
		t.Fatalf("fsck.erofs --extract: %v: %s", err, out)
	}
	if data, err := os.ReadFile(filepath.Join(extract, "etc/os-release")); err != nil || string(data) != "ID=debian\n" {
		t.Errorf("the root's image holds etc/os-release = %q (%v)", data, err)
	}
	if _, err := os.Stat(filepath.Join(extract, "tmp/build-only")); err == nil {
		t.Error("the root's image holds what the build left in /tmp")
	}
}

func TestErofsBlocksRefusesOtherFiles(t *testing.T) {
	f := filepath.Join(t.TempDir(), "not-erofs")
	if err := os.WriteFile(f, make([]byte, 8192), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := erofsBlocks(f); err == nil || !strings.Contains(err.Error(), "no erofs superblock") {
		t.Errorf("erofsBlocks of zeros: %v, want no erofs superblock", err)
	}
	if _, err := erofsBlocks(filepath.Join(t.TempDir(), "missing")); err == nil {
		t.Error("erofsBlocks of a missing file succeeded")
	}
}
