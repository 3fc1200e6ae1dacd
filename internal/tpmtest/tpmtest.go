// Package tpmtest starts real software TPMs (swtpm) for tests, each manufactured by swtpm_setup with an
// endorsement key certificate signed by a CA of the test's own, so that tests exercise the same EK chain
// verification and credential activation that a cloud vTPM or a hardware TPM goes through.
package tpmtest

import (
	"crypto/x509"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// CA is a test endorsement-key CA: swtpm_localca keeps its root and intermediate in Dir.
type CA struct {
	Dir       string
	setupConf string
	mu        sync.Mutex
	roots     *x509.CertPool
	inters    *x509.CertPool
	rootPEM   []byte
	interPEM  []byte
}

// NewCA prepares a CA directory; its keys are made by swtpm_localca when the first TPM is manufactured.
func NewCA(t testing.TB) *CA {
	t.Helper()
	for _, tool := range []string{"swtpm", "swtpm_setup", "swtpm_localca"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s not found: run `make deps` (installs swtpm and swtpm-tools)", tool)
		}
	}
	dir := t.TempDir()
	files := map[string]string{
		"localca.conf":    fmt.Sprintf("statedir = %[1]s\nsigningkey = %[1]s/signkey.pem\nissuercert = %[1]s/issuercert.pem\ncertserial = %[1]s/certserial\n", dir),
		"localca.options": "--platform-manufacturer Berth\n--platform-version 1.0\n--platform-model test\n",
		"setup.conf": fmt.Sprintf("create_certs_tool = %s\ncreate_certs_tool_config = %s/localca.conf\ncreate_certs_tool_options = %s/localca.options\nactive_pcr_banks = sha256\n",
			mustLookPath(t, "swtpm_localca"), dir, dir),
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	ca := &CA{Dir: dir, setupConf: filepath.Join(dir, "setup.conf")}
	// swtpm_localca makes the CA's keys while manufacturing the first TPM; doing that now lets callers
	// build verifiers before any TPM exists.
	ca.manufacture(t, t.TempDir())
	ca.load(t)
	return ca
}

func (ca *CA) manufacture(t testing.TB, state string) {
	t.Helper()
	// swtpm_localca keeps a serial-number file; two setups at once would race on it.
	ca.mu.Lock()
	defer ca.mu.Unlock()
	out, err := exec.Command("swtpm_setup", "--tpm2", "--tpmstate", state, "--create-ek-cert",
		"--create-platform-cert", "--lock-nvram", "--config", ca.setupConf).CombinedOutput()
	if err != nil {
		t.Fatalf("swtpm_setup: %v\n%s", err, out)
	}
}

func mustLookPath(t testing.TB, tool string) string {
	t.Helper()
	p, err := exec.LookPath(tool)
	if err != nil {
		t.Fatalf("%s not found: run `make deps`", tool)
	}
	return p
}

// Roots is the pool with the CA's root certificate.
func (ca *CA) Roots() *x509.CertPool { return ca.roots }

// Intermediates is the pool with the CA that signs EK certificates.
func (ca *CA) Intermediates() *x509.CertPool { return ca.inters }

// BundlePEM is the root followed by the intermediate, as an operator would configure them.
func (ca *CA) BundlePEM() []byte { return append(append([]byte{}, ca.rootPEM...), ca.interPEM...) }

func (ca *CA) load(t testing.TB) {
	t.Helper()
	root, err := os.ReadFile(filepath.Join(ca.Dir, "swtpm-localca-rootca-cert.pem"))
	if err != nil {
		t.Fatalf("reading EK root CA: %v", err)
	}
	inter, err := os.ReadFile(filepath.Join(ca.Dir, "issuercert.pem"))
	if err != nil {
		t.Fatalf("reading EK intermediate CA: %v", err)
	}
	ca.rootPEM, ca.interPEM = root, inter
	ca.roots, ca.inters = x509.NewCertPool(), x509.NewCertPool()
	if !ca.roots.AppendCertsFromPEM(root) || !ca.inters.AppendCertsFromPEM(inter) {
		t.Fatal("parsing swtpm-localca certificates")
	}
}

// TPM is a running swtpm reachable on a Unix socket.
type TPM struct {
	Socket string
	cmd    *exec.Cmd
}

// NewTPM manufactures a TPM (EK certificates signed by ca) and starts swtpm on it; it is stopped when the
// test ends.
func (ca *CA) NewTPM(t testing.TB) *TPM {
	t.Helper()
	dir := t.TempDir()
	state := filepath.Join(dir, "state")
	if err := os.Mkdir(state, 0o700); err != nil {
		t.Fatal(err)
	}
	ca.manufacture(t, state)
	tpm := &TPM{Socket: filepath.Join(dir, "tpm.sock")}
	tpm.cmd = exec.Command("swtpm", "socket", "--tpm2",
		"--tpmstate", "dir="+state,
		"--server", "type=unixio,path="+tpm.Socket,
		"--ctrl", "type=unixio,path="+filepath.Join(dir, "ctrl.sock"),
		"--flags", "not-need-init,startup-clear")
	var stderr strings.Builder
	tpm.cmd.Stderr = &stderr
	if err := tpm.cmd.Start(); err != nil {
		t.Fatalf("starting swtpm: %v", err)
	}
	t.Cleanup(func() {
		_ = tpm.cmd.Process.Kill()
		_ = tpm.cmd.Wait()
	})
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := net.Dial("unix", tpm.Socket)
		if err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("swtpm did not listen on %s: %v\n%s", tpm.Socket, err, stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	return tpm
}

// Device is the TPM's address in the form berth-agent's --tpm flag takes.
func (tpm *TPM) Device() string { return "unix:" + tpm.Socket }
