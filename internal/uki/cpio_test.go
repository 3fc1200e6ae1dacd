package uki

import (
	"bytes"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
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
	wantList := "init\netc\netc/berth\netc/berth/agent.yaml\nusr\nusr/lib\nusr/lib/empty\na\na/b\na/b/c\na/b/c/odd\n"
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
		if !e.Mode.IsDir() {
			if data, _ := os.ReadFile(p); !bytes.Equal(data, e.Data) {
				t.Errorf("%s: %d bytes differ from the %d given", e.Path, len(data), len(e.Data))
			}
		}
	}
	for _, d := range []string{"etc/berth", "usr", "usr/lib", "a/b/c"} {
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
		{[]Entry{{Path: "dev/null", Mode: fs.ModeDevice | 0o666}}, "only regular files and directories"},
		{[]Entry{{Path: "bin/sh", Mode: fs.ModeSymlink | 0o777}}, "only regular files and directories"},
		{[]Entry{{Path: "etc", Mode: fs.ModeDir | 0o755, Data: []byte("x")}}, "a directory with data"},
		{[]Entry{{Path: "init", Mode: 0o755}, {Path: "/init", Mode: 0o644}}, "init given twice"},
		{[]Entry{{Path: "etc/x", Mode: 0o644}, {Path: "etc", Mode: fs.ModeDir | 0o700}}, "etc given twice"},
	} {
		if _, err := Cpio(tc.entries...); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Cpio(%+v) = %v, want an error containing %q", tc.entries, err, tc.want)
		}
	}
}
