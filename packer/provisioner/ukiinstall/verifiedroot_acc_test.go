package ukiinstall

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/test/lab"
	"github.com/berthlabs/berth/test/labvm"
	"github.com/berthlabs/berth/test/packertest"
)

// corruptedMessage is what the kernel says when dm-verity refuses a block of a device opened with
// --panic-on-corruption.
const corruptedMessage = "dm-verity device corrupted"

// checkTamperedImages boots, side by side, three copies of the image that differ from it only in their root
// partition, each with the image's own UKI, and checks that each stops before any join service issued it a
// ticket, with dm-verity's panic on its console:
//   - one byte changed in the agent's binary, which the machine reads early (when the agent starts);
//   - one byte changed in kubeadm, which nothing reads before a join: the agent's read of the whole root
//     before it attests is what finds it;
//   - a root built differently (the image's files and one more, a consistent erofs and hash tree of their
//     own) behind the same UKI: its root hash is not the one the UKI's command line carries.
func checkTamperedImages(ctx context.Context, t *testing.T, l *lab.Lab, image, imageName, dir string) {
	t.Helper()
	start := time.Now()
	cases := []struct {
		name   string
		tamper func(t *testing.T, disk string)
	}{
		{"agent-byte", func(t *testing.T, disk string) { flipFileByte(t, disk, "usr/local/bin/berth-agent") }},
		{"kubeadm-byte", func(t *testing.T, disk string) { flipFileByte(t, disk, "usr/bin/kubeadm") }},
		{"other-root", otherRoot},
	}
	vms := make([]*labvm.VM, len(cases))
	for i, c := range cases {
		disk := filepath.Join(dir, c.name+".raw")
		if out, err := exec.Command("cp", "--sparse=always", image, disk).CombinedOutput(); err != nil {
			t.Fatalf("copying the image: %v\n%s", err, out)
		}
		c.tamper(t, disk)
		vm, err := labvm.Start(l, labvm.Machine{Name: fmt.Sprintf("bad-%d", i), Role: metadata.RoleWorker,
			Addr: netip.AddrFrom4([4]byte{10, 250, 0, byte(41 + i)}), Image: imageName, Disk: disk,
			Dir: filepath.Join(dir, c.name), Memory: 1024, CPUs: 1})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(vm.Close)
		vms[i] = vm
	}
	var wg sync.WaitGroup
	for i, c := range cases {
		wg.Go(func() {
			vm := vms[i]
			waitCtx, cancel := context.WithTimeout(ctx, 8*time.Minute)
			defer cancel()
			if err := vm.WaitOff(waitCtx); err != nil {
				t.Errorf("%s: the machine did not stop: %v\n%s", c.name, err, vm.Diagnose(ctx))
				return
			}
			console, err := os.ReadFile(vm.ConsolePath())
			if err != nil {
				t.Error(err)
				return
			}
			if !strings.Contains(string(console), corruptedMessage) {
				t.Errorf("%s: the machine stopped without %q on its console:\n%s", c.name, corruptedMessage, vm.Diagnose(ctx))
			}
			if n, err := vm.Tickets(); err != nil || n != 0 {
				t.Errorf("%s: the join services issued %d tickets to it (%v), want none", c.name, n, err)
			}
		})
	}
	wg.Wait()
	t.Logf("three images with a tampered root stopped before any ticket, in %.0fs side by side", time.Since(start).Seconds())
}

// flipFileByte changes one byte of the first block the file at path (relative to the image's root) occupies
// on the image's root partition, found by FIEMAP (filefrag) on the erofs mounted from a copy.
func flipFileByte(t *testing.T, disk, path string) {
	t.Helper()
	part := packertest.RootPartition(t, disk)
	root := packertest.Mount(t, part.Loop(t, true))
	out, err := exec.Command("filefrag", "-v", "-b4096", filepath.Join(root, path)).CombinedOutput()
	if err != nil {
		t.Fatalf("filefrag %s: %v\n%s", path, err, out)
	}
	// "   0:        0..       3:      55711..     55714:      3:"
	var block int64 = -1
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) >= 4 && f[0] == "0:" {
			block, err = strconv.ParseInt(strings.TrimSuffix(f[3], ".."), 10, 64)
			if err != nil {
				t.Fatalf("filefrag's first extent of %s: %q", path, line)
			}
		}
	}
	if block < 0 {
		t.Fatalf("filefrag found no extent of %s:\n%s", path, out)
	}
	f, err := os.OpenFile(disk, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	at := part.Offset + block*4096 + 100
	b := make([]byte, 1)
	if _, err := f.ReadAt(b, at); err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte{b[0] ^ 0xff}, at); err != nil {
		t.Fatal(err)
	}
	t.Logf("flipped the byte at %d of the disk, in block %d of /%s", at, block, path)
}

// otherRoot replaces the image's root partition with a root of the attacker's: the image's files and
// /etc/berth/rogue, as erofs followed by a dm-verity hash tree of their own, consistent with each other but
// under another root hash. The ESP, and so the UKI, stays the image's.
func otherRoot(t *testing.T, disk string) {
	t.Helper()
	part := packertest.RootPartition(t, disk)
	dev := part.Loop(t, false)
	tree := t.TempDir()
	lower := packertest.Mount(t, part.Loop(t, true))
	upper, work, merged := filepath.Join(tree, "upper"), filepath.Join(tree, "work"), filepath.Join(tree, "merged")
	for _, d := range []string{filepath.Join(upper, "etc", "berth"), work, merged} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(upper, "etc", "berth", "rogue"), []byte("not the image's\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mount", "-t", "overlay", "-o", "lowerdir="+lower+",upperdir="+upper+",workdir="+work, "rogue", merged).CombinedOutput(); err != nil {
		t.Fatalf("overlay over the image's root: %v\n%s", err, out)
	}
	img := filepath.Join(tree, "rogue.erofs")
	out, err := exec.Command("mkfs.erofs", "--quiet", "-zlz4", img, merged).CombinedOutput()
	exec.Command("umount", merged).Run()
	if err != nil {
		t.Fatalf("mkfs.erofs: %v\n%s (install-deps installs erofs-utils)", err, out)
	}
	fi, err := os.Stat(img)
	if err != nil {
		t.Fatal(err)
	}
	blocks := fi.Size() / 4096
	if out, err := exec.Command("dd", "if="+img, "of="+dev, "bs=1M", "conv=fsync", "status=none").CombinedOutput(); err != nil {
		t.Fatalf("writing the rogue root: %v\n%s", err, out)
	}
	if out, err := exec.Command("veritysetup", "format", dev, dev, "--no-superblock", "--data-blocks="+strconv.FormatInt(blocks, 10),
		"--hash-offset="+strconv.FormatInt(blocks*4096, 10)).CombinedOutput(); err != nil {
		t.Fatalf("veritysetup format of the rogue root: %v\n%s", err, out)
	}
}
