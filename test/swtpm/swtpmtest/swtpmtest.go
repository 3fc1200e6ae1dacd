// Package swtpmtest starts real software TPMs (swtpm) for tests, each manufactured with an endorsement key
// certificate signed by a CA of the test's own, so that tests exercise the same EK chain verification and
// credential activation that a cloud vTPM or a hardware TPM goes through.
package swtpmtest

import (
	"crypto/rsa"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"

	"github.com/berthlabs/berth/internal/repotest"
	"github.com/berthlabs/berth/test/swtpm"
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
	repotest.NeedsTools(t, swtpm.Tools...)
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
	repotest.NeedsTools(t, swtpm.Tools...)
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

// ekCertIndex is the NV index of the RSA EK certificate (TCG EK Credential Profile), where TPM vendors and
// Compute Engine's vTPMs keep it and where go-attestation, and so berth-agent, reads it.
const ekCertIndex = tpm2.TPMHandle(0x01c00002)

// EKPublic is the TPM's RSA endorsement key: the key of the TCG's default EK template, the one
// go-attestation presents and activates credentials with. Call it while nothing else is connected: swtpm
// serves one connection at a time.
func (tpm *TPM) EKPublic(t testing.TB) *rsa.PublicKey {
	t.Helper()
	conn := tpm.connect(t)
	defer conn.Close()
	tr := transport.FromReadWriter(conn)
	rsp, err := tpm2.CreatePrimary{PrimaryHandle: tpm2.TPMRHEndorsement, InPublic: tpm2.New2B(tpm2.RSAEKTemplate)}.Execute(tr)
	if err != nil {
		t.Fatalf("creating the EK: %v", err)
	}
	defer tpm2.FlushContext{FlushHandle: rsp.ObjectHandle}.Execute(tr)
	pub, err := rsp.OutPublic.Contents()
	if err != nil {
		t.Fatalf("the EK's public area: %v", err)
	}
	params, err := pub.Parameters.RSADetail()
	if err != nil {
		t.Fatalf("the EK's parameters: %v", err)
	}
	modulus, err := pub.Unique.RSA()
	if err != nil {
		t.Fatalf("the EK's modulus: %v", err)
	}
	key, err := tpm2.RSAPub(params, modulus)
	if err != nil {
		t.Fatalf("the EK's public key: %v", err)
	}
	return key
}

// WriteEKCertificate stores der as the TPM's RSA EK certificate, as a TPM vendor or a cloud does at
// manufacture, so that a TPM made by NewTPMWithoutEKCertificate can carry a certificate of any CA's shape
// (a Compute Engine vTPM's, say: see shieldedvmtest). Call it while nothing else is connected: swtpm
// serves one connection at a time.
func (tpm *TPM) WriteEKCertificate(t testing.TB, der []byte) {
	t.Helper()
	conn := tpm.connect(t)
	defer conn.Close()
	if err := WriteEKCertificate(conn, der); err != nil {
		t.Fatal(err)
	}
}

// WriteEKCertificate stores der as the RSA EK certificate of the TPM at the other end of rw (a swtpm
// that has none, such as one manufactured by swtpm.ManufactureWithoutCertificates), for harnesses that
// run their own swtpm (the lab). The index is defined with platform authorization and readable with its
// own, as swtpm_setup defines its certificate indexes.
func WriteEKCertificate(rw io.ReadWriter, der []byte) error {
	tr := transport.FromReadWriter(rw)
	// swtpm runs with an empty platform authorization: no firmware took the platform hierarchy.
	platform := tpm2.AuthHandle{Handle: tpm2.TPMRHPlatform, Auth: tpm2.PasswordAuth(nil)}
	def := tpm2.NVDefineSpace{
		AuthHandle: platform,
		PublicInfo: tpm2.New2B(tpm2.TPMSNVPublic{
			NVIndex: ekCertIndex,
			NameAlg: tpm2.TPMAlgSHA256,
			Attributes: tpm2.TPMANV{PPWrite: true, PPRead: true, OwnerRead: true, AuthRead: true, NoDA: true,
				PlatformCreate: true, NT: tpm2.TPMNTOrdinary},
			DataSize: uint16(len(der)),
		}),
	}
	if _, err := def.Execute(tr); err != nil {
		return fmt.Errorf("defining the EK certificate index: %w", err)
	}
	public, err := def.PublicInfo.Contents()
	if err != nil {
		return err
	}
	name, err := tpm2.NVName(public)
	if err != nil {
		return err
	}
	// A certificate is larger than one NV_Write takes on most TPMs.
	chunk, err := nvBufferMax(tr)
	if err != nil {
		return err
	}
	for off := 0; off < len(der); off += chunk {
		end := min(off+chunk, len(der))
		write := tpm2.NVWrite{AuthHandle: platform, NVIndex: tpm2.NamedHandle{Handle: ekCertIndex, Name: *name},
			Data: tpm2.TPM2BMaxNVBuffer{Buffer: der[off:end]}, Offset: uint16(off)}
		if _, err := write.Execute(tr); err != nil {
			return fmt.Errorf("writing the EK certificate at offset %d: %w", off, err)
		}
	}
	return nil
}

// nvBufferMax is the most bytes one NV_Write takes.
func nvBufferMax(tr transport.TPM) (int, error) {
	rsp, err := tpm2.GetCapability{Capability: tpm2.TPMCapTPMProperties, Property: uint32(tpm2.TPMPTNVBufferMax),
		PropertyCount: 1}.Execute(tr)
	if err != nil {
		return 0, fmt.Errorf("reading TPM_PT_NV_BUFFER_MAX: %w", err)
	}
	props, err := rsp.CapabilityData.Data.TPMProperties()
	if err != nil || len(props.TPMProperty) == 0 || props.TPMProperty[0].Property != tpm2.TPMPTNVBufferMax {
		return 0, fmt.Errorf("the TPM did not report TPM_PT_NV_BUFFER_MAX (%v)", err)
	}
	return int(props.TPMProperty[0].Value), nil
}

func (tpm *TPM) connect(t testing.TB) net.Conn {
	t.Helper()
	conn, err := net.Dial("unix", tpm.Socket)
	if err != nil {
		t.Fatalf("connecting to swtpm: %v", err)
	}
	return conn
}
