package doctor

import (
	"bytes"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// node writes a machine's files under a temporary root: a node as the image makes it, which tests then
// break one way at a time.
func node(t *testing.T) Machine {
	t.Helper()
	root := t.TempDir()
	files := map[string]string{
		"dev/tpmrm0":                                  "",
		"sys/class/tpm/tpm0/pcr-sha256/4":             "AA04\n",
		"sys/class/tpm/tpm0/pcr-sha256/9":             "aa09\n",
		"sys/class/tpm/tpm0/pcr-sha256/11":            "aa11\n",
		"sys/class/tpm/tpm0/pcr-sha256/12":            "aa12\n",
		"proc/cmdline":                                "root=PARTUUID=x ro console=ttyS0\n",
		"sys/module/overlay/refcnt":                   "0\n",
		"sys/module/br_netfilter/refcnt":              "0\n",
		"proc/sys/net/ipv4/ip_forward":                "1\n",
		"proc/sys/net/bridge/bridge-nf-call-iptables": "1\n",
		"proc/swaps":                                  "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n",
		"usr/bin/kubelet":                             "kubelet",
	}
	for name, data := range files {
		p := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(data), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// A real socket: doctor tells it from a file of that name.
	sock := filepath.Join(root, "run/containerd/containerd.sock")
	if err := os.MkdirAll(filepath.Dir(sock), 0o755); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return Machine{Root: root, TPM: "/dev/tpmrm0", LookPath: func(name string) (string, error) { return "/usr/bin/" + name, nil }}
}

var predicted = map[string]string{"4": "aa04", "9": "aa09", "11": "aa11", "12": "aa12"}

func failed(checks []Check) map[string]string {
	out := map[string]string{}
	for _, c := range checks {
		if !c.OK {
			out[c.Name] = c.Detail
		}
	}
	return out
}

func TestHealthyNode(t *testing.T) {
	checks := node(t).Run(predicted)
	if f := failed(checks); len(f) != 0 {
		t.Fatalf("a healthy node fails %v", f)
	}
	var out bytes.Buffer
	if !Print(&out, checks) {
		t.Error("Print says a check failed")
	}
	for _, want := range []string{"pcr 4", "aa04, as the manifest predicts", "root=PARTUUID=x ro console=ttyS0", "swap", "off"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the report lacks %q:\n%s", want, out.String())
		}
	}
}

func TestEachFailureIsNamed(t *testing.T) {
	for _, tc := range []struct {
		name    string
		breakIt func(t *testing.T, m *Machine)
		check   string
		says    string
	}{
		{"no TPM", func(t *testing.T, m *Machine) { remove(t, m, "dev/tpmrm0") }, "tpm", "the instance has no TPM"},
		{"another boot", func(t *testing.T, m *Machine) { write(t, m, "sys/class/tpm/tpm0/pcr-sha256/4", "bb04\n") }, "pcr 4", "the manifest predicts aa04"},
		{"no containerd", func(t *testing.T, m *Machine) {
			remove(t, m, "run/containerd/containerd.sock")
			write(t, m, "run/containerd/containerd.sock", "")
		}, "containerd", "is containerd running"},
		{"no br_netfilter", func(t *testing.T, m *Machine) { remove(t, m, "sys/module/br_netfilter") }, "module br_netfilter", "not loaded"},
		{"no forwarding", func(t *testing.T, m *Machine) { write(t, m, "proc/sys/net/ipv4/ip_forward", "0\n") }, "net.ipv4.ip_forward", "is 0, want 1"},
		{"swap", func(t *testing.T, m *Machine) {
			write(t, m, "proc/swaps", "Filename\tType\tSize\tUsed\tPriority\n/swapfile\tfile\t1024\t0\t-2\n")
		}, "swap", "/swapfile"},
		{"no kubeadm", func(t *testing.T, m *Machine) {
			m.LookPath = func(string) (string, error) { return "", errors.New("not found") }
		}, "kubeadm", "not on the PATH"},
		{"kubelet not executable", func(t *testing.T, m *Machine) {
			if err := os.Chmod(filepath.Join(m.Root, "usr/bin/kubelet"), 0o644); err != nil {
				t.Fatal(err)
			}
		}, "kubelet", "no executable"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := node(t)
			tc.breakIt(t, &m)
			checks := m.Run(predicted)
			f := failed(checks)
			if len(f) != 1 || !strings.Contains(f[tc.check], tc.says) {
				t.Errorf("failed checks %v, want only %s saying %q", f, tc.check, tc.says)
			}
			if Print(&bytes.Buffer{}, checks) {
				t.Error("Print says every check passed")
			}
		})
	}
}

// TestWithoutManifest: the PCRs are shown, not judged; a software TPM is not looked for as a device.
func TestWithoutManifest(t *testing.T) {
	m := node(t)
	m.TPM = "unix:/run/swtpm.sock"
	remove(t, &m, "dev/tpmrm0")
	checks := m.Run(nil)
	if f := failed(checks); len(f) != 0 {
		t.Fatalf("failed %v", f)
	}
	if checks[1].Name != "pcr 4" || checks[1].Detail != "aa04 (no manifest to compare with)" {
		t.Errorf("pcr 4 check %+v", checks[1])
	}
}

func remove(t *testing.T, m *Machine, name string) {
	t.Helper()
	if err := os.RemoveAll(filepath.Join(m.Root, name)); err != nil {
		t.Fatal(err)
	}
}

func write(t *testing.T, m *Machine, name, data string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(m.Root, name), []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}
