package lab

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"
	"sigs.k8s.io/yaml"

	"github.com/berthlabs/berth/internal/cloudinit"
	"github.com/berthlabs/berth/internal/luks"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/test/swtpm"
)

// nodeMounts are the directories a node has of its own, over the host's: what kubeadm, the kubelet,
// containerd and the agent write.
var nodeMounts = []string{
	"/etc/kubernetes", "/var/lib/kubelet", "/var/lib/etcd", "/etc/cni/net.d", "/var/lib/cni",
	"/var/log/pods", "/var/log/containers", "/var/lib/berth", "/run/containerd", "/run/netns", "/etc/berth",
	"/run/flannel",
}

// cniBinDir is where a node's containerd finds its CNI plugins: a directory of its own (under /var/lib/cni),
// because Flannel's DaemonSet installs its plugin there, beside Debian's plugins that the lab links in.
const cniBinDir = "/var/lib/cni/bin"

// cloudInitFile keeps a bare-metal node's #cloud-config, which the lab applies at every power-on as
// cloud-init would.
const cloudInitFile = "cloud-init.yaml"

// Node is one lab machine: a network namespace with its own address, private mount and UTS namespaces (its
// own hostname), its own swtpm, LUKS2 state-disk image, containerd and berth-agent.
type Node struct {
	Name  string
	Role  metadata.Role
	Addr  netip.Addr
	Image string // one of ImageNames: what the lab's firmware measures at power-on
	Dir   string
	// CloudInit is the #cloud-config of a bare-metal node (Machine.CloudInit), "" for nodes that read the
	// metadata service.
	CloudInit string
	// InstanceID is the node's EC2 instance id in an AWS lab (Config.AWS), its instance's
	// projects/<project>/zones/<zone>/instances/<id> in a GCP lab (Config.GCP), empty elsewhere.
	InstanceID string

	lab *Lab
	// kubeBin is the directory of the node's Kubernetes binaries, and images the images of their release:
	// the lab's, unless its image is an upgrade's (UpgradeImage) or its machine had binaries of its own
	// (Machine.KubeBin). carried are the images of the release before, which such a node carries too.
	kubeBin string
	images  imageSet
	carried imageSet
	// ec2 is what the node is to EC2, in an AWS lab.
	ec2 *ec2Instance
	// gce is what the node is to Compute Engine, in a GCP lab.
	gce    *gceInstance
	holder int // pid of the process that keeps the mount namespace
	booted time.Time
	// bootLog is where the agent's log of this boot begins, in the process that booted the node.
	bootLog int64
	// agentMu guards the agent's pid and the boot it belongs to, which the goroutine that restarts a failed
	// agent reads and writes.
	agentMu  sync.Mutex
	agentPID int
	agentGen int
	// agentExit, in the process that booted the node, receives the agent's exit once it ends for good (it
	// exited cleanly, or failed more often than the lab restarts it); an agent that ends while the lab waits
	// is a failure.
	agentExit chan error
}

// nodeState is the node's node.json: what a later process needs to power the node off or wait for it, and
// the Kubernetes binaries and images of a node whose release is not the lab's.
type nodeState struct {
	Holder  int       `json:"holderPID"`
	Agent   int       `json:"agentPID"`
	Booted  time.Time `json:"booted"`
	KubeBin string    `json:"kubeBin,omitempty"`
	Images  *imageSet `json:"images,omitempty"`
	Carried *imageSet `json:"carried,omitempty"`
}

func (l *Lab) newNode(m Machine) *Node {
	n := &Node{Name: m.Name, Role: m.Role, Addr: m.Addr, Image: m.Image, Dir: l.path("nodes/" + m.Name), CloudInit: m.CloudInit, lab: l}
	n.kubeBin, n.images, n.carried = l.release(m.Image)
	return n
}

// useKubeBin makes the node run the Kubernetes binaries in dir, and load the images of their release,
// made in the lab's image directory unless an earlier lab did, and of the lab's.
func (n *Node) useKubeBin(ctx context.Context, dir string) error {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return err
	}
	if n.images, err = imagesIn(ctx, dir, n.lab.cfg.ImageDir); err != nil {
		return fmt.Errorf("images of %s: %w", dir, err)
	}
	n.kubeBin, n.carried = dir, n.lab.images
	return nil
}

// save records the node's processes in node.json, and its binaries and images if they are not the lab's.
func (n *Node) save() error {
	n.agentMu.Lock()
	pid := n.agentPID
	n.agentMu.Unlock()
	st := nodeState{Holder: n.holder, Agent: pid, Booted: n.booted}
	if n.kubeBin != n.lab.cfg.KubeBin {
		st.KubeBin, st.Images, st.Carried = n.kubeBin, &n.images, &n.carried
	}
	return writeJSON(n.path("node.json"), st)
}

// load reads node.json, and the cloud-config of a bare-metal node; a node that was never powered on has no
// node.json.
func (n *Node) load() error {
	if err := n.loadAWS(); err != nil {
		return err
	}
	if err := n.loadGCP(); err != nil {
		return err
	}
	if ci, err := os.ReadFile(n.path(cloudInitFile)); err == nil {
		n.CloudInit = string(ci)
	} else if !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	data, err := os.ReadFile(n.path("node.json"))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var st nodeState
	if err := json.Unmarshal(data, &st); err != nil {
		return fmt.Errorf("reading %s: %w", n.path("node.json"), err)
	}
	n.holder, n.agentPID, n.booted = st.Holder, st.Agent, st.Booted
	if st.KubeBin != "" {
		n.kubeBin, n.images, n.carried = st.KubeBin, *st.Images, n.lab.images
		if st.Carried != nil {
			n.carried = *st.Carried
		}
	}
	return nil
}

func (n *Node) netns() string        { return "/run/netns/" + netnsPrefix + n.Name }
func (n *Node) mountns() string      { return fmt.Sprintf("/proc/%d/ns/mnt", n.holder) }
func (n *Node) utsns() string        { return fmt.Sprintf("/proc/%d/ns/uts", n.holder) }
func (n *Node) path(p string) string { return filepath.Join(n.Dir, p) }
func (n *Node) cgroup() string       { return filepath.Join(cgroupParent, n.Name) }

// joinCgroupScript puts the shell in the node's system cgroup, so that everything the node starts (pods
// included, under the kubelet's cgroup root) is found at lab-down and counted in the node's memory.
func (n *Node) joinCgroupScript() (string, error) {
	return cgroupScript(filepath.Join(n.Name, "system"))
}

// create makes what a node keeps across reboots: its cgroup, network namespace, TPM and state disk; an AWS
// node also its IMDS's configuration, with userData.
func (n *Node) create(ctx context.Context, userData metadata.UserData) error {
	for _, d := range []string{"", "tpm", "containerd", "logs"} {
		if err := os.MkdirAll(n.path(d), 0o700); err != nil {
			return err
		}
	}
	if err := makeCgroup(filepath.Join(n.Name, "system")); err != nil {
		return fmt.Errorf("cgroups: %w", err)
	}
	cidr := netip.PrefixFrom(n.Addr, labSubnet.Bits()).String()
	if err := setupNodeNetwork(ctx, n.Name, cidr, hostAddr.String()); err != nil {
		return fmt.Errorf("network: %w", err)
	}
	if err := os.MkdirAll(n.path("tpm/state"), 0o700); err != nil {
		return err
	}
	if n.ec2 != nil {
		// A NitroTPM: an EK, but no EK certificate; EC2's API vouches for the EK instead.
		if err := swtpm.ManufactureWithoutCertificates(n.path("tpm/state")); err != nil {
			return err
		}
		if err := n.createAWS(ctx, userData); err != nil {
			return err
		}
	} else if n.gce != nil {
		// A vTPM: its EK certificate is written at the first power-on, once the EK is known.
		if err := swtpm.ManufactureWithoutCertificates(n.path("tpm/state")); err != nil {
			return err
		}
		if err := n.createGCP(ctx, userData); err != nil {
			return err
		}
	} else if err := n.lab.ekCA.Manufacture(n.path("tpm/state")); err != nil {
		return err
	}
	if err := CreateSparse(n.path("state.img"), 64<<20); err != nil {
		return err
	}
	if n.CloudInit != "" {
		if err := os.WriteFile(n.path(cloudInitFile), []byte(n.CloudInit), 0o600); err != nil {
			return err
		}
	}
	return n.writeConfigs()
}

// applyCloudInit does cloud-init's part on a bare-metal node: the files of its #cloud-config written (the
// lab takes them under /etc/berth only), and its hostname returned. A node without one is named by its name.
func (n *Node) applyCloudInit() (hostname string, err error) {
	if n.CloudInit == "" {
		return n.Name, nil
	}
	cc, err := cloudinit.Parse(n.CloudInit)
	if err != nil {
		return "", err
	}
	for _, f := range cc.WriteFiles {
		if !strings.HasPrefix(f.Path, "/etc/berth/") || !filepath.IsLocal(strings.TrimPrefix(f.Path, "/etc/berth/")) {
			return "", fmt.Errorf("cloud-config writes %s: the lab applies files under /etc/berth only", f.Path)
		}
		mode, err := strconv.ParseUint(f.Permissions, 8, 32)
		if err != nil {
			return "", fmt.Errorf("cloud-config: permissions %q of %s: %w", f.Permissions, f.Path, err)
		}
		dst := n.path("fs" + f.Path)
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			return "", err
		}
		if err := os.WriteFile(dst, []byte(f.Content), os.FileMode(mode)); err != nil {
			return "", err
		}
	}
	if cc.Hostname != "" {
		return cc.Hostname, nil
	}
	return n.Name, nil
}

// powerOn starts a node as a machine that is switched on: a fresh mount namespace over its persistent
// directories, empty /run, then swtpm, the firmware's measurement of the image, containerd and berth-agent.
func (n *Node) powerOn(ctx context.Context) error {
	for _, d := range []string{"fs/run/containerd", "fs/run/netns"} {
		if err := os.RemoveAll(n.path(d)); err != nil {
			return err
		}
	}
	// A real power cut takes every cgroup with it. Left here, the last boot's pod cgroups each cost the next
	// kubelet's start about three seconds (cAdvisor asks containerd for a task that no longer exists):
	// the fourteen of a control-plane node held its restart up for most of a minute.
	if err := removeCgroups(filepath.Join(n.Name, "kubepods")); err != nil {
		return fmt.Errorf("removing the last boot's pod cgroups: %w", err)
	}
	if err := resetNodeNetwork(ctx, n.Name); err != nil {
		return fmt.Errorf("network: %w", err)
	}
	hostname, err := n.applyCloudInit()
	if err != nil {
		return fmt.Errorf("cloud-init: %w", err)
	}
	if err := n.mountNamespace(ctx, hostname); err != nil {
		return err
	}
	if err := n.save(); err != nil {
		return err
	}
	if err := n.startTPM(); err != nil {
		return err
	}
	n.lab.progress("%s: swtpm up, PCR %d measured for image %s", n.Name, imagePCR, n.Image)
	if n.ec2 != nil {
		if err := n.powerOnAWS(ctx); err != nil {
			return err
		}
		n.lab.progress("%s: instance %s (group %s) known to EC2, its IMDS on %s", n.Name, n.ec2.ID, n.ec2.Group, imdsAddr)
	}
	if n.gce != nil {
		if err := n.powerOnGCP(ctx); err != nil {
			return err
		}
		n.lab.progress("%s: instance %d (group %s) known to Compute Engine, its metadata server on %s", n.Name, n.gce.ID, n.gce.Group, gceMetadataAddr)
	}
	images := n.containerImages()
	loaded, err := n.startContainerd(ctx, images)
	if err != nil {
		return err
	}
	n.lab.progress("%s: containerd up with its %d images, %d of them loaded now", n.Name, len(images), loaded)
	if err := n.boot(); err != nil {
		return err
	}
	// A control-plane node that boots again runs the controller manager again, once the cluster exists.
	if _, err := os.Stat(n.lab.path("admin.conf")); err == nil && n.runsCloudControllerManager() {
		if err := n.startCloudControllerManager(); err != nil {
			return err
		}
	}
	return n.save()
}

// PowerOff stops everything the node runs, its mount namespace included, as a power loss would; its
// disks (directories, state image, TPM state) stay.
func (n *Node) PowerOff() {
	// The agent's restarts belong to the boot that ends here.
	n.agentMu.Lock()
	n.agentGen++
	n.agentMu.Unlock()
	n.stop(10 * time.Second)
	n.setEC2State("stopped")
	// The pid comes from node.json when another process powered the node on: kill it only while it is
	// still the node's.
	if n.holder != 0 && slices.Contains(cgroupPIDs(n.Name), n.holder) {
		syscall.Kill(n.holder, syscall.SIGKILL)
	}
}

// Reboot powers the node off and on again; the TPM comes back with fresh PCRs, measured again.
func (n *Node) Reboot(ctx context.Context) error {
	n.PowerOff()
	return n.powerOn(ctx)
}

// Reimage powers the node off, puts image on it and powers it on: a machine reinstalled in place, as a
// bare-metal roll does, which keeps its TPM and state disk. The firmware measures the new image, and the node
// runs the Kubernetes binaries of that image's release with the agent configuration the image brings, so
// agent options set on the old image (SetAgentOption) are gone.
func (n *Node) Reimage(ctx context.Context, image string) error {
	if images := n.lab.imageNames(); !slices.Contains(images, image) {
		return fmt.Errorf("reimaging %s: image %q is not one of the lab's images (%s)", n.Name, image, strings.Join(images, ", "))
	}
	n.PowerOff()
	err := n.lab.withLock(func() error {
		doc, err := readDocument(n.lab.path(documentFile))
		if err != nil {
			return err
		}
		for i := range doc.Instances {
			if doc.Instances[i].Name == n.Name {
				doc.Instances[i].ImageID = image
			}
		}
		return writeJSON(n.lab.path(documentFile), doc)
	})
	if err != nil {
		return fmt.Errorf("reimaging %s: %w", n.Name, err)
	}
	n.Image = image
	n.kubeBin, n.images, n.carried = n.lab.release(image)
	if err := n.writeConfigs(); err != nil {
		return fmt.Errorf("reimaging %s: %w", n.Name, err)
	}
	n.lab.progress("%s: reimaged with %s (Kubernetes %s)", n.Name, image, n.images.Kubernetes)
	return n.powerOn(ctx)
}

// mountNamespace makes the node's private mount and UTS namespaces, kept by a holder process, with the
// node's own directories over the host's and hostname as its hostname.
func (n *Node) mountNamespace(ctx context.Context, hostname string) error {
	script, err := n.joinCgroupScript()
	if err != nil {
		return err
	}
	holder := exec.Command("unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c", script, "sh", "sleep", "infinity")
	holder.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := holder.Start(); err != nil {
		return fmt.Errorf("mount namespace: %w", err)
	}
	n.holder = holder.Process.Pid
	go holder.Wait()
	// unshare has made the namespace once the holder runs as sleep.
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", n.holder)); strings.TrimSpace(string(comm)) == "sleep" {
			break
		}
		if time.Now().After(deadline) {
			return errors.New("mount namespace holder did not start")
		}
	}
	if _, err := run(ctx, "nsenter", "--uts="+n.utsns(), "hostname", hostname); err != nil {
		return err
	}
	// The lab's names resolve locally: kubeadm looks its node's name up, and no nameserver is reachable.
	if _, err := run(ctx, "nsenter", "--mount="+n.mountns(), "mount", "--bind", n.lab.path("hosts"), "/etc/hosts"); err != nil {
		return err
	}
	for _, target := range nodeMounts {
		src := n.path("fs" + target)
		if err := os.MkdirAll(src, 0o755); err != nil {
			return err
		}
		if _, err := run(ctx, "nsenter", "--mount="+n.mountns(), "mount", "--bind", src, target); err != nil {
			return err
		}
	}
	return nil
}

// start runs a long-lived process of the node in its namespaces and cgroup, in a session of its own so that
// it outlives the lab command; output goes to logs/<log>.log.
func (n *Node) start(log string, args ...string) error {
	_, _, err := n.startCmd(log, args...)
	return err
}

// startCmd is start returning the process's pid (nsenter and sh exec it, so the pid stays the program's)
// and a channel that receives its exit.
func (n *Node) startCmd(log string, args ...string) (int, <-chan error, error) {
	return n.startCmdEnv(log, nil, args...)
}

// startCmdEnv is startCmd with env as the process's environment; nil is the host's.
func (n *Node) startCmdEnv(log string, env []string, args ...string) (int, <-chan error, error) {
	script, err := n.joinCgroupScript()
	if err != nil {
		return 0, nil, err
	}
	out, err := os.OpenFile(n.path("logs/"+log+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return 0, nil, err
	}
	defer out.Close()
	full := append([]string{"--net=" + n.netns(), "--mount=" + n.mountns(), "--uts=" + n.utsns(), "--", "sh", "-c", script, "sh"}, args...)
	cmd := exec.Command("nsenter", full...)
	// kubeadm checks the kubelet's version by running it from PATH, as on an image that installed it.
	if env == nil {
		env = os.Environ()
	}
	cmd.Env = append(env, "PATH="+n.kubeBin+":"+os.Getenv("PATH"))
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return 0, nil, fmt.Errorf("%s on %s: %w", log, n.Name, err)
	}
	exit := make(chan error, 1)
	go func() { exit <- cmd.Wait() }()
	return cmd.Process.Pid, exit, nil
}

// exec runs a short command inside the node and returns its output.
func (n *Node) exec(ctx context.Context, args ...string) (string, error) {
	return run(ctx, "nsenter", append([]string{"--net=" + n.netns(), "--mount=" + n.mountns(), "--uts=" + n.utsns(), "--"}, args...)...)
}

// startTPM starts the node's swtpm and, as the node's firmware, measures the image into it.
func (n *Node) startTPM() error {
	sock := n.path("tpm/tpm.sock")
	if err := n.start("swtpm", swtpm.Command(n.path("tpm/state"), sock).Args...); err != nil {
		return err
	}
	if err := swtpm.WaitReady(sock, 10*time.Second); err != nil {
		return fmt.Errorf("%w (see %s)", err, n.path("logs/swtpm.log"))
	}
	return measureImage(sock, n.Image)
}

// containerImages are the images the node loads: those of its release, control-plane images on a
// control-plane node, and for a node of another release than the lab's also those of the release before,
// which the cluster's static pods and addons run until they are upgraded; of two images of one name, its
// release's.
func (n *Node) containerImages() []imageArchive {
	var images []imageArchive
	for _, set := range []imageSet{n.images, n.carried} {
		archives := set.Node
		if n.Role == metadata.RoleControlPlane {
			archives = slices.Concat(set.Node, set.ControlPlane)
		}
		for _, a := range archives {
			if !slices.ContainsFunc(images, func(b imageArchive) bool { return b.Name == a.Name }) {
				images = append(images, a)
			}
		}
	}
	return images
}

// startContainerd starts the node's containerd and loads those of its images that containerd does not hold
// yet, as a node's disk keeps what it pulled across reboots; it returns how many it loaded. Loading them
// again at every power-on took a control-plane node eight to sixteen seconds of each boot.
func (n *Node) startContainerd(ctx context.Context, images []imageArchive) (int, error) {
	if err := n.start("containerd", "containerd", "--config", n.path("containerd.toml")); err != nil {
		return 0, err
	}
	var held string
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		var err error
		if held, err = n.exec(ctx, "ctr", "-n", "k8s.io", "images", "list", "--quiet"); err == nil {
			break
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("containerd on %s did not answer (see %s)", n.Name, n.path("logs/containerd.log"))
		}
	}
	heldNames := strings.Fields(held)
	loaded := 0
	for _, img := range images {
		if slices.Contains(heldNames, img.Name) {
			continue
		}
		if _, err := n.exec(ctx, "ctr", "-n", "k8s.io", "images", "import", img.Path); err != nil {
			return loaded, fmt.Errorf("loading %s on %s: %w", img.Name, n.Name, err)
		}
		loaded++
	}
	return loaded, nil
}

// The image's unit restarts a failed agent (Restart=on-failure, RestartSec=5s) unless it exited for its
// command line or its configuration (RestartPreventExitStatus=2 3); so does the lab, up to agentRestarts times
// in one boot, after which it reports the agent gone where systemd would go on trying.
const (
	agentRestartSec = 5 * time.Second
	agentRestarts   = 3
)

// agentNoRestart are the unit's RestartPreventExitStatus: berth-agent's exit codes for a wrong command line
// and a wrong configuration.
var agentNoRestart = []int{2, 3}

// boot starts berth-agent as the image's systemd unit would.
func (n *Node) boot() error {
	n.booted = time.Now()
	n.bootLog = 0
	if fi, err := os.Stat(n.path("logs/agent.log")); err == nil {
		n.bootLog = fi.Size()
	}
	n.agentMu.Lock()
	n.agentGen++
	gen := n.agentGen
	exit, err := n.startAgentLocked()
	n.agentMu.Unlock()
	if err != nil {
		return err
	}
	// The channel is this boot's: the agent of an earlier boot, killed by Reboot, must not report into it.
	gone := make(chan error, 1)
	n.agentExit = gone
	go n.superviseAgent(gen, exit, gone)
	return nil
}

func (n *Node) startAgentLocked() (<-chan error, error) {
	var env []string
	switch {
	case n.ec2 != nil:
		env = n.agentEnv()
	case n.gce != nil:
		env = n.gcpAgentEnv()
	}
	pid, exit, err := n.startCmdEnv("agent", env, n.lab.cfg.AgentBinary, "boot", "--config", n.path("agent.yaml"))
	if err != nil {
		return nil, err
	}
	n.agentPID = pid
	return exit, nil
}

// superviseAgent restarts the agent of boot gen when it fails, as its unit would, and writes each restart
// into the agent's log, so that none is silent. An agent that exits cleanly or fails once too often, or
// whose node is off (powered off or taken down, its namespace holder gone), is reported on gone.
func (n *Node) superviseAgent(gen int, exit <-chan error, gone chan<- error) {
	for restarts := 0; ; restarts++ {
		err := <-exit
		var exitErr *exec.ExitError
		final := errors.As(err, &exitErr) && slices.Contains(agentNoRestart, exitErr.ExitCode())
		if err == nil || final || restarts == agentRestarts || !n.stillOn(gen) {
			gone <- fmt.Errorf("berth-agent exited: %v", err)
			return
		}
		n.agentLogLine(fmt.Sprintf("lab: berth-agent exited (%v); starting it again in %s, as its unit's Restart=on-failure does", err, agentRestartSec))
		time.Sleep(agentRestartSec)
		n.agentMu.Lock()
		if !n.stillOnLocked(gen) {
			n.agentMu.Unlock()
			gone <- fmt.Errorf("berth-agent exited: %v", err)
			return
		}
		exit, err = n.startAgentLocked()
		n.agentMu.Unlock()
		if err != nil {
			gone <- fmt.Errorf("starting berth-agent again: %w", err)
			return
		}
	}
}

func (n *Node) stillOn(gen int) bool {
	n.agentMu.Lock()
	defer n.agentMu.Unlock()
	return n.stillOnLocked(gen)
}

// stillOnLocked says whether boot gen goes on: no power-off since, and the namespace holder alive (Down
// kills every process of the lab without a power-off).
func (n *Node) stillOnLocked(gen int) bool {
	return gen == n.agentGen && n.holder != 0 && syscall.Kill(n.holder, 0) == nil
}

// agentLogLine appends a line of the lab's own to the agent's log.
func (n *Node) agentLogLine(line string) {
	f, err := os.OpenFile(n.path("logs/agent.log"), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		return
	}
	defer f.Close()
	fmt.Fprintln(f, line)
}

// servesJoins says whether the node's agent has logged, in this boot, that its join service listens.
func (n *Node) servesJoins() bool {
	data, err := os.ReadFile(n.path("logs/agent.log"))
	return err == nil && bytes.Contains(data[min(n.bootLog, int64(len(data))):], []byte(`"msg":"join service listening"`))
}

// agentRunning says whether the agent of the node's current boot runs, without taking its exit from
// agentGone.
func (n *Node) agentRunning() bool {
	n.agentMu.Lock()
	pid := n.agentPID
	n.agentMu.Unlock()
	if pid == 0 {
		return false
	}
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	return err == nil && bytes.Contains(cmdline, []byte(n.path("agent.yaml")))
}

// agentGone says why the node's agent no longer runs, or nil while it runs or before it was started. In
// a process that did not boot the node, it looks for the agent's pid with the node's own configuration.
func (n *Node) agentGone() error {
	if n.agentExit != nil {
		select {
		case err := <-n.agentExit:
			return err
		default:
			return nil
		}
	}
	if n.agentRunning() {
		return nil
	}
	n.agentMu.Lock()
	defer n.agentMu.Unlock()
	if n.agentPID == 0 {
		return nil
	}
	return fmt.Errorf("berth-agent (pid %d) is no longer running", n.agentPID)
}

// writeConfigs writes the node's containerd, CNI and agent configuration.
func (n *Node) writeConfigs() error {
	containerd := fmt.Sprintf(`version = 2
root = %q
state = "/run/containerd"
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  # This machine withholds CAP_SYS_RESOURCE, so no process may lower an OOM score, and the CRI lowers it
  # for every pod sandbox: clamp it at containerd's own instead.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %q
    conf_dir = "/etc/cni/net.d"
`, n.path("containerd"), n.images.Pause, cniBinDir)
	if err := os.WriteFile(n.path("containerd.toml"), []byte(containerd), 0o644); err != nil {
		return err
	}
	if err := linkCNIPlugins(n.path("fs" + cniBinDir)); err != nil {
		return err
	}
	cfg := map[string]any{
		"tpm":        "unix:" + n.path("tpm/tpm.sock"),
		"stateDisk":  n.path("state.img"),
		"kubeadm":    filepath.Join(n.kubeBin, "kubeadm"),
		"ekCABundle": n.lab.EKCAPath(),
		// The lab's nodes share the host's kernel, whose connection-tracking table size only the host sets.
		"kubeProxy": map[string]any{"conntrackMaxPerCore": 0},
		// Flannel itself is built here under upstream's name (FlannelImage); its CNI plugin is a stand-in.
		"podNetwork":    map[string]any{"cniBinDir": cniBinDir, "flannelCNIPluginImage": FlannelCNIImage},
		"retryMax":      "2s",
		"pcrs":          QuotedPCRs,
		"sourceAddress": n.Addr.String(),
		// The lab's host runs cgroup v1 without systemd, and its nodes share one kernel.
		"ignorePreflightErrors": []string{"SystemVerification", "Swap"},
		"kubelet": map[string]any{
			"run":           true,
			"binary":        filepath.Join(n.kubeBin, "kubelet"),
			"cgroupDriver":  "cgroupfs",
			"allowCgroupV1": true,
			"extraArgs": map[string]string{
				"cgroup-root":  "/" + n.cgroup(),
				"fail-swap-on": "false",
				// The nodes share the host's disk, and how full it is belongs to the host: with kubelet's
				// defaults a host disk 85 % full had every node evict the test's pods for DiskPressure, and
				// delete the images it loaded (pause among them: the registry is out of reach) to free it.
				"eviction-hard":           "memory.available<100Mi,nodefs.available<1%,imagefs.available<1%,nodefs.inodesFree<1%",
				"image-gc-high-threshold": "100",
			},
		},
	}
	if d := n.lab.cfg.CertificateRenewBefore; d != 0 {
		cfg["certificateRenewBefore"] = d.String()
	}
	if d := n.lab.cfg.GoneNodeGrace; d != 0 {
		cfg["goneNodeGrace"] = d.String()
	}
	// A bare-metal node has no metadata service: its agent reads the user-data cloud-init wrote. An EC2
	// instance reads IMDS, and its join service asks EC2.
	switch {
	case n.ec2 != nil:
		cfg["aws"] = awsAgentConfig()
		if n.lab.cfg.AWS.CloudControllerManager != "" {
			cfg["kubelet"].(map[string]any)["cloudProvider"] = "external"
		}
	case n.gce != nil:
		cfg["gcp"] = n.gcpAgentConfig()
	case n.CloudInit != "":
		cfg["userDataFile"] = cloudinit.UserDataPath
	default:
		cfg["metadataURL"] = MetadataURL
	}
	data, err := yaml.Marshal(cfg)
	if err != nil {
		return err
	}
	return os.WriteFile(n.path("agent.yaml"), data, 0o600)
}

// ClearTPM clears the node's TPM as an owner who runs TPM2_Clear would (its storage seed changes; its EK and
// EK certificate stay). The node must be powered off: its swtpm runs only for the command.
func (n *Node) ClearTPM() error {
	sock := n.path("tpm/clear.sock")
	cmd := swtpm.Command(n.path("tpm/state"), sock)
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("clearing %s's TPM: %w", n.Name, err)
	}
	defer func() {
		cmd.Process.Kill()
		cmd.Wait()
	}()
	if err := swtpm.WaitReady(sock, 10*time.Second); err != nil {
		return err
	}
	conn, err := net.Dial("unix", sock)
	if err != nil {
		return err
	}
	defer conn.Close()
	_, err = tpm2.Clear{AuthHandle: tpm2.AuthHandle{Handle: tpm2.TPMRHLockout, Auth: tpm2.PasswordAuth(nil)}}.Execute(transport.FromReadWriter(conn))
	if err != nil {
		return fmt.Errorf("clearing %s's TPM: %w", n.Name, err)
	}
	return nil
}

// Disk is the node's state disk.
func (n *Node) Disk() *luks.Volume { return luks.New(n.path("state.img"), nil) }

// SetAgentOption sets one field of the node's agent configuration, for its next boot.
func (n *Node) SetAgentOption(key string, value any) error {
	data, err := os.ReadFile(n.path("agent.yaml"))
	if err != nil {
		return err
	}
	cfg := map[string]any{}
	if err := yaml.Unmarshal(data, &cfg); err != nil {
		return err
	}
	cfg[key] = value
	if data, err = yaml.Marshal(cfg); err != nil {
		return err
	}
	return os.WriteFile(n.path("agent.yaml"), data, 0o600)
}

// Memory is the most memory the node's cgroup ever held (page cache of its images and disks included), and
// the resident memory of its processes now, pods included.
func (n *Node) Memory() (peak, rss int64, err error) {
	dir := filepath.Join(cgroupRoot, "memory", n.cgroup())
	data, err := os.ReadFile(filepath.Join(dir, "memory.max_usage_in_bytes"))
	if err != nil {
		return 0, 0, err
	}
	if peak, err = strconv.ParseInt(strings.TrimSpace(string(data)), 10, 64); err != nil {
		return 0, 0, err
	}
	stat, err := os.ReadFile(filepath.Join(dir, "memory.stat"))
	if err != nil {
		return 0, 0, err
	}
	for _, line := range strings.Split(string(stat), "\n") {
		if v, ok := strings.CutPrefix(line, "total_rss "); ok {
			rss, err = strconv.ParseInt(v, 10, 64)
			return peak, rss, err
		}
	}
	return 0, 0, fmt.Errorf("no total_rss in %s/memory.stat", dir)
}

// stop ends the node's processes (agent, kubelet, containerd, pods) but the mount namespace's holder, as
// a machine that loses power would.
func (n *Node) stop(grace time.Duration) {
	pids := slices.DeleteFunc(cgroupPIDs(n.Name), func(p int) bool { return p == n.holder })
	for _, p := range pids {
		syscall.Kill(p, syscall.SIGTERM)
	}
	deadline := time.Now().Add(grace)
	for _, p := range pids {
		for syscall.Kill(p, 0) == nil && time.Now().Before(deadline) {
			time.Sleep(50 * time.Millisecond)
		}
		syscall.Kill(p, syscall.SIGKILL)
	}
}
