package swtpm

import (
	"crypto/x509"
	"encoding/pem"
	"path/filepath"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/attest"
)

// TestManufactureAndServe makes a CA and a TPM, serves it, and checks that the EK certificate in the TPM's
// NV memory chains to the CA's root through its intermediate.
func TestManufactureAndServe(t *testing.T) {
	ca, err := NewCA(filepath.Join(t.TempDir(), "ca"))
	if err != nil {
		t.Fatal(err)
	}
	roots, inters, err := ca.Pools()
	if err != nil {
		t.Fatal(err)
	}
	bundle, err := ca.BundlePEM()
	if err != nil {
		t.Fatal(err)
	}
	if n := countCerts(bundle); n != 2 {
		t.Fatalf("bundle holds %d certificates, want root and intermediate", n)
	}
	state := t.TempDir()
	if err := ca.Manufacture(state); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "tpm.sock")
	cmd := Command(state, sock)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		cmd.Process.Kill()
		cmd.Wait()
	}()
	if err := WaitReady(sock, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	tpm, err := attest.OpenTPM("unix:" + sock)
	if err != nil {
		t.Fatal(err)
	}
	defer tpm.Close()
	eks, err := tpm.EKs()
	if err != nil || len(eks) == 0 || eks[0].Certificate == nil {
		t.Fatalf("EKs %v, %v", eks, err)
	}
	cert := eks[0].Certificate
	cert.UnhandledCriticalExtensions = nil // the TCG SAN of EK certificates; see internal/attest
	if _, err := cert.Verify(x509.VerifyOptions{Roots: roots, Intermediates: inters, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		t.Fatalf("EK certificate does not chain to the CA: %v", err)
	}
	if err := WaitReady(filepath.Join(t.TempDir(), "absent.sock"), 50*time.Millisecond); err == nil {
		t.Fatal("WaitReady succeeded on a socket nobody serves")
	}
}

func countCerts(data []byte) int {
	n := 0
	for {
		var b *pem.Block
		if b, data = pem.Decode(data); b == nil {
			return n
		}
		n++
	}
}
