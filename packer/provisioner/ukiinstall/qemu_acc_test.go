package ukiinstall

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/packer-plugin-sdk/acctest"

	imagemanifest "github.com/berthlabs/berth/internal/manifest"
	"github.com/berthlabs/berth/internal/repotest"
	"github.com/berthlabs/berth/internal/uki/ukitest"
	"github.com/berthlabs/berth/test/measuredboot"
	"github.com/berthlabs/berth/test/packertest"
)

// TestAccQEMUImage builds examples/packer/qemu.pkr.hcl with the real packer and the real qemu builder
// (packer-plugin-qemu built from its module): a Debian 12 machine (scripts/debian-vm.sh) boots under TCG,
// berth-agent installs the agent, kubeadm and the kubelet (built from the Kubernetes module), berth-node
// makes it a node, berth-uki-install installs a UKI of its own kernel, initrd and command line over SSH, and
// berth-manifest predicts its PCRs. The disk's root then holds what a node needs, and the disk boots under
// QEMU with OVMF, no other boot option and a swtpm, and the PCR 4, 9, 11 and 12 the guest reads from its TPM
// are the manifest's.
func TestAccQEMUImage(t *testing.T) {
	if os.Getenv(acctest.TestEnvVar) == "" {
		t.Skipf("acceptance test with the real packer: make testacc-packer runs it (%s=1)", acctest.TestEnvVar)
	}
	if os.Geteuid() != 0 {
		t.Fatal("scripts/debian-vm.sh needs root (run make testacc-packer as root)")
	}
	// The qemu builder runs qemu-img on the disk it copies.
	if _, err := exec.LookPath("qemu-img"); err != nil {
		t.Fatal("qemu-img not found: the qemu builder needs Debian's qemu-utils")
	}
	packertest.Setup(t)
	addPlugin(t, "qemu", "BERTH_PACKER_QEMU_PLUGINS")
	vm := repotest.Script(t, "debian-vm.sh", "it needs root, mmdebstrap and the Debian archive")
	parts := ukitest.BootParts(t)
	agent := repotest.BuildBinary(t, "./nodeagent/cmd/berth-agent", "")
	kube := repotest.BinDir(t, "BERTH_KUBE_BIN", "build-k8s.sh", "building Kubernetes from its modules")
	var files []string
	for _, name := range []string{"kubeadm", "kubelet"} {
		files = append(files, fmt.Sprintf("{source=%q, destination=%q, sha256=%q}",
			filepath.Join(kube, name), "/usr/bin/"+name, fileSHA256(t, filepath.Join(kube, name))))
	}

	dir := t.TempDir()
	output, uki, manifestPath := filepath.Join(dir, "output"), filepath.Join(dir, "berth.efi"), filepath.Join(dir, "berth-image.json")
	if out, err := runPacker(t, "init", "qemu.pkr.hcl"); err != nil {
		t.Fatalf("packer init qemu.pkr.hcl: %v\n%s", err, out)
	}
	start := time.Now()
	out, err := runPacker(t, "build", "-var", "vm="+vm, "-var", "stub="+parts.Stub, "-var", "output_directory="+output,
		"-var", "uki="+uki, "-var", "manifest="+manifestPath, "-var", "agent_binary="+agent,
		"-var", "kubernetes_files=["+strings.Join(files, ", ")+"]",
		// The machine reaches no registry here.
		"-var", "images=[]", "qemu.pkr.hcl")
	if err != nil {
		t.Fatalf("packer build qemu.pkr.hcl: %v\n%s", err, out)
	}
	t.Logf("packer build with the qemu builder: %.0fs", time.Since(start).Seconds())

	data, err := os.ReadFile(manifestPath)
	if err != nil {
		t.Fatal(err)
	}
	m, err := imagemanifest.Parse(data)
	if err != nil {
		t.Fatal(err)
	}
	img, ok := m.Image("berth-node-qemu")
	if !ok || img.Builder != "qemu" || img.ArtifactID != filepath.Join(output, "berth.raw") {
		t.Fatalf("manifest images %+v, want berth-node-qemu from the qemu builder", m.Images)
	}

	checkNodeRoot(t, filepath.Join(output, "berth.raw"))

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	start = time.Now()
	console, err := measuredboot.Machine{Disk: filepath.Join(output, "berth.raw"), Dir: filepath.Join(dir, "boot")}.Boot(ctx)
	if err != nil {
		t.Fatalf("booting the built disk: %v\n%s", err, console)
	}
	t.Logf("measured boot of the built disk: %.0fs", time.Since(start).Seconds())
	got, err := measuredboot.PCRs(console)
	if err != nil {
		t.Fatalf("%v\n%s", err, console)
	}
	if len(got) != len(img.PCRs) {
		t.Fatalf("the guest printed PCRs %v, the manifest has %v", got, img.PCRs)
	}
	for i, v := range got {
		if want := img.PCRs[fmt.Sprint(i)]; hex.EncodeToString(v) != want {
			t.Errorf("PCR %d: the TPM holds %x, the manifest predicts %s", i, v, want)
		}
	}
}

func fileSHA256(t *testing.T, name string) string {
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

// checkNodeRoot mounts the root file system of the disk Packer wrote (its second partition) read-only and
// finds what berth-node made of the machine: containerd configured for the kubelet, the units enabled, swap
// off, and nothing of the build machine's identity left.
func checkNodeRoot(t *testing.T, disk string) {
	t.Helper()
	out, err := exec.Command("sfdisk", "--json", disk).Output()
	if err != nil {
		t.Fatalf("sfdisk --json %s: %v", disk, err)
	}
	var table struct {
		PartitionTable struct {
			SectorSize int64 `json:"sectorsize"`
			Partitions []struct {
				Start int64 `json:"start"`
			} `json:"partitions"`
		} `json:"partitiontable"`
	}
	if err := json.Unmarshal(out, &table); err != nil || len(table.PartitionTable.Partitions) != 2 {
		t.Fatalf("the disk's partition table: %v\n%s", err, out)
	}
	root := t.TempDir()
	offset := table.PartitionTable.Partitions[1].Start * cmp.Or(table.PartitionTable.SectorSize, 512)
	if out, err := exec.Command("mount", "-o", fmt.Sprintf("ro,loop,offset=%d", offset), disk, root).CombinedOutput(); err != nil {
		t.Fatalf("mounting the disk's root: %v\n%s", err, out)
	}
	defer func() {
		if out, err := exec.Command("umount", root).CombinedOutput(); err != nil {
			t.Errorf("umount %s: %v\n%s", root, err, out)
		}
	}()
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
	for _, name := range []string{"usr/bin/kubelet", "usr/bin/kubeadm", "usr/local/bin/berth-agent", "opt/cni/bin/bridge", "usr/bin/containerd"} {
		if fi, err := os.Stat(filepath.Join(root, name)); err != nil || fi.Mode().Perm()&0o111 == 0 {
			t.Errorf("%s is not an executable in the image: %v", name, err)
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
