package packertest

import (
	"cmp"
	"crypto/sha256"
	"debug/pe"
	"encoding/hex"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// Partition is a partition of a disk image, in bytes from the start of the disk.
type Partition struct {
	Disk         string
	Offset, Size int64
	UUID         string
	Name         string
}

// Partitions reads the partitions of a disk image from its GPT.
func Partitions(t *testing.T, disk string) []Partition {
	t.Helper()
	out, err := exec.Command("sfdisk", "--json", disk).Output()
	if err != nil {
		t.Fatalf("sfdisk --json %s: %v", disk, err)
	}
	var table struct {
		PartitionTable struct {
			SectorSize int64 `json:"sectorsize"`
			Partitions []struct {
				Start int64  `json:"start"`
				Size  int64  `json:"size"`
				UUID  string `json:"uuid"`
				Name  string `json:"name"`
			} `json:"partitions"`
		} `json:"partitiontable"`
	}
	if err := json.Unmarshal(out, &table); err != nil {
		t.Fatalf("sfdisk --json %s: %v\n%s", disk, err, out)
	}
	sector := cmp.Or(table.PartitionTable.SectorSize, 512)
	var parts []Partition
	for _, p := range table.PartitionTable.Partitions {
		parts = append(parts, Partition{Disk: disk, Offset: p.Start * sector, Size: p.Size * sector, UUID: p.UUID, Name: p.Name})
	}
	return parts
}

// RootPartition finds a node image's root partition: the second of two, named berth-root.
func RootPartition(t *testing.T, disk string) Partition {
	t.Helper()
	parts := Partitions(t, disk)
	if len(parts) != 2 || parts[1].Name != "berth-root" {
		t.Fatalf("the image's partitions are %+v, want an ESP and berth-root", parts)
	}
	return parts[1]
}

// Loop attaches the partition as a loop device until the end of the test.
func (p Partition) Loop(t *testing.T, readOnly bool) string {
	t.Helper()
	args := []string{"--show", "--find", "--offset", strconv.FormatInt(p.Offset, 10), "--sizelimit", strconv.FormatInt(p.Size, 10), p.Disk}
	if readOnly {
		args = append([]string{"--read-only"}, args...)
	}
	out, err := exec.Command("losetup", args...).Output()
	if err != nil {
		t.Fatalf("losetup of %s's partition at %d: %v", p.Disk, p.Offset, err)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command("losetup", "--detach", dev).Run() })
	return dev
}

// Mount mounts what is on dev (such as the image's erofs) read-only until the end of the test.
func Mount(t *testing.T, dev string) string {
	t.Helper()
	dir := t.TempDir()
	if out, err := exec.Command("mount", "-o", "ro", dev, dir).CombinedOutput(); err != nil {
		t.Fatalf("mounting %s: %v\n%s", dev, err, out)
	}
	t.Cleanup(func() {
		if out, err := exec.Command("umount", dir).CombinedOutput(); err != nil {
			t.Errorf("umount %s: %v\n%s", dir, err, out)
		}
	})
	return dir
}

// VerityRecord is berth.verity= of the UKI's command line: partition UUID, data blocks, hash offset, root
// hash and salt.
func VerityRecord(t *testing.T, uki string) []string {
	t.Helper()
	f, err := pe.Open(uki)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	s := f.Section(".cmdline")
	if s == nil {
		t.Fatalf("%s has no .cmdline section", uki)
	}
	data, err := s.Data()
	if err != nil {
		t.Fatal(err)
	}
	// A section's data is padded to the file alignment.
	line := strings.TrimRight(string(data), "\x00")
	for _, item := range strings.Fields(line) {
		if v, ok := strings.CutPrefix(item, "berth.verity="); ok {
			if r := strings.Split(v, ":"); len(r) == 5 {
				return r
			}
		}
	}
	t.Fatalf("the UKI's command line %q has no berth.verity=<uuid>:<blocks>:<offset>:<hash>:<salt>", line)
	return nil
}

// CheckNodeRoot checks the image Packer wrote: an ESP and the root partition, whose erofs file system
// followed by its hash tree verifies against the record on the UKI's command line (veritysetup verify, which
// reads every block); and, mounting the erofs read-only, what berth-node made of the machine: containerd
// configured for the kubelet (CNI plugins in cniBinDir), the units enabled, swap off, and nothing of the build
// machine's identity left.
func CheckNodeRoot(t *testing.T, disk, uki, cniBinDir string) {
	t.Helper()
	part := RootPartition(t, disk)
	record := VerityRecord(t, uki)
	if !strings.EqualFold(record[0], part.UUID) {
		t.Fatalf("the UKI's command line names partition %s, the image's root is %s", record[0], part.UUID)
	}
	dev := part.Loop(t, true)
	if out, err := exec.Command("veritysetup", "verify", dev, dev, record[3], "--no-superblock", "--data-blocks="+record[1],
		"--hash-offset="+record[2], "--salt="+record[4]).CombinedOutput(); err != nil {
		t.Fatalf("the image's root does not verify against the UKI's root hash: %v\n%s", err, out)
	}
	root := Mount(t, dev)
	read := func(name string) string {
		data, err := os.ReadFile(filepath.Join(root, name))
		if err != nil {
			t.Errorf("%s: %v", name, err)
		}
		return string(data)
	}
	for name, want := range map[string]string{
		"etc/containerd/config.toml":                           "SystemdCgroup = true",
		"etc/systemd/system/kubelet.service.d/10-kubeadm.conf": "/var/lib/kubelet/kubeadm-flags.env",
		"etc/modules-load.d/berth-node.conf":                   "br_netfilter",
		"etc/sysctl.d/90-berth-node.conf":                      "net.ipv4.ip_forward = 1",
		// The initrd the UKI embeds was built from these pieces: it opens the verified root.
		"etc/initramfs-tools/scripts/local-top/berth-verity": "veritysetup open",
	} {
		if got := read(name); !strings.Contains(got, want) {
			t.Errorf("%s lacks %q:\n%s", name, want, got)
		}
	}
	for _, link := range []string{"multi-user.target.wants/kubelet.service", "multi-user.target.wants/berth-images.service",
		"multi-user.target.wants/berth-agent.service", "multi-user.target.wants/containerd.service"} {
		if _, err := os.Lstat(filepath.Join(root, "etc/systemd/system", link)); err != nil {
			t.Errorf("%s is not enabled: %v", filepath.Base(link), err)
		}
	}
	if target, err := os.Readlink(filepath.Join(root, "etc/systemd/system/swap.target")); err != nil || target != "/dev/null" {
		t.Errorf("swap.target is not masked: %q, %v", target, err)
	}
	for _, name := range []string{"usr/bin/kubelet", "usr/bin/kubeadm", "usr/local/bin/berth-agent", strings.TrimPrefix(cniBinDir, "/") + "/bridge", "usr/bin/containerd"} {
		if fi, err := os.Stat(filepath.Join(root, name)); err != nil || fi.Mode().Perm()&0o111 == 0 {
			t.Errorf("%s is not an executable in the image: %v", name, err)
		}
	}
	for _, line := range strings.Split(read("etc/fstab"), "\n") {
		if f := strings.Fields(line); len(f) > 1 && !strings.HasPrefix(f[0], "#") && (f[1] == "/" || f[1] == "/boot/efi") {
			t.Errorf("the image's fstab still mounts the build machine's %s: %q", f[1], line)
		}
	}
	if id := read("etc/machine-id"); id != "" {
		t.Errorf("/etc/machine-id holds %q: every instance would share it", id)
	}
	if keys, _ := filepath.Glob(filepath.Join(root, "etc/ssh/ssh_host_*")); len(keys) != 0 {
		t.Errorf("the build machine's SSH host keys are in the image: %v", keys)
	}
	// Debian's unit checks sshd's configuration, keys included, before it starts: the keys must come first.
	const keygen = "ExecStartPre=\nExecStartPre=/usr/bin/ssh-keygen -A\nExecStartPre=/usr/sbin/sshd -t\n"
	if got := read("etc/systemd/system/ssh.service.d/berth-node-host-keys.conf"); !strings.Contains(got, keygen) {
		t.Errorf("ssh.service's drop-in makes no host keys before sshd -t:\n%s", got)
	}
}

// FileSHA256 is the hex SHA-256 of a file, as templates pin the files they install.
func FileSHA256(t *testing.T, name string) string {
	t.Helper()
	f, err := os.Open(name)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(h.Sum(nil))
}
