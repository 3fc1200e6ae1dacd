package swtpmtest_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"testing"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/cloud/gcp/shieldedvm"
	"github.com/berthlabs/berth/internal/cloud/gcp/shieldedvm/shieldedvmtest"
	"github.com/berthlabs/berth/test/swtpm/swtpmtest"
)

// TestWriteEKCertificate gives a certificate-less swtpm a Compute Engine-shaped EK certificate for its own
// EK: the prover presents exactly that certificate, and the TPM activates a credential made for the
// certified key, so the whole attestation passes a Shielded VM trust of the same CA.
func TestWriteEKCertificate(t *testing.T) {
	tpm := swtpmtest.NewTPMWithoutEKCertificate(t)
	ca, err := shieldedvmtest.NewCA()
	if err != nil {
		t.Fatal(err)
	}
	cert, err := ca.IssueEK(tpm.EKPublic(t), shieldedvm.InstanceInfo{Zone: "europe-west1-b", ProjectNumber: 1,
		ProjectID: "berth-lab", InstanceID: 7, InstanceName: "cp-0"})
	if err != nil {
		t.Fatal(err)
	}
	tpm.WriteEKCertificate(t, cert.Raw)

	open, err := attest.OpenTPM(tpm.Device())
	if err != nil {
		t.Fatal(err)
	}
	prover, err := attest.NewProver(open)
	if err != nil {
		t.Fatal(err)
	}
	defer prover.Close()
	nonce := make([]byte, attest.NonceSize)
	if _, err := rand.Read(nonce); err != nil {
		t.Fatal(err)
	}
	ev, err := prover.Evidence(nonce, []int{11})
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(ev.EkCertificate, cert.Raw) {
		t.Fatalf("the prover presents an EK certificate of %d bytes, not the %d written", len(ev.EkCertificate), len(cert.Raw))
	}
	roots, inters := ca.Pools()
	v := attest.NewVerifier(shieldedvm.NewTrust(roots, inters, nil, nil))
	pending, err := v.Verify(context.Background(), ev, nonce, "projects/berth-lab/zones/europe-west1-b/instances/cp-0")
	if err != nil {
		t.Fatal(err)
	}
	secret, err := prover.Activate(pending.Challenge)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pending.Complete(&berthv1.ActivationProof{Secret: secret}); err != nil {
		t.Fatalf("credential activation for the certified EK: %v", err)
	}
}
