// Package labvm boots a baked node image as a machine of a lab (test/lab), the way a cloud boots an instance
// of it: QEMU with OVMF (TCG: this host has no KVM) and a swtpm whose EK certificate the lab's EK CA issued,
// the image's disk behind a copy-on-write overlay that stays the instance's across reboots, a blank state
// disk, and a network card on the lab's bridge that gets its address, gateway and hostname by DHCP (dnsmasq),
// as an instance gets them from its network. The lab lists the machine in its metadata, so its agent attests
// to the lab's join service and joins as any of the lab's nodes does: nothing in the image knows it is a test.
package labvm

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/test/lab"
	"github.com/berthlabs/berth/test/measuredboot"
)

// tapPrefix names the machines' tap devices; a tap lives as long as its QEMU.
const tapPrefix = "bv-"

// stateDiskSize is the blank state disk's: the agent makes it a LUKS2 volume at the first boot.
const stateDiskSize = 256 << 20

// Machine is a baked image to boot as a node of a lab.
type Machine struct {
	// Name is the node's name, at most 12 bytes (its tap device is "bv-" and the name).
	Name string
	Role metadata.Role
	// Addr is the address the lab's DHCP gives the machine, on the lab's network.
	Addr netip.Addr
	// Image is the image's name in its manifest, which the join policy names.
	Image string
	// Disk is the raw disk image Packer wrote; the machine writes to an overlay of it and leaves it as it was.
	Disk string
	// Dir receives the overlay, the TPM and state disk, the console and the logs.
	Dir string
	// Memory is the machine's memory in MiB; CPUs its number of processors (QEMU runs one host thread each).
	Memory, CPUs int
	// SSHKey, if set, is root's SSH key into the image: Reboot and Diagnose log in with it.
	SSHKey string
}

// VM is a machine booted on a lab's bridge.
type VM struct {
	Machine
	lab  *lab.Lab
	mac  string
	dhcp *exec.Cmd
	// dhcpExited receives dnsmasq's exit.
	dhcpExited chan error

	mu      sync.Mutex
	stop    context.CancelFunc
	done    chan struct{}
	bootErr error
}

// Start lists the machine in the lab's metadata, makes its TPM (an EK certificate of the lab's EK CA) and
// blank state disk, serves its address by DHCP on the lab's bridge and powers it on. Close powers it off and
// stops the DHCP server.
func Start(l *lab.Lab, m Machine) (*VM, error) {
	if len(m.Name) > 15-len(tapPrefix) {
		return nil, fmt.Errorf("machine name %q: at most %d bytes, for its tap device", m.Name, 15-len(tapPrefix))
	}
	if !m.Addr.Is4() {
		return nil, fmt.Errorf("machine %s: address %s is not IPv4", m.Name, m.Addr)
	}
	for _, tool := range []string{"dnsmasq", "ip"} {
		if _, err := exec.LookPath(tool); err != nil {
			return nil, fmt.Errorf("%s not found: run make deps (installs dnsmasq-base and iproute2)", tool)
		}
	}
	if err := os.MkdirAll(filepath.Join(m.Dir, "tpm"), 0o700); err != nil {
		return nil, err
	}
	if err := l.ListMachine(lab.Machine{Name: m.Name, Role: m.Role, Addr: m.Addr, Image: m.Image}); err != nil {
		return nil, err
	}
	if err := l.ManufactureTPM(filepath.Join(m.Dir, "tpm")); err != nil {
		return nil, fmt.Errorf("machine %s: TPM: %w", m.Name, err)
	}
	if err := lab.CreateSparse(statePath(m.Dir), stateDiskSize); err != nil {
		return nil, fmt.Errorf("machine %s: state disk: %w", m.Name, err)
	}
	a := m.Addr.As4()
	vm := &VM{Machine: m, lab: l, mac: fmt.Sprintf("52:54:00:fa:%02x:%02x", a[2], a[3])}
	if err := vm.serveDHCP(); err != nil {
		return nil, err
	}
	if err := vm.Boot(); err != nil {
		vm.Close()
		return nil, err
	}
	return vm, nil
}

func statePath(dir string) string { return filepath.Join(dir, "state.img") }

// ConsolePath is the file that receives the machine's serial console, over all its boots.
func (vm *VM) ConsolePath() string { return filepath.Join(vm.Dir, "console.log") }

// serveDHCP runs dnsmasq on the lab's bridge as DHCP server only, for this machine's MAC address alone.
func (vm *VM) serveDHCP() error {
	log, err := os.Create(filepath.Join(vm.Dir, "dnsmasq.out"))
	if err != nil {
		return err
	}
	defer log.Close()
	cmd := exec.Command("dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--port=0",
		"--user=root", "--interface="+lab.Bridge, "--bind-interfaces", "--except-interface=lo",
		"--dhcp-range="+netip.PrefixFrom(vm.Addr, 24).Masked().Addr().String()+",static",
		"--dhcp-host="+vm.mac+","+vm.Addr.String()+","+vm.Name,
		"--dhcp-option=option:router,"+lab.HostAddr.String(), "--dhcp-authoritative",
		"--dhcp-leasefile="+filepath.Join(vm.Dir, "dnsmasq.leases"), "--pid-file="+filepath.Join(vm.Dir, "dnsmasq.pid"),
		"--log-dhcp", "--log-facility="+filepath.Join(vm.Dir, "dnsmasq.log"))
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("dnsmasq: %w", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	// dnsmasq fails at once on a bad option or a port it cannot bind.
	select {
	case err := <-exited:
		out, _ := os.ReadFile(filepath.Join(vm.Dir, "dnsmasq.out"))
		return fmt.Errorf("dnsmasq exited: %v: %s", err, strings.TrimSpace(string(out)))
	case <-time.After(500 * time.Millisecond):
	}
	vm.dhcp, vm.dhcpExited = cmd, exited
	return nil
}

// Boot powers the machine on; it runs until it powers off or PowerOff.
func (vm *VM) Boot() error {
	vm.mu.Lock()
	defer vm.mu.Unlock()
	if vm.done != nil {
		select {
		case <-vm.done:
		default:
			return fmt.Errorf("machine %s is running", vm.Name)
		}
	}
	console, err := os.OpenFile(vm.ConsolePath(), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	vm.stop, vm.done, vm.bootErr = cancel, done, nil
	m := measuredboot.Machine{
		Disk: vm.Disk, Overlay: filepath.Join(vm.Dir, "root.qcow2"), Dir: filepath.Join(vm.Dir, "boot"),
		TPMState: filepath.Join(vm.Dir, "tpm"), Disks: []string{statePath(vm.Dir)}, Memory: vm.Memory, CPUs: vm.CPUs, Console: console,
		Tap: &measuredboot.Tap{Name: tapPrefix + vm.Name, Bridge: lab.Bridge, MAC: vm.mac},
	}
	go func() {
		defer close(done)
		defer console.Close()
		_, err := m.Boot(ctx)
		vm.mu.Lock()
		vm.bootErr = err
		vm.mu.Unlock()
	}()
	return nil
}

// Off says whether the machine is off, and why it stopped when that was not PowerOff.
func (vm *VM) Off() (bool, error) {
	vm.mu.Lock()
	defer vm.mu.Unlock()
	select {
	case <-vm.done:
		return true, vm.bootErr
	default:
		return false, nil
	}
}

// PowerOff cuts the machine's power, if it is on.
func (vm *VM) PowerOff() {
	vm.mu.Lock()
	stop, done := vm.stop, vm.done
	vm.mu.Unlock()
	if stop != nil {
		stop()
		<-done
	}
}

// Reboot reboots the machine from inside, as an operator's `systemctl reboot` does: its services stop and
// its disks are closed. QEMU exits at the reset (measuredboot boots with -no-reboot), and the machine boots
// again.
func (vm *VM) Reboot(ctx context.Context) error {
	if vm.SSHKey == "" {
		return errors.New("rebooting from inside needs the image's SSH key")
	}
	vm.mu.Lock()
	done := vm.done
	vm.mu.Unlock()
	// The connection may drop before ssh sees the command's status: the reset is what counts.
	vm.SSH(ctx, "systemctl reboot")
	select {
	case <-done:
	case <-time.After(3 * time.Minute):
		return fmt.Errorf("machine %s did not reset within 3 minutes of systemctl reboot", vm.Name)
	case <-ctx.Done():
		return ctx.Err()
	}
	return vm.Boot()
}

// SSH runs a command on the machine as root.
func (vm *VM) SSH(ctx context.Context, command string) (string, error) {
	if vm.SSHKey == "" {
		return "", errors.New("no SSH key into the image")
	}
	out, err := exec.CommandContext(ctx, "ssh", "-i", vm.SSHKey, "-o", "StrictHostKeyChecking=no",
		"-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "LogLevel=ERROR",
		"root@"+vm.Addr.String(), command).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("ssh %s %q: %w", vm.Name, command, err)
	}
	return string(out), nil
}

// WaitReady waits until the machine's Node is Ready after a boot other than the one whose boot ID is
// previous (empty: any), and returns its boot ID. It fails when the machine powers off, or when ctx ends
// first, with what the machine and the join service said.
func (vm *VM) WaitReady(ctx context.Context, previous string) (string, error) {
	var last string
	for {
		out, err := vm.lab.Kubectl(ctx, "get", "node", vm.Name, "-o",
			`jsonpath={.status.conditions[?(@.type=="Ready")].status} {.status.nodeInfo.bootID}`)
		if f := strings.Fields(out); err == nil && len(f) == 2 && f[0] == "True" && f[1] != previous {
			return f[1], nil
		}
		last = strings.TrimSpace(out)
		if err != nil {
			last = err.Error()
		}
		if off, err := vm.Off(); off {
			return "", fmt.Errorf("machine %s powered off (%v)\n%s", vm.Name, err, vm.Diagnose(context.Background()))
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("node %s not Ready: %v (last: %s)\n%s", vm.Name, ctx.Err(), last, vm.Diagnose(context.Background()))
		case <-time.After(2 * time.Second):
		}
	}
}

// Diagnose is what tells why a machine did not become a node: the end of its console, the lines the lab's
// join services logged about it, and, if the machine answers SSH, its agent's and kubelet's journal.
func (vm *VM) Diagnose(ctx context.Context) string {
	var b strings.Builder
	if data, err := os.ReadFile(vm.ConsolePath()); err == nil {
		fmt.Fprintf(&b, "--- %s: end of the console (%s) ---\n%s\n", vm.Name, vm.ConsolePath(), lastLines(string(data), 30))
	}
	for _, n := range vm.lab.Nodes {
		if n.Role != metadata.RoleControlPlane {
			continue
		}
		data, err := os.ReadFile(n.AgentLog())
		if err != nil {
			continue
		}
		var about []string
		for _, line := range strings.Split(string(data), "\n") {
			if strings.Contains(line, `"`+vm.Name+`"`) || strings.Contains(line, vm.Addr.String()+":") {
				about = append(about, line)
			}
		}
		fmt.Fprintf(&b, "--- %s's agent about %s ---\n%s\n", n.Name, vm.Name, lastLines(strings.Join(about, "\n"), 15))
	}
	if vm.SSHKey != "" {
		ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		out, err := vm.SSH(ctx, "journalctl --no-pager -o cat -n 60 -u berth-agent -u berth-images -u kubelet -u containerd")
		fmt.Fprintf(&b, "--- %s's journal (%v) ---\n%s\n", vm.Name, err, out)
	}
	return b.String()
}

// stageMessages are the agent's log messages that mark the stages of a boot.
var stageMessages = []string{"boot started", "instance metadata read", "state disk formatted", "state disk unlocked",
	"join ticket received", "rejoin ticket received", "state disk keyed", "node joined", "boot finished"}

// BootStages says when, in seconds since its kernel started, the machine's current boot reached each stage:
// the units that import its container images and start its kubelet (its last start), and its agent's steps.
// It reads the machine's journal over SSH.
func (vm *VM) BootStages(ctx context.Context) (string, error) {
	out, err := vm.SSH(ctx, "journalctl -b --no-pager -o short-monotonic -u berth-images -u berth-agent -u kubelet")
	if err != nil {
		return "", err
	}
	return bootStages(out), nil
}

// bootStages picks the stages out of a journal in journalctl's short-monotonic format, in the order of time.
func bootStages(journal string) string {
	type stage struct {
		at   float64
		what string
	}
	var stages []stage
	for _, line := range strings.Split(journal, "\n") {
		// "[   93.862125] vm-0 berth-agent[345]: {…}"
		at, rest, ok := strings.Cut(strings.TrimPrefix(line, "["), "]")
		if !ok {
			continue
		}
		ident, text, _ := strings.Cut(rest, ": ")
		var what string
		switch {
		case strings.HasSuffix(ident, "systemd[1]") && (strings.HasPrefix(text, "Started ") || strings.HasPrefix(text, "Finished ")):
			what = strings.TrimSuffix(text, ".")
		case strings.Contains(ident, " berth-agent["):
			for _, msg := range stageMessages {
				if strings.Contains(text, `"msg":"`+msg+`"`) {
					what = "agent: " + msg
				}
			}
		}
		if what == "" {
			continue
		}
		// The kubelet's unit starts again every few seconds until kubeadm has written its configuration: its
		// last start is the one that counts. Of everything else, the first.
		i := slices.IndexFunc(stages, func(s stage) bool { return s.what == what })
		switch {
		case i < 0:
			stages = append(stages, stage{parseSeconds(at), what})
		case strings.HasPrefix(what, "Started kubelet"):
			stages[i].at = parseSeconds(at)
		}
	}
	slices.SortStableFunc(stages, func(a, b stage) int { return cmp.Compare(a.at, b.at) })
	var out []string
	for _, s := range stages {
		out = append(out, fmt.Sprintf("%6.1fs %s", s.at, s.what))
	}
	return strings.Join(out, "\n")
}

func parseSeconds(s string) float64 {
	var f float64
	fmt.Sscan(strings.TrimSpace(s), &f)
	return f
}

// Close powers the machine off and stops its DHCP server.
func (vm *VM) Close() {
	vm.PowerOff()
	if vm.dhcp != nil {
		vm.dhcp.Process.Kill()
		<-vm.dhcpExited
	}
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// WaitOff waits until the machine powers off by itself (a kernel that panicked and rebooted: QEMU runs
// with -no-reboot), or ctx ends.
func (vm *VM) WaitOff(ctx context.Context) error {
	vm.mu.Lock()
	done := vm.done
	vm.mu.Unlock()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("machine %s still runs: %w", vm.Name, ctx.Err())
	}
}

// Tickets counts the join and rejoin tickets the lab's join services logged issuing to the machine.
func (vm *VM) Tickets() (int, error) {
	n := 0
	for _, node := range vm.lab.Nodes {
		if node.Role != metadata.RoleControlPlane {
			continue
		}
		data, err := os.ReadFile(node.AgentLog())
		if err != nil {
			return 0, err
		}
		for _, line := range strings.Split(string(data), "\n") {
			var entry struct {
				Msg      string `json:"msg"`
				PeerNode string `json:"peer_node"`
			}
			if json.Unmarshal([]byte(line), &entry) == nil && entry.PeerNode == vm.Name && strings.HasSuffix(entry.Msg, "ticket issued") {
				n++
			}
		}
	}
	return n, nil
}
