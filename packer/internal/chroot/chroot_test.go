package chroot

import (
	"bytes"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/berthlabs/berth/packer/internal/chroot/chroottest"
)

func TestChrootCommunicator(t *testing.T) {
	root := chroottest.ShellTree(t)
	comm := &Communicator{Root: root}

	out, status := chroottest.Run(t, comm, `mkdir -p /etc/berth && echo "$PATH" > /etc/berth/path && cat /etc/berth/path`)
	if status != 0 || !strings.HasPrefix(out, "/usr/local/sbin:") {
		t.Errorf("command in the chroot: status %d, output %q; want the image's PATH", status, out)
	}
	if data, err := os.ReadFile(filepath.Join(root, "etc/berth/path")); err != nil || !strings.HasPrefix(string(data), "/usr/local/sbin:") {
		t.Errorf("the command's file is not in the tree: %q, %v", data, err)
	}
	// Install scripts write to /dev/null and read /proc; neither leaves anything in the tree.
	if out, status := chroottest.Run(t, comm, "echo discarded > /dev/null && cat /proc/self/comm"); status != 0 || out != "cat\n" {
		t.Errorf("/dev/null and /proc in the chroot: status %d, output %q", status, out)
	}
	for _, d := range []string{"dev", "proc"} {
		if entries, err := os.ReadDir(filepath.Join(root, d)); err != nil || len(entries) != 0 {
			t.Errorf("%s in the tree after the command: %d entries, %v; want an empty directory", d, len(entries), err)
		}
	}
	if _, status := chroottest.Run(t, comm, "exit 7"); status != 7 {
		t.Errorf("exit 7 gave status %d", status)
	}

	fi := fs.FileInfo(fakeInfo{mode: 0o600})
	if err := comm.Upload("/etc/berth/agent.yaml", strings.NewReader("role: worker\n"), &fi); err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(filepath.Join(root, "etc/berth/agent.yaml")); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("uploaded file: %v, %v; want mode 0600", st, err)
	}
	var got bytes.Buffer
	if err := comm.Download("/etc/berth/agent.yaml", &got); err != nil || got.String() != "role: worker\n" {
		t.Errorf("Download = %q, %v", got.String(), err)
	}

	src := t.TempDir()
	for name, content := range map[string]string{"units/a.service": "a", "units/sub/b.conf": "b", "units/skip.tmp": "x"} {
		p := filepath.Join(src, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := comm.UploadDir("/etc/systemd", filepath.Join(src, "units"), []string{"*.tmp"}); err != nil {
		t.Fatal(err)
	}
	if err := comm.UploadDir("/opt", filepath.Join(src, "units")+"/", nil); err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]bool{"etc/systemd/units/a.service": true, "etc/systemd/units/sub/b.conf": true,
		"etc/systemd/units/skip.tmp": false, "opt/a.service": true, "opt/sub/b.conf": true} {
		if _, err := os.Stat(filepath.Join(root, name)); (err == nil) != want {
			t.Errorf("%s after UploadDir: %v, want present=%v", name, err, want)
		}
	}

	// A link in the image pointing out of it must not lead an upload or a download to the host.
	outside := t.TempDir()
	if err := os.Symlink(outside, filepath.Join(root, "escape")); err != nil {
		t.Fatal(err)
	}
	if err := comm.Upload("/escape/x", strings.NewReader("x"), nil); err == nil {
		t.Error("an upload through a link out of the tree succeeded")
	}
	if _, err := os.Stat(filepath.Join(outside, "x")); err == nil {
		t.Error("an upload wrote outside the tree")
	}
	if err := comm.Download("/../../etc/passwd", io.Discard); err == nil {
		t.Error("a download of /../../etc/passwd succeeded: it must stay in the tree")
	}
	if err := comm.Upload("relative", strings.NewReader("x"), nil); err == nil || !strings.Contains(err.Error(), "want an absolute path") {
		t.Errorf("relative upload: %v", err)
	}
	if err := comm.DownloadDir("/etc", t.TempDir(), nil); err == nil || !strings.Contains(err.Error(), "downloads files only") {
		t.Errorf("DownloadDir: %v", err)
	}
}

type fakeInfo struct {
	fs.FileInfo
	mode fs.FileMode
}

func (f fakeInfo) Mode() fs.FileMode { return f.mode }
