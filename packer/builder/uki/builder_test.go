package uki

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
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
		if err := makeDisk(context.Background(), raw, uki, DefaultDiskSize); err != nil {
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
	start, sectors, err := espExtent(context.Background(), filepath.Join(dir, "disk0.raw"))
	if err != nil || start != 2048 || sectors <= 0 {
		t.Errorf("ESP at sector %d, %d sectors (%v); want it at 2048", start, sectors, err)
	}
}
