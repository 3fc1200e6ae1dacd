package uki

import (
	"bytes"
	"context"
	"debug/elf"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	packersdk "github.com/hashicorp/packer-plugin-sdk/packer"

	"github.com/berthlabs/berth/internal/repotest"
	ukiimage "github.com/berthlabs/berth/internal/uki"
)

// shellTree is a root file system with a static busybox as /bin/sh, so that commands run in its chroot.
func shellTree(t *testing.T) string {
	t.Helper()
	repotest.NeedsRoot(t, "chroot")
	const busybox = "/bin/busybox"
	f, err := elf.Open(busybox)
	if err != nil {
		t.Fatalf("%s: %v (run make deps: installs busybox-static)", busybox, err)
	}
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			t.Fatalf("%s is dynamically linked: install busybox-static", busybox)
		}
	}
	f.Close()
	root := t.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "bin"), 0o755); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(busybox)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "bin/busybox"), data, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, applet := range []string{"sh", "cat", "mkdir", "echo"} {
		if err := os.Symlink("busybox", filepath.Join(root, "bin", applet)); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

func runIn(t *testing.T, comm packersdk.Communicator, command string) (string, int) {
	t.Helper()
	var out bytes.Buffer
	rc := &packersdk.RemoteCmd{Command: command, Stdout: &out, Stderr: &out}
	if err := comm.Start(context.Background(), rc); err != nil {
		t.Fatalf("%s: %v", command, err)
	}
	status := rc.Wait()
	return out.String(), status
}

func TestChrootCommunicator(t *testing.T) {
	root := shellTree(t)
	comm := &chrootCommunicator{root: root}

	out, status := runIn(t, comm, `mkdir -p /etc/berth && echo "$PATH" > /etc/berth/path && cat /etc/berth/path`)
	if status != 0 || !strings.HasPrefix(out, "/usr/local/sbin:") {
		t.Errorf("command in the chroot: status %d, output %q; want the image's PATH", status, out)
	}
	if data, err := os.ReadFile(filepath.Join(root, "etc/berth/path")); err != nil || !strings.HasPrefix(string(data), "/usr/local/sbin:") {
		t.Errorf("the command's file is not in the tree: %q, %v", data, err)
	}
	// Install scripts write to /dev/null and read /proc; neither leaves anything in the tree.
	if out, status := runIn(t, comm, "echo discarded > /dev/null && cat /proc/self/comm"); status != 0 || out != "cat\n" {
		t.Errorf("/dev/null and /proc in the chroot: status %d, output %q", status, out)
	}
	for _, d := range []string{"dev", "proc"} {
		if entries, err := os.ReadDir(filepath.Join(root, d)); err != nil || len(entries) != 0 {
			t.Errorf("%s in the tree after the command: %d entries, %v; want an empty directory", d, len(entries), err)
		}
	}
	if _, status := runIn(t, comm, "exit 7"); status != 7 {
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

// provisionHook stands for Packer's provisioners: it works on the communicator the builder hands it.
type provisionHook struct {
	t    *testing.T
	comm packersdk.Communicator
}

func (h *provisionHook) Run(ctx context.Context, name string, ui packersdk.Ui, comm packersdk.Communicator, _ any) error {
	if name != packersdk.HookProvision {
		return nil
	}
	h.comm = comm
	if comm == nil {
		return nil
	}
	if err := comm.Upload("/usr/local/bin/agent", strings.NewReader("agent"), nil); err != nil {
		return err
	}
	if _, status := runIn(h.t, comm, "cat /init > /init.seen"); status != 0 {
		h.t.Error("the provisioner's command failed")
	}
	return nil
}

// TestProvisionRoot runs a build's root through provisioning: initrd_files are in the copy before the
// provisioners, what they write is in the archive, the given root_directory is left as it was and the copy
// is removed.
func TestProvisionRoot(t *testing.T) {
	src := shellTree(t)
	if err := os.MkdirAll(filepath.Join(src, "usr/local/bin"), 0o755); err != nil {
		t.Fatal(err)
	}
	init := filepath.Join(t.TempDir(), "init")
	if err := os.WriteFile(init, []byte("#!/bin/sh\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	b := &Builder{config: Config{RootDirectory: src, InitrdFiles: []InitrdFile{{Source: init, Destination: "/init"}},
		modes: []fs.FileMode{0o755}}}
	hook := &provisionHook{t: t}
	work := filepath.Join(t.TempDir(), "root")
	start := time.Now()
	entries, err := b.provisionRoot(context.Background(), packersdk.TestUi(t), hook, work)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("provisioned in %v", time.Since(start))
	if _, ok := hook.comm.(*chrootCommunicator); !ok {
		t.Fatalf("provisioners got %T, want the chroot communicator", hook.comm)
	}
	byPath := map[string]ukiimage.Entry{}
	for _, e := range entries {
		byPath[e.Path] = e
	}
	for path, want := range map[string]string{"init": "#!/bin/sh\n", "init.seen": "#!/bin/sh\n", "usr/local/bin/agent": "agent", "bin/sh": "busybox"} {
		if e, ok := byPath[path]; !ok || string(e.Data) != want {
			t.Errorf("archive entry %s = %q (present %v), want %q", path, e.Data, ok, want)
		}
	}
	if byPath["init"].Mode != 0o755 {
		t.Errorf("/init has mode %v, want 0755", byPath["init"].Mode)
	}
	if _, err := os.Stat(filepath.Join(src, "init")); err == nil {
		t.Error("the build wrote into root_directory")
	}
	if _, err := os.Stat(work); err == nil {
		t.Error("the provisioned copy was left behind")
	}
}
