package statedisk

import (
	"context"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

func TestParseMountInfo(t *testing.T) {
	const info = `22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
61 22 253:0 / /var/lib/berth rw,relatime shared:30 - ext4 /dev/mapper/berth-state rw
62 22 253:0 /dirs/etc/kubernetes /etc/kubernetes rw,relatime shared:30 - ext4 /dev/mapper/berth-state rw
70 22 0:40 / /mnt/with\040space\134and\011tab rw - tmpfs tmpfs rw
71 22 0:41 / /etc/kubernetes rw - tmpfs tmpfs rw
`
	m, err := parseMountInfo(strings.NewReader(info))
	if err != nil {
		t.Fatal(err)
	}
	if e, ok := m.at("/var/lib/berth/"); !ok || e.device != "253:0" || e.root != "/" {
		t.Errorf("at(/var/lib/berth/) = %+v, %v", e, ok)
	}
	if e, ok := m.at("/mnt/with space\\and\ttab"); !ok || e.device != "0:40" {
		t.Errorf("escaped mount point: %+v, %v", e, ok)
	}
	// The later mount hides the bind.
	if e, ok := m.at("/etc/kubernetes"); !ok || e.device != "0:41" {
		t.Errorf("at(/etc/kubernetes) = %+v, %v; want the tmpfs mounted last", e, ok)
	}
	if _, ok := m.at("/var/lib/kubelet"); ok {
		t.Error("a directory that is no mount point was found")
	}
	if _, err := parseMountInfo(strings.NewReader("1 2 3\n")); err == nil {
		t.Error("a short line was accepted")
	}
}

// mountTmpfs mounts a tmpfs at dir, standing in for the opened state volume (a file system of its own), and
// unmounts it and everything below it at the end of the test.
func mountTmpfs(t *testing.T, dir string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("mounting needs root (make test runs as root)")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", dir).CombinedOutput(); err != nil {
		t.Fatalf("mount tmpfs: %v: %s", err, out)
	}
	t.Cleanup(func() {
		if out, err := exec.Command("umount", "--recursive", "--lazy", dir).CombinedOutput(); err != nil {
			t.Errorf("umount %s: %v: %s", dir, err, out)
		}
	})
}

func umount(t *testing.T, dir string) {
	t.Helper()
	if out, err := exec.Command("umount", dir).CombinedOutput(); err != nil {
		t.Fatalf("umount %s: %v: %s", dir, err, out)
	}
}

func TestBindDirs(t *testing.T) {
	ctx := context.Background()
	log := slog.New(slog.DiscardHandler)
	base := t.TempDir()
	state := filepath.Join(base, "state")
	mountTmpfs(t, state)
	// The image put a file in one directory; the other does not exist yet.
	kube, kubelet := filepath.Join(base, "etc", "kubernetes"), filepath.Join(base, "var", "lib", "kubelet")
	if err := os.MkdirAll(filepath.Join(kube, "manifests"), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(kube, "manifests", "baked.yaml"), []byte("baked"), 0o600); err != nil {
		t.Fatal(err)
	}
	dirs := []string{kube, kubelet}
	if err := BindDirs(ctx, log, state, dirs); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, d := range dirs {
			exec.Command("umount", "--lazy", d).Run()
		}
	})
	// What is written through the binds lands on the volume, and the image's file came along.
	for _, d := range dirs {
		if err := os.WriteFile(filepath.Join(d, "kubelet.conf"), []byte(d), 0o600); err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(filepath.Join(state, DirsSubdir, d, "kubelet.conf"))
		if err != nil || string(got) != d {
			t.Errorf("%s's file on the volume: %q, %v", d, got, err)
		}
	}
	if got, err := os.ReadFile(filepath.Join(state, DirsSubdir, kube, "manifests", "baked.yaml")); err != nil || string(got) != "baked" {
		t.Errorf("the image's file on the volume: %q, %v", got, err)
	}
	if info, err := os.Stat(filepath.Join(state, DirsSubdir, kubelet)); err != nil || info.Mode().Perm() != 0o700 {
		t.Errorf("a new directory on the volume: %v, %v; want mode 0700", info, err)
	}

	// An agent restarted in the same boot finds its binds in place and adds none.
	if err := BindDirs(ctx, log, state, dirs); err != nil {
		t.Fatalf("second BindDirs in one boot: %v", err)
	}
	mounts, err := readMountInfo("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range dirs {
		n := 0
		for _, m := range mounts {
			if m.point == d {
				n++
			}
		}
		if n != 1 {
			t.Errorf("%s is mounted %d times, want once", d, n)
		}
	}

	// The next boot: the binds are gone and the root's directory is as the image made it; binding again
	// finds the volume's copy, which wins over the image's.
	for _, d := range dirs {
		umount(t, d)
	}
	if err := os.WriteFile(filepath.Join(kube, "manifests", "baked.yaml"), []byte("a newer image"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := BindDirs(ctx, log, state, dirs); err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(filepath.Join(kube, "kubelet.conf")); err != nil || string(got) != kube {
		t.Errorf("after a reboot, kubelet.conf = %q, %v; want what the last boot wrote", got, err)
	}
	if got, err := os.ReadFile(filepath.Join(kube, "manifests", "baked.yaml")); err != nil || string(got) != "baked" {
		t.Errorf("after a reboot, the image's file = %q, %v; want the volume's copy", got, err)
	}
}

func TestBindDirsRefuses(t *testing.T) {
	ctx := context.Background()
	log := slog.New(slog.DiscardHandler)
	base := t.TempDir()
	state := filepath.Join(base, "state")
	if err := os.MkdirAll(state, 0o755); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(base, "etc", "kubernetes")
	err := BindDirs(ctx, log, state, []string{dir})
	if err == nil || !strings.Contains(err.Error(), "not a mount point") {
		t.Errorf("state volume not mounted: %v", err)
	}

	mountTmpfs(t, state)
	mountTmpfs(t, dir)
	err = BindDirs(ctx, log, state, []string{dir})
	if err == nil || !strings.Contains(err.Error(), "already a mount point") {
		t.Errorf("a directory something else is mounted on: %v", err)
	}
	if _, serr := os.Stat(filepath.Join(state, DirsSubdir)); serr == nil {
		t.Error("a refused bind left a directory on the volume")
	}
}
