package uki

import (
	"bytes"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// TestWriteCpio unpacks the archive with GNU cpio, an independent reader, and checks every file's content
// and mode, and the directories WriteCpio added for them.
func TestWriteCpio(t *testing.T) {
	cpio, err := exec.LookPath("cpio")
	if err != nil {
		t.Fatal("cpio not found: run make deps (installs cpio)")
	}
	entries := []Entry{
		{Path: "/init", Mode: 0o755, Data: []byte("#!/bin/sh\n")},
		{Path: "etc", Mode: fs.ModeDir | 0o700},
		{Path: "etc/berth/agent.yaml", Mode: 0o600, Data: []byte("role: worker\n")},
		{Path: "usr/lib/empty", Mode: 0o644},
		{Path: "a/b/c/odd", Mode: 0o640, Data: bytes.Repeat([]byte{1}, 4097)},
		{Path: "bin/sh", Mode: fs.ModeSymlink | 0o777, Data: []byte("busybox")},
	}
	archive, err := Cpio(entries...)
	if err != nil {
		t.Fatal(err)
	}
	if len(archive)%4 != 0 {
		t.Errorf("archive of %d bytes, want a multiple of 4", len(archive))
	}
	again, err := Cpio(entries...)
	if err != nil || !bytes.Equal(again, archive) {
		t.Error("the same entries made a different archive")
	}

	dir := t.TempDir()
	cmd := exec.Command(cpio, "-i", "--make-directories", "--no-absolute-filenames", "--quiet")
	cmd.Dir, cmd.Stdin = dir, bytes.NewReader(archive)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("cpio -i: %v\n%s", err, out)
	}
	list := exec.Command(cpio, "-t", "--quiet")
	list.Stdin = bytes.NewReader(archive)
	out, err := list.Output()
	if err != nil {
		t.Fatalf("cpio -t: %v", err)
	}
	wantList := "init\netc\netc/berth\netc/berth/agent.yaml\nusr\nusr/lib\nusr/lib/empty\na\na/b\na/b/c\na/b/c/odd\nbin\nbin/sh\n"
	if string(out) != wantList {
		t.Errorf("cpio -t lists\n%s\nwant the entries in order, each after its parent directories:\n%s", out, wantList)
	}
	for _, e := range entries {
		p := filepath.Join(dir, strings.TrimPrefix(e.Path, "/"))
		fi, err := os.Lstat(p)
		if err != nil {
			t.Errorf("%s: %v", e.Path, err)
			continue
		}
		if fi.Mode() != e.Mode {
			t.Errorf("%s: mode %v, want %v", e.Path, fi.Mode(), e.Mode)
		}
		if e.Mode&fs.ModeSymlink != 0 {
			if target, _ := os.Readlink(p); target != string(e.Data) {
				t.Errorf("%s: link to %q, want %q", e.Path, target, e.Data)
			}
		} else if !e.Mode.IsDir() {
			if data, _ := os.ReadFile(p); !bytes.Equal(data, e.Data) {
				t.Errorf("%s: %d bytes differ from the %d given", e.Path, len(data), len(e.Data))
			}
		}
	}
	for _, d := range []string{"etc/berth", "usr", "usr/lib", "a/b/c", "bin"} {
		if fi, err := os.Stat(filepath.Join(dir, d)); err != nil || fi.Mode() != dirMode {
			t.Errorf("added directory %s: %v, %v; want %v", d, fi.Mode(), err, dirMode)
		}
	}
}

func TestWriteCpioRefuses(t *testing.T) {
	for _, tc := range []struct {
		entries []Entry
		want    string
	}{
		{[]Entry{{Path: ""}}, "want a clean path"},
		{[]Entry{{Path: "/"}}, "want a clean path"},
		{[]Entry{{Path: "../etc/passwd"}}, "want a clean path"},
		{[]Entry{{Path: "a//b"}}, "want a clean path"},
		{[]Entry{{Path: "dev/null", Mode: fs.ModeDevice | 0o666}}, "only regular files, directories and symbolic links"},
		{[]Entry{{Path: "bin/sh", Mode: fs.ModeSymlink | 0o777}}, "a symbolic link without a target"},
		{[]Entry{{Path: "etc", Mode: fs.ModeDir | 0o755, Data: []byte("x")}}, "a directory with data"},
		{[]Entry{{Path: "init", Mode: 0o755}, {Path: "/init", Mode: 0o644}}, "init given twice"},
		{[]Entry{{Path: "etc/x", Mode: 0o644}, {Path: "etc", Mode: fs.ModeDir | 0o700}}, "etc given twice"},
	} {
		if _, err := Cpio(tc.entries...); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Cpio(%+v) = %v, want an error containing %q", tc.entries, err, tc.want)
		}
	}
}

// TestTreeEntries archives a tree the way a root file system for an initrd looks (setuid file, absolute and
// relative links, a hard link) and unpacks it with GNU cpio: the same tree comes back.
func TestTreeEntries(t *testing.T) {
	root := t.TempDir()
	for _, d := range []string{"bin", "etc/berth", "usr/lib"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	files := map[string]fs.FileMode{"bin/busybox": 0o755, "bin/su": fs.ModeSetuid | 0o755, "etc/berth/agent.yaml": 0o600}
	for name, mode := range files {
		p := filepath.Join(root, name)
		if err := os.WriteFile(p, []byte(name), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil {
			t.Fatal(err)
		}
	}
	links := map[string]string{"bin/sh": "busybox", "usr/lib/os-release": "/etc/os-release"}
	for name, target := range links {
		if err := os.Symlink(target, filepath.Join(root, name)); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Link(filepath.Join(root, "bin/busybox"), filepath.Join(root, "bin/ash")); err != nil {
		t.Fatal(err)
	}
	entries, err := TreeEntries(root)
	if err != nil {
		t.Fatal(err)
	}
	archive, err := Cpio(entries...)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	cmd := exec.Command("cpio", "-i", "--make-directories", "--no-absolute-filenames", "--quiet")
	cmd.Dir, cmd.Stdin = dir, bytes.NewReader(archive)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("cpio -i: %v\n%s", err, out)
	}
	files["bin/ash"] = 0o755
	for name, mode := range files {
		fi, err := os.Lstat(filepath.Join(dir, name))
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		if fi.Mode() != mode {
			t.Errorf("%s: mode %v, want %v", name, fi.Mode(), mode)
		}
		want := name
		if name == "bin/ash" {
			want = "bin/busybox"
		}
		if data, _ := os.ReadFile(filepath.Join(dir, name)); string(data) != want {
			t.Errorf("%s holds %q, want %q", name, data, want)
		}
	}
	for name, target := range links {
		if got, err := os.Readlink(filepath.Join(dir, name)); err != nil || got != target {
			t.Errorf("%s: link to %q (%v), want %q", name, got, err, target)
		}
	}

	if err := syscall.Mkfifo(filepath.Join(root, "etc/fifo"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := TreeEntries(root); err == nil || !strings.Contains(err.Error(), "etc/fifo is a named pipe") {
		t.Errorf("a tree with a named pipe: %v, want it refused naming the pipe", err)
	}
}
