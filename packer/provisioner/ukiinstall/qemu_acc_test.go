package ukiinstall

import (
	"context"
	"encoding/hex"
	"fmt"
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
			filepath.Join(kube, name), "/usr/bin/"+name, packertest.FileSHA256(t, filepath.Join(kube, name))))
	}
	var archives []string
	// CoreDNS runs on the lab's own nodes before this one joins, and the workload image is other tests'.
	for _, path := range l.NodeImageArchives(l.CoreDNSImage(), lab.WorkloadImage) {
		archives = append(archives, fmt.Sprintf("{source=%q, sha256=%q}", path, packertest.FileSHA256(t, path)))
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
	extraFiles := fmt.Sprintf("[{source=%q, destination=%q, sha256=%q}]", imageRule, "/etc/udev/rules.d/90-berth-image.rules", packertest.FileSHA256(t, imageRule))

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
	packertest.CheckNodeRoot(t, image, uki, lab.CNIBinDir)

	start = time.Now()
	if err := <-clusterUp; err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > time.Second {
		t.Logf("the lab's cluster was Ready %.0fs after the build", d.Seconds())
	}
	// The join policy admits the lab's own image and, for workers, the baked one by the manifest's PCRs:
	// a join is the check of the prediction.
	qemuImage := workerImage(t, img)
	if err := l.SetPolicy(ctx, &policy.Policy{Images: []policy.Image{lab.LabImage(lab.ImageNames[0]), qemuImage}}); err != nil {
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
	reachVM(ctx, t, l, node, "on-vm", "from-worker-0")
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
	reachVM(ctx, t, l, node, "on-vm", "after-reboot")
	t.Logf("its pod ran again and answered in %.0fs", time.Since(start).Seconds())

	// The machines that follow get the CPU to themselves.
	node.PowerOff()
	if os.Getenv("BERTH_LOCAL_NODE_JOIN") != "" {
		checkLocalImage(ctx, t, l, localImage{vm: vm, stub: parts.Stub, agent: agent, agentConfig: agentConfig,
			kubeFiles: files, archives: archives, dir: filepath.Join(dir, "local"), qemuImage: qemuImage})
	}
	checkTamperedImages(ctx, t, l, image, img.Name, dir)
}

// workerImage is the join policy's image for workers booted from the manifest's image: its predicted PCRs.
func workerImage(t *testing.T, img imagemanifest.Image) policy.Image {
	t.Helper()
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
	return policy.Image{Name: img.Name, PCRs: pcrs, Roles: []metadata.Role{metadata.RoleWorker}}
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
func reachVM(ctx context.Context, t *testing.T, l *lab.Lab, node *labvm.VM, service, pod string) {
	t.Helper()
	answered, err := l.FetchProbe(ctx, pod, service, l.Node("worker-0"), 1)
	if err != nil {
		t.Fatalf("%v\n%s", err, node.Diagnose(ctx))
	}
	replicas, err := l.ProbeReplicas(ctx, service)
	if err != nil {
		t.Fatal(err)
	}
	if len(answered) != 1 || replicas[answered[0]] != node.Name {
		t.Fatalf("%s: answered by %v, want the replica on %s (%v)", pod, answered, node.Name, replicas)
	}
}
