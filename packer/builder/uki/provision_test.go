package uki

import (
	"context"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	packersdk "github.com/hashicorp/packer-plugin-sdk/packer"

	ukiimage "github.com/berthlabs/berth/internal/uki"
	"github.com/berthlabs/berth/packer/internal/chroot"
	"github.com/berthlabs/berth/packer/internal/chroot/chroottest"
)

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
	if _, status := chroottest.Run(h.t, comm, "cat /init > /init.seen"); status != 0 {
		h.t.Error("the provisioner's command failed")
	}
	return nil
}

// TestProvisionRoot runs a build's root through provisioning: initrd_files are in the copy before the
// provisioners, what they write is in the archive, the given root_directory is left as it was and the copy
// is removed.
func TestProvisionRoot(t *testing.T) {
	src := chroottest.ShellTree(t)
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
	r, err := b.root(context.Background(), packersdk.TestUi(t), hook, work, filepath.Join(t.TempDir(), "root.img"))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("provisioned in %v", time.Since(start))
	if _, ok := hook.comm.(*chroot.Communicator); !ok {
		t.Fatalf("provisioners got %T, want the chroot communicator", hook.comm)
	}
	byPath := map[string]ukiimage.Entry{}
	for _, e := range r.entries {
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
