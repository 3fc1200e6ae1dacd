// Package chroottest provides what tests of provisioners and builders need to run commands in a chroot:
// a tree with a static busybox as /bin/sh, and a command's output and status.
package chroottest

import (
	"bytes"
	"context"
	"debug/elf"
	"os"
	"path/filepath"
	"testing"

	packersdk "github.com/hashicorp/packer-plugin-sdk/packer"

	"github.com/berthlabs/berth/internal/repotest"
)

// ShellTree is a root file system with a static busybox as /bin/sh, so that commands run in its chroot.
func ShellTree(t *testing.T) string {
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

// Run runs command through comm and returns its output and exit status.
func Run(t *testing.T, comm packersdk.Communicator, command string) (string, int) {
	t.Helper()
	var out bytes.Buffer
	rc := &packersdk.RemoteCmd{Command: command, Stdout: &out, Stderr: &out}
	if err := comm.Start(context.Background(), rc); err != nil {
		t.Fatalf("%s: %v", command, err)
	}
	status := rc.Wait()
	return out.String(), status
}
