// Package doctor checks what a node needs from the machine that boots its image: the TPM, the measurements
// of the boot, and the container runtime and kernel settings kubeadm expects. It reports what it read, for
// an operator looking at the first instance of an image on a cloud this repository's tests never reached.
package doctor

import (
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// Check is one thing doctor looked at.
type Check struct {
	Name   string `json:"name"`
	OK     bool   `json:"ok"`
	Detail string `json:"detail"`
}

// PCRs are the PCRs a Berth manifest predicts, which doctor reads.
var PCRs = []string{"4", "9", "11", "12"}

// Machine is where doctor looks.
type Machine struct {
	// Root is the file system /proc, /sys, /dev, /run and /usr are read under: "/" on a node.
	Root string
	// TPM is the agent's TPM: a device path, or a software TPM's "unix:" or "tcp:" address.
	TPM string
	// LookPath finds a command, as exec.LookPath does.
	LookPath func(string) (string, error)
}

// Run runs every check. want maps a PCR index to the value the image's manifest predicts; nil when no
// manifest was given, and the values are then only shown.
func (m Machine) Run(want map[string]string) []Check {
	var checks []Check
	add := func(name string, ok bool, format string, args ...any) {
		checks = append(checks, Check{Name: name, OK: ok, Detail: fmt.Sprintf(format, args...)})
	}

	switch {
	case strings.HasPrefix(m.TPM, "unix:") || strings.HasPrefix(m.TPM, "tcp:"):
		add("tpm", true, "a software TPM at %s: not a device, not checked", m.TPM)
	case m.exists(m.TPM):
		add("tpm", true, "%s is present", m.TPM)
	default:
		add("tpm", false, "%s is missing: the instance has no TPM (enable the vTPM or NitroTPM), or the kernel lacks its driver", m.TPM)
	}
	for _, pcr := range PCRs {
		name := "pcr " + pcr
		got, err := m.read("/sys/class/tpm/tpm0/pcr-sha256/" + pcr)
		got = strings.ToLower(got)
		switch {
		case err != nil:
			add(name, false, "unreadable: %v", err)
		case want == nil:
			add(name, true, "%s (no manifest to compare with)", got)
		case want[pcr] == "":
			add(name, true, "%s (the manifest predicts nothing for it)", got)
		case got == want[pcr]:
			add(name, true, "%s, as the manifest predicts", got)
		default:
			add(name, false, "%s, but the manifest predicts %s: the join service refuses this boot", got, want[pcr])
		}
	}
	if cmdline, err := m.read("/proc/cmdline"); err != nil {
		add("cmdline", false, "unreadable: %v", err)
	} else {
		add("cmdline", true, "%s", cmdline)
	}

	const socket = "/run/containerd/containerd.sock"
	if fi, err := os.Stat(m.path(socket)); err == nil && fi.Mode().Type() == fs.ModeSocket {
		add("containerd", true, "%s is listening", socket)
	} else {
		add("containerd", false, "no socket at %s: is containerd running? (journalctl -u containerd)", socket)
	}
	for _, module := range []string{"overlay", "br_netfilter"} {
		if m.exists("/sys/module/" + module) {
			add("module "+module, true, "loaded")
		} else {
			add("module "+module, false, "not loaded (systemctl status systemd-modules-load)")
		}
	}
	for _, sysctl := range []string{"net.ipv4.ip_forward", "net.bridge.bridge-nf-call-iptables"} {
		v, err := m.read("/proc/sys/" + strings.ReplaceAll(sysctl, ".", "/"))
		switch {
		case err != nil:
			add(sysctl, false, "unreadable: %v", err)
		case v != "1":
			add(sysctl, false, "is %s, want 1 (systemctl status systemd-sysctl)", v)
		default:
			add(sysctl, true, "1")
		}
	}
	if swaps, err := m.read("/proc/swaps"); err != nil {
		add("swap", false, "unreadable: %v", err)
	} else if lines := strings.Split(swaps, "\n")[1:]; len(lines) > 0 {
		add("swap", false, "on (%s): the kubelet will not start", strings.Join(lines, "; "))
	} else {
		add("swap", true, "off")
	}
	if p, err := m.LookPath("kubeadm"); err != nil {
		add("kubeadm", false, "not on the PATH")
	} else {
		add("kubeadm", true, "%s", p)
	}
	const kubelet = "/usr/bin/kubelet"
	if fi, err := os.Stat(m.path(kubelet)); err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0 {
		add("kubelet", true, "%s", kubelet)
	} else {
		add("kubelet", false, "no executable at %s, where the kubelet's unit runs it", kubelet)
	}
	return checks
}

func (m Machine) path(p string) string { return filepath.Join(m.Root, p) }

func (m Machine) exists(p string) bool {
	_, err := os.Stat(m.path(p))
	return err == nil
}

// read returns a small file of /proc or /sys without its trailing newline.
func (m Machine) read(p string) (string, error) {
	data, err := os.ReadFile(m.path(p))
	return strings.TrimRight(string(data), "\n"), err
}

// Print writes the checks for people and says whether all passed.
func Print(w io.Writer, checks []Check) bool {
	var b strings.Builder
	ok := true
	for _, c := range checks {
		word := "ok  "
		if !c.OK {
			word, ok = "FAIL", false
		}
		fmt.Fprintf(&b, "%s  %-36s %s\n", word, c.Name, c.Detail)
	}
	io.WriteString(w, b.String())
	return ok
}
