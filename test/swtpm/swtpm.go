// Package swtpm manufactures and runs software TPMs whose endorsement-key certificates come from a CA of
// the caller's own (swtpm_localca), for labs and tests that need the same EK chain verification and
// credential activation as a cloud vTPM or a hardware TPM.
package swtpm

import (
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"time"
)

// CA is an EK CA directory kept by swtpm_localca: a root and an intermediate that signs EK certificates.
type CA struct {
	Dir       string
	setupConf string
	// swtpm_localca keeps a serial-number file; two manufactures at once would race on it.
	mu sync.Mutex
}

// Tools are the commands this package runs (Debian's swtpm and swtpm-tools).
var Tools = []string{"swtpm", "swtpm_setup", "swtpm_localca"}

// NewCA prepares dir as an EK CA and makes its keys by manufacturing a first, throwaway TPM, so that the
// root exists before any TPM the caller keeps.
func NewCA(dir string) (*CA, error) {
	for _, tool := range Tools {
		if _, err := exec.LookPath(tool); err != nil {
			return nil, fmt.Errorf("%s not found: run `make deps` (installs swtpm and swtpm-tools)", tool)
		}
	}
	localca, _ := exec.LookPath("swtpm_localca")
	files := map[string]string{
		"localca.conf":    fmt.Sprintf("statedir = %[1]s\nsigningkey = %[1]s/signkey.pem\nissuercert = %[1]s/issuercert.pem\ncertserial = %[1]s/certserial\n", dir),
		"localca.options": "--platform-manufacturer Berth\n--platform-version 1.0\n--platform-model lab\n",
		"setup.conf": fmt.Sprintf("create_certs_tool = %s\ncreate_certs_tool_config = %s/localca.conf\ncreate_certs_tool_options = %s/localca.options\nactive_pcr_banks = sha256\n",
			localca, dir, dir),
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600); err != nil {
			return nil, err
		}
	}
	ca := &CA{Dir: dir, setupConf: filepath.Join(dir, "setup.conf")}
	first, err := os.MkdirTemp(dir, "first-tpm-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(first)
	if err := ca.Manufacture(first); err != nil {
		return nil, err
	}
	return ca, nil
}

// OpenCA reopens a CA that NewCA prepared in dir, as another process does that manufactures TPMs with it;
// swtpm_localca locks its serial-number file itself, so processes may manufacture at the same time.
func OpenCA(dir string) (*CA, error) {
	for _, name := range []string{"setup.conf", "localca.conf", "localca.options", "signkey.pem", "issuercert.pem", "swtpm-localca-rootca-cert.pem"} {
		if _, err := os.Stat(filepath.Join(dir, name)); err != nil {
			return nil, fmt.Errorf("opening EK CA %s: %w", dir, err)
		}
	}
	return &CA{Dir: dir, setupConf: filepath.Join(dir, "setup.conf")}, nil
}

// Manufacture makes a TPM 2.0 state in the existing directory state, with RSA and ECC EK certificates
// signed by the CA.
func (ca *CA) Manufacture(state string) error {
	ca.mu.Lock()
	defer ca.mu.Unlock()
	out, err := exec.Command("swtpm_setup", "--tpm2", "--tpmstate", state, "--create-ek-cert",
		"--create-platform-cert", "--lock-nvram", "--config", ca.setupConf).CombinedOutput()
	if err != nil {
		return fmt.Errorf("swtpm_setup: %w\n%s", err, out)
	}
	return nil
}

// ManufactureWithoutCertificates makes a TPM 2.0 state in the existing directory state with an RSA EK but
// no EK certificate, as AWS's NitroTPM has: its EK is vouched for by the cloud's API instead.
func ManufactureWithoutCertificates(state string) error {
	out, err := exec.Command("swtpm_setup", "--tpm2", "--tpmstate", state, "--createek", "--lock-nvram").CombinedOutput()
	if err != nil {
		return fmt.Errorf("swtpm_setup: %w\n%s", err, out)
	}
	return nil
}

// RootPEM and IntermediatePEM are the CA's certificates; BundlePEM is both, as operators configure them.
func (ca *CA) RootPEM() ([]byte, error) {
	return os.ReadFile(filepath.Join(ca.Dir, "swtpm-localca-rootca-cert.pem"))
}

// IntermediatePEM is the certificate of the CA that signs EK certificates.
func (ca *CA) IntermediatePEM() ([]byte, error) {
	return os.ReadFile(filepath.Join(ca.Dir, "issuercert.pem"))
}

// BundlePEM is the root followed by the intermediate.
func (ca *CA) BundlePEM() ([]byte, error) {
	root, err := ca.RootPEM()
	if err != nil {
		return nil, err
	}
	inter, err := ca.IntermediatePEM()
	if err != nil {
		return nil, err
	}
	return append(root, inter...), nil
}

// Pools are the root and intermediate as certificate pools.
func (ca *CA) Pools() (roots, intermediates *x509.CertPool, err error) {
	root, err := ca.RootPEM()
	if err != nil {
		return nil, nil, err
	}
	inter, err := ca.IntermediatePEM()
	if err != nil {
		return nil, nil, err
	}
	roots, intermediates = x509.NewCertPool(), x509.NewCertPool()
	if !roots.AppendCertsFromPEM(root) || !intermediates.AppendCertsFromPEM(inter) {
		return nil, nil, errors.New("parsing the swtpm-localca certificates")
	}
	return roots, intermediates, nil
}

// Command is swtpm serving the TPM state in dir on the Unix socket sock (and its control channel beside
// it). The caller starts it, with whatever process attributes it needs, and waits with WaitReady.
func Command(dir, sock string) *exec.Cmd {
	return exec.Command("swtpm", "socket", "--tpm2",
		"--tpmstate", "dir="+dir,
		"--server", "type=unixio,path="+sock,
		"--ctrl", "type=unixio,path="+sock+".ctrl",
		"--flags", "not-need-init,startup-clear")
}

// WaitReady waits until swtpm accepts connections on sock.
func WaitReady(sock string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		c, err := net.Dial("unix", sock)
		if err == nil {
			return c.Close()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("swtpm did not listen on %s: %w", sock, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
