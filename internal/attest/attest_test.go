package attest_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"net"
	"slices"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/test/swtpm/swtpmtest"
)

func newProver(t *testing.T, ca *swtpmtest.CA) *attest.Prover {
	t.Helper()
	return proverOn(t, ca.NewTPM(t))
}

func proverOn(t *testing.T, device *swtpmtest.TPM) *attest.Prover {
	t.Helper()
	tpm, err := attest.OpenTPM(device.Device())
	if err != nil {
		t.Fatal(err)
	}
	p, err := attest.NewProver(tpm)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

func nonce(t *testing.T) []byte {
	n := make([]byte, attest.NonceSize)
	if _, err := rand.Read(n); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestAttestation(t *testing.T) {
	ca := swtpmtest.NewCA(t)
	alice, bob := newProver(t, ca), newProver(t, ca)
	v := attest.NewVerifier(attest.NewCertChain(ca.Roots(), ca.Intermediates(), nil))
	pcrs := []int{0, 4, 7, 9, 11}

	t.Run("accepted", func(t *testing.T) {
		n := nonce(t)
		ev, err := alice.Evidence(n, pcrs)
		if err != nil {
			t.Fatal(err)
		}
		pending, err := v.Verify(context.Background(), ev, n, "")
		if err != nil {
			t.Fatal(err)
		}
		secret, err := alice.Activate(pending.Challenge)
		if err != nil {
			t.Fatal(err)
		}
		res, err := pending.Complete(&berthv1.ActivationProof{Secret: secret})
		if err != nil {
			t.Fatal(err)
		}
		if res.EKFingerprint != alice.EKFingerprint() || res.EKFingerprint == bob.EKFingerprint() {
			t.Errorf("fingerprint %s, want alice's %s", res.EKFingerprint, alice.EKFingerprint())
		}
		if len(res.PCRs) != len(pcrs) || !bytes.Equal(res.PCRs[4], ev.Pcrs[4]) {
			t.Errorf("PCRs %x, evidence %x", res.PCRs, ev.Pcrs)
		}
	})

	refusals := []struct {
		name   string
		want   error
		tamper func(t *testing.T, ev *berthv1.Evidence) (verifyNonce []byte)
		// complete, if set, answers the challenge instead of alice.
		complete func(t *testing.T, c *berthv1.ActivationChallenge) []byte
	}{
		{name: "nonce of another connection", want: attest.ErrUntrusted,
			tamper: func(t *testing.T, ev *berthv1.Evidence) []byte { return nonce(t) }},
		{name: "PCR value changed after quoting", want: attest.ErrUntrusted,
			tamper: func(t *testing.T, ev *berthv1.Evidence) []byte {
				ev.Pcrs[9] = bytes.Repeat([]byte{0xaa}, 32)
				return nil
			}},
		{name: "PCR dropped from the evidence", want: attest.ErrUntrusted,
			tamper: func(t *testing.T, ev *berthv1.Evidence) []byte {
				delete(ev.Pcrs, 9)
				return nil
			}},
		{name: "PCR with a short digest", want: attest.ErrMalformed,
			tamper: func(t *testing.T, ev *berthv1.Evidence) []byte {
				ev.Pcrs[4] = ev.Pcrs[4][:20]
				return nil
			}},
		{name: "EK certificate of another TPM", want: attest.ErrUntrusted,
			tamper: func(t *testing.T, ev *berthv1.Evidence) []byte {
				other, err := bob.Evidence(nonce(t), pcrs)
				if err != nil {
					t.Fatal(err)
				}
				ev.EkCertificate = other.EkCertificate
				return nil
			},
			complete: func(t *testing.T, c *berthv1.ActivationChallenge) []byte {
				// Neither TPM can answer: bob has the EK, alice the AK.
				if s, err := bob.Activate(c); err == nil {
					return s
				}
				if s, err := alice.Activate(c); err == nil {
					return s
				}
				return []byte("guess")
			}},
		{name: "no evidence parts", want: attest.ErrMalformed,
			tamper: func(t *testing.T, ev *berthv1.Evidence) []byte {
				ev.AkCreateAttestation = nil
				return nil
			}},
	}
	for _, tc := range refusals {
		t.Run(tc.name, func(t *testing.T) {
			n := nonce(t)
			ev, err := alice.Evidence(n, pcrs)
			if err != nil {
				t.Fatal(err)
			}
			ev = proto.Clone(ev).(*berthv1.Evidence)
			verifyNonce := n
			if other := tc.tamper(t, ev); other != nil {
				verifyNonce = other
			}
			pending, err := v.Verify(context.Background(), ev, verifyNonce, "")
			if err == nil {
				answer := tc.complete
				if answer == nil {
					t.Fatal("tampered evidence verified")
				}
				_, err = pending.Complete(&berthv1.ActivationProof{Secret: answer(t, pending.Challenge)})
			}
			if !errors.Is(err, tc.want) {
				t.Fatalf("error %v, want %v", err, tc.want)
			}
		})
	}

	t.Run("EK certificate from an unknown CA", func(t *testing.T) {
		other := swtpmtest.NewCA(t)
		stranger := newProver(t, other)
		n := nonce(t)
		ev, err := stranger.Evidence(n, pcrs)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := v.Verify(context.Background(), ev, n, ""); !errors.Is(err, attest.ErrUntrusted) {
			t.Fatalf("error %v, want ErrUntrusted", err)
		}
	})

	t.Run("EK certificate not yet valid", func(t *testing.T) {
		late := attest.NewVerifier(attest.NewCertChain(ca.Roots(), ca.Intermediates(), func() time.Time { return time.Now().AddDate(-1, 0, 0) }))
		n := nonce(t)
		ev, err := alice.Evidence(n, pcrs)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := late.Verify(context.Background(), ev, n, ""); !errors.Is(err, attest.ErrUntrusted) {
			t.Fatalf("error %v, want ErrUntrusted", err)
		}
	})
}

func TestParseCABundle(t *testing.T) {
	ca := swtpmtest.NewCA(t)
	p := newProver(t, ca)
	roots, inters, err := attest.ParseCABundle(ca.BundlePEM())
	if err != nil {
		t.Fatal(err)
	}
	n := nonce(t)
	ev, err := p.Evidence(n, []int{7})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := attest.NewVerifier(attest.NewCertChain(roots, inters, nil)).Verify(context.Background(), ev, n, ""); err != nil {
		t.Fatalf("bundle split into roots and intermediates does not verify: %v", err)
	}
	if _, _, err := attest.ParseCABundle([]byte("not pem")); err == nil {
		t.Fatal("empty bundle accepted")
	}
}

func TestPCRIndexes(t *testing.T) {
	if got, err := attest.PCRIndexes([]uint32{11, 0, 23}); err != nil || !slices.Equal(got, []int{11, 0, 23}) {
		t.Errorf("PCRIndexes = %v, %v", got, err)
	}
	many := make([]uint32, 25)
	for i := range many {
		many[i] = uint32(i % 24)
	}
	for _, bad := range [][]uint32{nil, {24}, {7, 7}, many} {
		if got, err := attest.PCRIndexes(bad); err == nil {
			t.Errorf("PCRIndexes(%v) = %v, want an error", bad, got)
		}
	}
}

// A process killed while it held TPM objects leaves them loaded in a TPM without a resource manager (swtpm on
// a socket); swtpm has room for three. The next OpenTPM flushes them, or no attestation key would load.
func TestOpenTPMFlushesLeftovers(t *testing.T) {
	tpm := swtpmtest.NewCA(t).NewTPM(t)
	conn, err := net.Dial("unix", tpm.Socket)
	if err != nil {
		t.Fatal(err)
	}
	raw := transport.FromReadWriter(conn)
	for range 3 {
		if _, err := (tpm2.CreatePrimary{PrimaryHandle: tpm2.TPMRHOwner, InPublic: tpm2.New2B(tpm2.ECCSRKTemplate)}).Execute(raw); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := (tpm2.CreatePrimary{PrimaryHandle: tpm2.TPMRHOwner, InPublic: tpm2.New2B(tpm2.ECCSRKTemplate)}).Execute(raw); err == nil {
		t.Fatal("swtpm loaded a fourth object: this test no longer fills it")
	}
	conn.Close()

	opened, err := attest.OpenTPM(tpm.Device())
	if err != nil {
		t.Fatal(err)
	}
	p, err := attest.NewProver(opened)
	if err != nil {
		t.Fatalf("NewProver after a killed process's objects: %v", err)
	}
	defer p.Close()
}
