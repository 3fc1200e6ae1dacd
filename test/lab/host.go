package lab

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Names of what the lab makes on the host; lab-down removes everything carrying them.
const (
	bridgeName   = "berthlab0"
	netnsPrefix  = "berthlab-"
	vethPrefix   = "bl-"
	cgroupParent = "berthlab"
	cgroupRoot   = "/sys/fs/cgroup"
)

// run runs a host command and returns its trimmed output; the error carries the command and its output.
func run(ctx context.Context, name string, args ...string) (string, error) {
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return string(bytes.TrimSpace(out)), nil
}

// setupBridge makes the lab's bridge with the host's address on it.
func setupBridge(ctx context.Context, hostCIDR string) error {
	if _, err := run(ctx, "ip", "link", "show", bridgeName); err == nil {
		return fmt.Errorf("bridge %s exists: a lab is up already (make lab-down)", bridgeName)
	}
	for _, args := range [][]string{
		{"link", "add", bridgeName, "type", "bridge"},
		{"addr", "add", hostCIDR, "dev", bridgeName},
		{"link", "set", bridgeName, "up"},
	} {
		if _, err := run(ctx, "ip", args...); err != nil {
			return err
		}
	}
	return nil
}

// setupNodeNetwork gives a node its network namespace, a veth to the bridge with addr and a default route
// through the host. The pod network between nodes is Flannel's, which the cluster runs.
func setupNodeNetwork(ctx context.Context, node, cidr, gateway string) error {
	ns, veth := netnsPrefix+node, vethPrefix+node
	cmds := [][]string{
		{"netns", "add", ns},
		{"link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns},
		{"link", "set", veth, "master", bridgeName},
		{"link", "set", veth, "up"},
		{"-n", ns, "link", "set", "lo", "up"},
		{"-n", ns, "addr", "add", cidr, "dev", "eth0"},
		{"-n", ns, "link", "set", "eth0", "up"},
		{"-n", ns, "route", "add", "default", "via", gateway},
	}
	for _, args := range cmds {
		if _, err := run(ctx, "ip", args...); err != nil {
			return err
		}
	}
	// kubeadm's preflight wants forwarding on, and the node's pods are routed through its namespace. Traffic
	// between two pods of one node crosses its cni0 bridge: kube-proxy's rules see it (a Service's reply to a
	// pod on the same node) only when the bridge hands it to iptables.
	_, err := run(ctx, "ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1", "net.bridge.bridge-nf-call-iptables=1")
	return err
}

// resetNodeNetwork leaves a node's network namespace as a cold boot finds its network: the machine's
// interface and routes, but no packet-filter rules, no pod bridge and no VXLAN device, which kube-proxy,
// flanneld and the CNI plugin must make again. The namespace itself outlives the node's power cycles.
func resetNodeNetwork(ctx context.Context, node string) error {
	ns := "--net=/run/netns/" + netnsPrefix + node
	for _, cmd := range []string{"iptables", "ip6tables"} {
		for _, table := range []string{"filter", "nat", "mangle", "raw"} {
			for _, op := range []string{"-F", "-X"} {
				if _, err := run(ctx, "nsenter", ns, cmd, "-t", table, op); err != nil {
					return err
				}
			}
		}
	}
	// Deleting flannel.1 takes the routes through it to the other nodes' pods too.
	for _, link := range []string{"cni0", "flannel.1"} {
		if _, err := run(ctx, "ip", "-n", netnsPrefix+node, "link", "show", link); err != nil {
			continue
		}
		if _, err := run(ctx, "ip", "-n", netnsPrefix+node, "link", "del", link); err != nil {
			return err
		}
	}
	return nil
}

// linkCNIPlugins links the host's CNI plugins (Debian's, in /usr/lib/cni) into dir, a node's own plugin
// directory.
func linkCNIPlugins(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	plugins, err := filepath.Glob("/usr/lib/cni/*")
	if err != nil {
		return err
	}
	if len(plugins) == 0 {
		return errors.New("no CNI plugins in /usr/lib/cni: install Debian's containernetworking-plugins")
	}
	for _, p := range plugins {
		if err := os.Symlink(p, filepath.Join(dir, filepath.Base(p))); err != nil && !errors.Is(err, fs.ErrExist) {
			return err
		}
	}
	return nil
}

// cgroupControllers are the v1 hierarchies mounted on this host (cpu,cpuacct count once).
func cgroupControllers() ([]string, error) {
	entries, err := os.ReadDir(cgroupRoot)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range entries {
		p := filepath.Join(cgroupRoot, e.Name())
		if fi, err := os.Lstat(p); err != nil || !fi.IsDir() || fi.Mode()&os.ModeSymlink != 0 {
			continue
		}
		if _, err := os.Stat(filepath.Join(p, "cgroup.procs")); err == nil {
			out = append(out, e.Name())
		}
	}
	if len(out) == 0 {
		return nil, errors.New("no cgroup v1 hierarchies under " + cgroupRoot)
	}
	return out, nil
}

// makeCgroup creates /berthlab/<rel> in every hierarchy; the kubelet refuses a cgroupRoot that does not exist.
func makeCgroup(rel string) error {
	ctrls, err := cgroupControllers()
	if err != nil {
		return err
	}
	for _, c := range ctrls {
		dir := filepath.Join(cgroupRoot, c)
		for _, part := range strings.Split(filepath.Join(cgroupParent, rel), "/") {
			dir = filepath.Join(dir, part)
			if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
				return err
			}
			// A new cpuset admits no process until it has CPUs and memory nodes of its own.
			if strings.Contains(c, "cpuset") {
				for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
					if cur, _ := os.ReadFile(filepath.Join(dir, f)); len(bytes.TrimSpace(cur)) > 0 {
						continue
					}
					parent, err := os.ReadFile(filepath.Join(filepath.Dir(dir), f))
					if err != nil {
						return err
					}
					if err := os.WriteFile(filepath.Join(dir, f), parent, 0o644); err != nil {
						return err
					}
				}
			}
		}
	}
	return nil
}

// cgroupScript is a shell script that moves itself into /berthlab/<rel> in every hierarchy and then execs
// its arguments, so that the process and all it starts are found there.
func cgroupScript(rel string) (string, error) {
	ctrls, err := cgroupControllers()
	if err != nil {
		return "", err
	}
	var b strings.Builder
	for _, c := range ctrls {
		fmt.Fprintf(&b, "echo $$ > %s/%s/%s/%s/cgroup.procs; ", cgroupRoot, c, cgroupParent, rel)
	}
	b.WriteString(`exec "$@"`)
	return b.String(), nil
}

// cgroupPIDs are the processes in /berthlab/<rel> and below ("" for the whole lab), from the pids hierarchy.
func cgroupPIDs(rel string) []int {
	var pids []int
	filepath.WalkDir(filepath.Join(cgroupRoot, "pids", cgroupParent, rel), func(path string, d os.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return nil
		}
		data, _ := os.ReadFile(filepath.Join(path, "cgroup.procs"))
		for _, f := range strings.Fields(string(data)) {
			if pid, err := strconv.Atoi(f); err == nil {
				pids = append(pids, pid)
			}
		}
		return nil
	})
	return pids
}

// killProcesses stops every process in /berthlab/<rel> and below: SIGTERM, then SIGKILL for what remains.
// It returns the processes still there.
func killProcesses(rel string, grace time.Duration) []int {
	pids := cgroupPIDs(rel)
	for _, p := range pids {
		syscall.Kill(p, syscall.SIGTERM)
	}
	deadline := time.Now().Add(grace)
	for len(cgroupPIDs(rel)) > 0 && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
	}
	for i := 0; i < 20 && len(cgroupPIDs(rel)) > 0; i++ {
		for _, p := range cgroupPIDs(rel) {
			syscall.Kill(p, syscall.SIGKILL)
		}
		time.Sleep(100 * time.Millisecond)
	}
	return cgroupPIDs(rel)
}

// removeCgroups deletes /berthlab/<rel> ("" for the whole lab) and everything below it in every hierarchy,
// deepest first.
func removeCgroups(rel string) error {
	ctrls, err := cgroupControllers()
	if err != nil {
		return err
	}
	var errs []error
	for _, c := range ctrls {
		var dirs []string
		filepath.WalkDir(filepath.Join(cgroupRoot, c, cgroupParent, rel), func(path string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, path)
			}
			return nil
		})
		slices.Reverse(dirs)
		for _, d := range dirs {
			if err := os.Remove(d); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// removeNodeNetwork deletes a node's veth (both ends) and network namespace, if they exist.
func removeNodeNetwork(ctx context.Context, node string) error {
	var errs []error
	if _, err := run(ctx, "ip", "link", "show", vethPrefix+node); err == nil {
		if _, err := run(ctx, "ip", "link", "del", vethPrefix+node); err != nil {
			errs = append(errs, err)
		}
	}
	if _, err := os.Stat("/run/netns/" + netnsPrefix + node); err == nil {
		if _, err := run(ctx, "ip", "netns", "del", netnsPrefix+node); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// labNetns are the lab's network namespaces on this host.
func labNetns() []string {
	entries, _ := os.ReadDir("/run/netns")
	var out []string
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), netnsPrefix) {
			out = append(out, e.Name())
		}
	}
	return out
}

// labMounts are mount points under dir, deepest first.
func labMounts(dir string) []string {
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	var out []string
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && (f[4] == dir || strings.HasPrefix(f[4], dir+"/")) {
			out = append(out, f[4])
		}
	}
	slices.SortFunc(out, func(a, b string) int { return len(b) - len(a) })
	return slices.Compact(out)
}
