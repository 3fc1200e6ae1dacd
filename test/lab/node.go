package lab

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/swtpm"
)

// nodeMounts are the directories a node has of its own, over the host's: what kubeadm, the kubelet,
// containerd and the agent write.
var nodeMounts = []string{
	"/etc/kubernetes", "/var/lib/kubelet", "/var/lib/etcd", "/etc/cni/net.d", "/var/lib/cni",
	"/var/log/pods", "/var/log/containers", "/var/lib/berth", "/run/containerd", "/run/netns",
}

// Node is one lab machine: a network namespace with its own address, a private mount namespace, its own
// swtpm, LUKS2 state-disk image, containerd and berth-agent.
type Node struct {
	Name string
	Role metadata.Role
	Addr netip.Addr
	Dir  string

	lab    *Lab
	holder int // pid of the process that keeps the mount namespace
	booted time.Time
	// agentExit receives the agent's exit when it ends; an agent that ends while the lab waits is a failure.
	agentExit chan error
}

func (n *Node) netns() string        { return "/run/netns/" + netnsPrefix + n.Name }
func (n *Node) mountns() string      { return fmt.Sprintf("/proc/%d/ns/mnt", n.holder) }
func (n *Node) path(p string) string { return filepath.Join(n.Dir, p) }
func (n *Node) cgroup() string       { return filepath.Join(cgroupParent, n.Name) }

// joinCgroupScript puts the shell in the node's system cgroup, so that everything the node starts (pods
// included, under the kubelet's cgroup root) is found at lab-down and counted in the node's memory.
func (n *Node) joinCgroupScript() (string, error) {
	return cgroupScript(filepath.Join(n.Name, "system"))
}

// create makes what a node keeps across reboots: its cgroup, network namespace, TPM and state disk.
func (n *Node) create(ctx context.Context) error {
	for _, d := range []string{"", "tpm", "containerd", "logs"} {
		if err := os.MkdirAll(n.path(d), 0o700); err != nil {
			return err
		}
	}
	if err := makeCgroup(filepath.Join(n.Name, "system")); err != nil {
		return fmt.Errorf("cgroups: %w", err)
	}
	cidr := netip.PrefixFrom(n.Addr, n.lab.subnet.Bits()).String()
	if err := setupNodeNetwork(ctx, n.Name, cidr, n.lab.hostAddr.String()); err != nil {
		return fmt.Errorf("network: %w", err)
	}
	if err := os.MkdirAll(n.path("tpm/state"), 0o700); err != nil {
		return err
	}
	if err := n.lab.ekCA.Manufacture(n.path("tpm/state")); err != nil {
		return err
	}
	if err := CreateSparse(n.path("state.img"), 64<<20); err != nil {
		return err
	}
	return n.writeConfigs()
}

// mountNamespace makes the node's private mount namespace, kept by a holder process, with the node's own
// directories over the host's.
func (n *Node) mountNamespace(ctx context.Context) error {
	script, err := n.joinCgroupScript()
	if err != nil {
		return err
	}
	holder := exec.Command("unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", "sleep", "infinity")
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
	// The lab's names resolve locally: kubeadm looks its node's name up, and no nameserver is reachable.
	if _, err := run(ctx, "nsenter", "--mount="+n.mountns(), "mount", "--bind", n.lab.path("hosts"), "/etc/hosts"); err != nil {
		return err
	}
	for _, target := range nodeMounts {
		src := n.path("fs" + target)
		if err := os.MkdirAll(src, 0o755); err != nil {
			return err
		}
		if err := n.lab.ensureHostDir(target); err != nil {
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
	_, err := n.startCmd(log, args...)
	return err
}

// startCmd is start returning a channel that receives the process's exit.
func (n *Node) startCmd(log string, args ...string) (<-chan error, error) {
	script, err := n.joinCgroupScript()
	if err != nil {
		return nil, err
	}
	out, err := os.OpenFile(n.path("logs/"+log+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	defer out.Close()
	full := append([]string{"--net=" + n.netns(), "--mount=" + n.mountns(), "--", "sh", "-c", script, "sh"}, args...)
	cmd := exec.Command("nsenter", full...)
	// kubeadm checks the kubelet's version by running it from PATH, as on an image that installed it.
	cmd.Env = append(os.Environ(), "PATH="+n.lab.cfg.KubeBin+":"+os.Getenv("PATH"))
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("%s on %s: %w", log, n.Name, err)
	}
	exit := make(chan error, 1)
	go func() { exit <- cmd.Wait() }()
	return exit, nil
}

// exec runs a short command inside the node and returns its output.
func (n *Node) exec(ctx context.Context, args ...string) (string, error) {
	return run(ctx, "nsenter", append([]string{"--net=" + n.netns(), "--mount=" + n.mountns(), "--"}, args...)...)
}

// startDaemons starts the node's swtpm and containerd and loads its images.
func (n *Node) startDaemons(ctx context.Context, images []string) error {
	sock := n.path("tpm/tpm.sock")
	if err := n.start("swtpm", swtpm.Command(n.path("tpm/state"), sock).Args...); err != nil {
		return err
	}
	if err := swtpm.WaitReady(sock, 10*time.Second); err != nil {
		return fmt.Errorf("%s: %w (see %s)", n.Name, err, n.path("logs/swtpm.log"))
	}
	if err := n.start("containerd", "containerd", "--config", n.path("containerd.toml")); err != nil {
		return err
	}
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if _, err := n.exec(ctx, "ctr", "version"); err == nil {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("containerd on %s did not answer (see %s)", n.Name, n.path("logs/containerd.log"))
		}
	}
	for _, img := range images {
		if _, err := n.exec(ctx, "ctr", "-n", "k8s.io", "images", "import", img); err != nil {
			return fmt.Errorf("loading %s on %s: %w", filepath.Base(img), n.Name, err)
		}
	}
	return nil
}

// boot starts berth-agent as the image's systemd unit would.
func (n *Node) boot() error {
	n.booted = time.Now()
	exit, err := n.startCmd("agent", n.lab.cfg.AgentBinary, "boot", "--config", n.path("agent.yaml"))
	if err != nil {
		return err
	}
	n.agentExit = make(chan error, 1)
	go func() { n.agentExit <- fmt.Errorf("berth-agent exited: %v", <-exit) }()
	return nil
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
    bin_dir = "/usr/lib/cni"
    conf_dir = "/etc/cni/net.d"
`, n.path("containerd"), n.lab.images.pause)
	if err := os.WriteFile(n.path("containerd.toml"), []byte(containerd), 0o644); err != nil {
		return err
	}
	cni := fmt.Sprintf(`{
  "cniVersion": "1.0.0",
  "name": "berthlab",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": %q}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "loopback"}
  ]
}
`, n.lab.podSubnet(n).String())
	if err := os.MkdirAll(n.path("fs/etc/cni/net.d"), 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(n.path("fs/etc/cni/net.d/10-berthlab.conflist"), []byte(cni), 0o644); err != nil {
		return err
	}
	cfg := map[string]any{
		"metadataURL":   "http://" + n.lab.metaAddr,
		"tpm":           "unix:" + n.path("tpm/tpm.sock"),
		"stateDisk":     n.path("state.img"),
		"kubeadm":       filepath.Join(n.lab.cfg.KubeBin, "kubeadm"),
		"ekCABundle":    n.lab.path("ek-ca.pem"),
		"skipPhases":    []string{"addon/kube-proxy", "addon/coredns"},
		"retryMax":      "2s",
		"pcrs":          QuotedPCRs,
		"sourceAddress": n.Addr.String(),
		// The lab's host runs cgroup v1 without systemd, its nodes share one kernel, and kubelet.conf is
		// written by the agent from its join ticket before kubeadm join runs.
		"ignorePreflightErrors": []string{"SystemVerification", "FileAvailable--etc-kubernetes-kubelet.conf", "Swap"},
		"kubelet": map[string]any{
			"run":           true,
			"binary":        filepath.Join(n.lab.cfg.KubeBin, "kubelet"),
			"cgroupDriver":  "cgroupfs",
			"allowCgroupV1": true,
			"extraArgs": map[string]string{
				"cgroup-root":  "/" + n.cgroup(),
				"fail-swap-on": "false",
			},
		},
	}
	data, err := yaml.Marshal(cfg)
	if err != nil {
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

// stop ends the node's processes (agent, kubelet, containerd, pods), as a machine that loses power would.
func (n *Node) stop(grace time.Duration) {
	var pids []int
	filepath.WalkDir(filepath.Join(cgroupRoot, "pids", n.cgroup()), func(path string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			data, _ := os.ReadFile(filepath.Join(path, "cgroup.procs"))
			for _, f := range strings.Fields(string(data)) {
				if pid, err := strconv.Atoi(f); err == nil && pid != n.holder {
					pids = append(pids, pid)
				}
			}
		}
		return nil
	})
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
