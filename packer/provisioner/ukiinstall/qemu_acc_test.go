package ukiinstall

import (
	"cmp"
	"context"
	"crypto/sha256"
	"debug/pe"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/packer-plugin-sdk/acctest"

	imagemanifest "github.com/berthlabs/berth/internal/manifest"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/internal/repotest"
	"github.com/berthlabs/berth/internal/uki/ukitest"
	"github.com/berthlabs/berth/test/lab"
	"github.com/berthlabs/berth/test/labvm"
	"github.com/berthlabs/berth/test/packertest"
)

// vmAgentConfig is the agent's configuration in the image TestAccQEMUImage bakes for the lab: the lab's
// metadata service in place of a cloud's, and the state disk QEMU attaches second. The lab's cluster
// configuration gives every kubelet the cgroupfs driver that its namespace nodes need (cgroup v1 without
// systemd); this machine runs systemd, and containerd as berth-node configures it, so its kubelet takes
// systemd's driver by flag.
const vmAgentConfig = `metadataURL: %s
stateDisk: /dev/vdb
stateMount: /var/lib/berth
retryMax: 5s
kubelet:
  extraArgs:
    cgroup-driver: systemd
`

// TestAccQEMUImage builds examples/packer/qemu.pkr.hcl with the real packer and the real qemu builder
// (packer-plugin-qemu built from its module) and boots the result as a node of a real lab cluster, the whole
// path a user walks on a cloud:
//   - a Debian 12 machine (scripts/debian-vm.sh) boots under TCG, berth-agent installs the agent, kubeadm and
//     the kubelet (built from the Kubernetes module), berth-node makes it a node with the lab's container
//     images (kube-proxy, Flannel, the probe), berth-uki-install writes its root as a verified one (erofs
//     under dm-verity) onto the image's disk and installs there a UKI of its own kernel, initrd and command
//     line with the root hash, and berth-manifest predicts its PCRs; the image's root then verifies against
//     that root hash, holds what a node needs and nothing of the build machine's identity;
//   - meanwhile a lab brings up a control-plane node and a worker;
//   - the join policy gains the image with the manifest's PCR 4, 9, 11 and 12, and the disk boots under QEMU
//     with OVMF, no other boot option and a swtpm whose EK certificate the lab's EK CA issued, on the lab's
//     bridge: its agent attests to the lab's join service (which checks the predicted PCRs), runs the real
//     kubeadm join, and the Node is Ready;
//   - a pod on it serves a Service that a pod on the lab's worker reaches across the pod network;
//   - kubeadm's, the kubelet's and etcd's directories are bound from the encrypted state volume;
//   - after `systemctl reboot` it unlocks its state disk and is Ready again, and the Service answers again;
//   - copies of the image with one byte of the root changed, or another root behind the same UKI, stop
//     before they get a ticket (checkTamperedImages).
func TestAccQEMUImage(t *testing.T) {
	if os.Getenv(acctest.TestEnvVar) == "" {
		t.Skipf("acceptance test with the real packer: make testacc-packer runs it (%s=1)", acctest.TestEnvVar)
	}
	if os.Geteuid() != 0 {
		t.Fatal("scripts/debian-vm.sh and the lab need root (run make testacc-packer as root)")
	}
	// The qemu builder runs qemu-img on the disk it copies.
	if _, err := exec.LookPath("qemu-img"); err != nil {
		t.Fatal("qemu-img not found: the qemu builder needs Debian's qemu-utils")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 35*time.Minute)
	defer cancel()
	packertest.Setup(t)
	addPlugin(t, "qemu", "BERTH_PACKER_QEMU_PLUGINS")
	vm := repotest.Script(t, "debian-vm.sh", "it needs root, mmdebstrap and the Debian archive")
	parts := ukitest.BootParts(t)
	agent := repotest.BuildBinary(t, "./nodeagent/cmd/berth-agent", "")
	kube := repotest.BinDir(t, "BERTH_KUBE_BIN", "build-k8s.sh", "building Kubernetes from its modules")
	l := startLab(ctx, t, kube, agent)

	var files []string
	for _, name := range []string{"kubeadm", "kubelet"} {
		files = append(files, fmt.Sprintf("{source=%q, destination=%q, sha256=%q}",
			filepath.Join(kube, name), "/usr/bin/"+name, fileSHA256(t, filepath.Join(kube, name))))
	}
	var archives []string
	// CoreDNS runs on the lab's own nodes before this one joins, and the workload image is other tests'.
	for _, path := range l.NodeImageArchives(lab.CoreDNSImage, lab.WorkloadImage) {
		archives = append(archives, fmt.Sprintf("{source=%q, sha256=%q}", path, fileSHA256(t, path)))
	}
	dir := t.TempDir()
	agentConfig := filepath.Join(dir, "agent.yaml")
	if err := os.WriteFile(agentConfig, []byte(fmt.Sprintf(vmAgentConfig, lab.MetadataURL)), 0o600); err != nil {
		t.Fatal(err)
	}
	// The image disk by a link that only a udev rule installed in this same build makes, as aws.pkr.hcl
	// names its image volume by 90-berth-ebs.rules: berth-uki-install must have udev apply the new rule.
	// (On the booted node vdb is the state disk, which the rule then also links: nothing reads that link.)
	imageRule := filepath.Join(dir, "90-berth-image.rules")
	if err := os.WriteFile(imageRule, []byte("KERNEL==\"vdb\", SYMLINK+=\"disk/by-berth/image\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	extraFiles := fmt.Sprintf("[{source=%q, destination=%q, sha256=%q}]", imageRule, "/etc/udev/rules.d/90-berth-image.rules", fileSHA256(t, imageRule))

	// The cluster comes up while Packer builds: each leaves most of the other's CPU.
	clusterUp := make(chan error, 1)
	go func() {
		clusterUp <- l.InitCluster(ctx, []lab.NodeSpec{{Name: "cp-0", Role: metadata.RoleControlPlane}, {Name: "worker-0", Role: metadata.RoleWorker}})
	}()
	output, uki, manifestPath := filepath.Join(dir, "output"), filepath.Join(dir, "berth.efi"), filepath.Join(dir, "berth-image.json")
	if out, err := runPacker(t, "init", "qemu.pkr.hcl"); err != nil {
		t.Fatalf("packer init qemu.pkr.hcl: %v\n%s", err, out)
	}
	start := time.Now()
	out, err := runPacker(t, "build", "-var", "vm="+vm, "-var", "stub="+parts.Stub, "-var", "output_directory="+output,
		"-var", "uki="+uki, "-var", "manifest="+manifestPath, "-var", "agent_binary="+agent, "-var", "agent_config="+agentConfig, "-var", "cni_bin_dir="+lab.CNIBinDir,
		"-var", "kubernetes_files=["+strings.Join(files, ", ")+"]", "-var", "extra_files="+extraFiles, "-var", "image_device=/dev/disk/by-berth/image",
		// The machine reaches no registry here: the lab's images come as archives.
		"-var", "images=[]", "-var", "image_archives=["+strings.Join(archives, ", ")+"]", "qemu.pkr.hcl")
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
	image := filepath.Join(output, "berth.raw-1")
	if !ok || img.Builder != "qemu" || img.ArtifactID != image {
		t.Fatalf("manifest images %+v, want berth-node-qemu from the qemu builder", m.Images)
	}
	checkNodeRoot(t, image, uki)

	start = time.Now()
	if err := <-clusterUp; err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > time.Second {
		t.Logf("the lab's cluster was Ready %.0fs after the build", d.Seconds())
	}
	// The join policy admits the lab's own image and, for workers, the baked one by the manifest's PCRs:
	// a join is the check of the prediction.
	pcrs := map[int][]byte{}
	for idx, v := range img.PCRs {
		i, err := strconv.Atoi(idx)
		if err != nil {
			t.Fatalf("manifest PCR %q: %v", idx, err)
		}
		if pcrs[i], err = hex.DecodeString(v); err != nil {
			t.Fatalf("manifest PCR %s: %v", idx, err)
		}
	}
	if err := l.SetPolicy(ctx, &policy.Policy{Images: []policy.Image{lab.LabImage(lab.ImageNames[0]),
		{Name: img.Name, PCRs: pcrs, Roles: []metadata.Role{metadata.RoleWorker}}}}); err != nil {
		t.Fatal(err)
	}

	start = time.Now()
	node, err := labvm.Start(l, labvm.Machine{Name: "vm-0", Role: metadata.RoleWorker, Addr: netip.MustParseAddr("10.250.0.40"),
		Image: img.Name, Disk: image, Dir: filepath.Join(dir, "vm"), Memory: 2048, CPUs: 2,
		SSHKey: filepath.Join(vm, "key")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(node.Close)
	waitCtx, cancelWait := context.WithTimeout(ctx, 10*time.Minute)
	defer cancelWait()
	bootID, err := node.WaitReady(waitCtx, "")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("the baked image booted, attested, joined with kubeadm and was Ready in %.0fs", time.Since(start).Seconds())
	logStages(ctx, t, node)
	checkStateDirs(ctx, t, node)

	start = time.Now()
	if err := l.WaitAddons(ctx); err != nil {
		t.Fatal(err)
	}
	if err := l.ServeProbe(ctx, "on-vm", []string{node.Name}); err != nil {
		t.Fatalf("%v\n%s", err, node.Diagnose(ctx))
	}
	reachVM(ctx, t, l, node, "from-worker-0")
	t.Logf("kube-proxy and Flannel ran on it, and a pod on it answered a pod on worker-0 through its Service in %.0fs", time.Since(start).Seconds())

	start = time.Now()
	reboot := start
	if err := node.Reboot(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := node.WaitReady(waitCtx, bootID); err != nil {
		t.Fatal(err)
	}
	t.Logf("after systemctl reboot, Ready again in %.0fs", time.Since(start).Seconds())
	logStages(ctx, t, node)
	checkStateDirs(ctx, t, node)
	start = time.Now()
	waitProbeBack(ctx, t, l, node, reboot)
	reachVM(ctx, t, l, node, "after-reboot")
	t.Logf("its pod ran again and answered in %.0fs", time.Since(start).Seconds())

	// The machines with a tampered root get the CPU to themselves.
	node.PowerOff()
	checkTamperedImages(ctx, t, l, image, img.Name, dir)
}

// checkStateDirs checks that kubeadm's, the kubelet's and etcd's directories are bound from the encrypted
// state volume, and that the kubelet's credentials from the join are there: after a reboot, that is what the
// node found again, since the root keeps none of it.
func checkStateDirs(ctx context.Context, t *testing.T, node *labvm.VM) {
	t.Helper()
	for _, dir := range []string{"/etc/kubernetes", "/var/lib/kubelet", "/var/lib/etcd"} {
		out, err := node.SSH(ctx, "findmnt --noheadings --output SOURCE --mountpoint "+dir)
		if want := "/dev/mapper/berth-state[/dirs" + dir + "]"; err != nil || strings.TrimSpace(out) != want {
			t.Errorf("%s is mounted from %q (%v), want %s", dir, strings.TrimSpace(out), err, want)
		}
	}
	if out, err := node.SSH(ctx, "test -s /var/lib/berth/dirs/etc/kubernetes/kubelet.conf"); err != nil {
		t.Errorf("kubelet.conf is not on the state volume: %v %s", err, out)
	}
}

// partition is the image's root partition, in bytes from the start of its disk.
type partition struct {
	disk         string
	offset, size int64
	uuid         string
}

// rootPartition finds the image's root partition: the second of two, named berth-root.
func rootPartition(t *testing.T, disk string) partition {
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
	if err := json.Unmarshal(out, &table); err != nil || len(table.PartitionTable.Partitions) != 2 || table.PartitionTable.Partitions[1].Name != "berth-root" {
		t.Fatalf("the image's partition table, want an ESP and berth-root: %v\n%s", err, out)
	}
	p := table.PartitionTable.Partitions[1]
	sector := cmp.Or(table.PartitionTable.SectorSize, 512)
	return partition{disk: disk, offset: p.Start * sector, size: p.Size * sector, uuid: p.UUID}
}

// loop attaches the partition as a loop device until the end of the test.
func (p partition) loop(t *testing.T, readOnly bool) string {
	t.Helper()
	args := []string{"--show", "--find", "--offset", strconv.FormatInt(p.offset, 10), "--sizelimit", strconv.FormatInt(p.size, 10), p.disk}
	if readOnly {
		args = append([]string{"--read-only"}, args...)
	}
	out, err := exec.Command("losetup", args...).Output()
	if err != nil {
		t.Fatalf("losetup of %s's root partition: %v", p.disk, err)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command("losetup", "--detach", dev).Run() })
	return dev
}

// mount mounts what is on dev (the image's erofs) read-only until the end of the test.
func mount(t *testing.T, dev string) string {
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

// verityRecord is berth.verity= of the UKI's command line: partition UUID, data blocks, hash offset, root
// hash and salt.
func verityRecord(t *testing.T, uki string) []string {
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

// logStages logs the stages of the machine's boot, for docs/lab.md's figures.
func logStages(ctx context.Context, t *testing.T, node *labvm.VM) {
	t.Helper()
	stages, err := node.BootStages(ctx)
	if err != nil {
		t.Errorf("the machine's boot stages: %v", err)
		return
	}
	t.Logf("%s's boot, seconds since its kernel started:\n%s", node.Name, stages)
}

// waitProbeBack waits until the probe's pod on the rebooted machine is Ready again since the reboot: its
// kubelet makes the pod's sandbox anew once Flannel runs again on the machine.
func waitProbeBack(ctx context.Context, t *testing.T, l *lab.Lab, node *labvm.VM, since time.Time) {
	t.Helper()
	var last string
	for deadline := time.Now().Add(3 * time.Minute); time.Now().Before(deadline); time.Sleep(2 * time.Second) {
		out, err := l.Kubectl(ctx, "get", "pods", "-l", "app=on-vm", "-o",
			`jsonpath={.items[0].status.conditions[?(@.type=="Ready")].status} {.items[0].status.conditions[?(@.type=="Ready")].lastTransitionTime}`)
		var status, at string
		fmt.Sscan(out, &status, &at)
		if ready, perr := time.Parse(time.RFC3339, at); err == nil && perr == nil && status == "True" && !ready.Before(since.Truncate(time.Second)) {
			return
		}
		last = fmt.Sprintf("%q, %v", out, err)
	}
	desc, _ := l.Kubectl(ctx, "describe", "pods", "-l", "app=on-vm")
	t.Fatalf("the probe's pod on %s was not Ready again after the reboot (last: %s)\n%s\n%s", node.Name, last, desc, node.Diagnose(ctx))
}

// startLab starts a lab's host for TestAccQEMUImage and takes it down at the end, checking that nothing of it
// is left.
func startLab(ctx context.Context, t *testing.T, kube, agent string) *lab.Lab {
	t.Helper()
	labBin := repotest.BuildBinary(t, "./test/lab/cmd/berth-lab", "")
	// Unix sockets of the lab's nodes live in its directory: a path short enough for them.
	dir, err := os.MkdirTemp("", "berth-qemu-lab-")
	if err != nil {
		t.Fatal(err)
	}
	var progress strings.Builder
	l, err := lab.StartHost(ctx, lab.HostConfig{Dir: filepath.Join(dir, "lab"), KubeBin: kube, AgentBinary: agent,
		LabBinary: labBin, Progress: &progress})
	t.Cleanup(func() {
		if err := lab.Down(context.Background(), filepath.Join(dir, "lab")); err != nil {
			t.Errorf("lab down: %v", err)
		}
		if left := lab.Leftovers(filepath.Join(dir, "lab")); len(left) > 0 {
			t.Errorf("the lab left behind: %v", left)
		}
		os.RemoveAll(dir)
		t.Logf("lab progress:\n%s", progress.String())
	})
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// reachVM has a pod on the lab's worker ask the probe Service on the baked machine until its pod answers.
func reachVM(ctx context.Context, t *testing.T, l *lab.Lab, node *labvm.VM, pod string) {
	t.Helper()
	answered, err := l.FetchProbe(ctx, pod, "on-vm", l.Node("worker-0"), 1)
	if err != nil {
		t.Fatalf("%v\n%s", err, node.Diagnose(ctx))
	}
	replicas, err := l.ProbeReplicas(ctx, "on-vm")
	if err != nil {
		t.Fatal(err)
	}
	if len(answered) != 1 || replicas[answered[0]] != node.Name {
		t.Fatalf("%s: answered by %v, want the replica on %s (%v)", pod, answered, node.Name, replicas)
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

// checkNodeRoot checks the image Packer wrote: an ESP and the root partition, whose erofs file system
// followed by its hash tree verifies against the record on the UKI's command line (veritysetup verify, which
// reads every block); and, mounting the erofs read-only, what berth-node made of the machine: containerd
// configured for the kubelet, the units enabled, swap off, and nothing of the build machine's identity left.
func checkNodeRoot(t *testing.T, disk, uki string) {
	t.Helper()
	part := rootPartition(t, disk)
	record := verityRecord(t, uki)
	if !strings.EqualFold(record[0], part.uuid) {
		t.Fatalf("the UKI's command line names partition %s, the image's root is %s", record[0], part.uuid)
	}
	dev := part.loop(t, true)
	if out, err := exec.Command("veritysetup", "verify", dev, dev, record[3], "--no-superblock", "--data-blocks="+record[1],
		"--hash-offset="+record[2], "--salt="+record[4]).CombinedOutput(); err != nil {
		t.Fatalf("the image's root does not verify against the UKI's root hash: %v\n%s", err, out)
	}
	root := mount(t, dev)
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
	for _, name := range []string{"usr/bin/kubelet", "usr/bin/kubeadm", "usr/local/bin/berth-agent", strings.TrimPrefix(lab.CNIBinDir, "/") + "/bridge", "usr/bin/containerd"} {
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
