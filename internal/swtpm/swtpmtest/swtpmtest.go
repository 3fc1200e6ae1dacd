// Package swtpmtest starts real software TPMs (swtpm) for tests, each manufactured with an endorsement key
// certificate signed by a CA of the test's own, so that tests exercise the same EK chain verification and
// credential activation that a cloud vTPM or a hardware TPM goes through.
package swtpmtest

import (
	"crypto/x509"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/swtpm"
)

// CA is a test endorsement-key CA.
type CA struct {
	ca            *swtpm.CA
	roots, inters *x509.CertPool
	bundle        []byte
}

// NewCA makes a CA in a temporary directory.
func NewCA(t testing.TB) *CA {
	t.Helper()
	ca, err := swtpm.NewCA(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	c := &CA{ca: ca}
	if c.roots, c.inters, err = ca.Pools(); err != nil {
		t.Fatal(err)
	}
	if c.bundle, err = ca.BundlePEM(); err != nil {
		t.Fatal(err)
	}
	return c
}

// Roots is the pool with the CA's root certificate.
func (ca *CA) Roots() *x509.CertPool { return ca.roots }

// Intermediates is the pool with the CA that signs EK certificates.
func (ca *CA) Intermediates() *x509.CertPool { return ca.inters }

// BundlePEM is the root followed by the intermediate, as an operator would configure them.
func (ca *CA) BundlePEM() []byte { return ca.bundle }

// Manufacture makes a TPM state in dir with EK certificates from the CA, for a swtpm that the caller runs
// itself (a QEMU guest's, say).
func (ca *CA) Manufacture(dir string) error { return ca.ca.Manufacture(dir) }

// TPM is a running swtpm reachable on a Unix socket.
type TPM struct {
	Socket string
}

// NewTPM manufactures a TPM (EK certificates signed by ca) and starts swtpm on it; it is stopped when the
// test ends.
func (ca *CA) NewTPM(t testing.TB) *TPM {
	t.Helper()
	return startTPM(t, ca.ca.Manufacture)
}

// NewTPMWithoutEKCertificate starts a TPM with an RSA EK and no EK certificate, like AWS's NitroTPM.
func NewTPMWithoutEKCertificate(t testing.TB) *TPM {
	t.Helper()
	return startTPM(t, swtpm.ManufactureWithoutCertificates)
}

func startTPM(t testing.TB, manufacture func(state string) error) *TPM {
	t.Helper()
	dir := t.TempDir()
	state := filepath.Join(dir, "state")
	if err := os.Mkdir(state, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := manufacture(state); err != nil {
		t.Fatal(err)
	}
	tpm := &TPM{Socket: filepath.Join(dir, "tpm.sock")}
	cmd := swtpm.Command(state, tpm.Socket)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting swtpm: %v", err)
	}
	stop := func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}
	if err := swtpm.WaitReady(tpm.Socket, 10*time.Second); err != nil {
		stop()
		t.Fatalf("%v\n%s", err, stderr.String())
	}
	t.Cleanup(stop)
	return tpm
}

// Device is the TPM's address in the form berth-agent's tpm setting takes.
func (tpm *TPM) Device() string { return "unix:" + tpm.Socket }
