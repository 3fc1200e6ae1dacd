package attest_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"errors"
	"fmt"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/test/swtpm/swtpmtest"
)

// cloudEKs answers as a cloud's API does: the EK public key of each instance's TPM.
type cloudEKs map[string]*rsa.PublicKey

func (c cloudEKs) EKPublic(_ context.Context, id string) (*rsa.PublicKey, error) {
	if k, ok := c[id]; ok {
		return k, nil
	}
	return nil, fmt.Errorf("instance %s not found", id)
}

func ekPublic(t *testing.T, p *attest.Prover) *rsa.PublicKey {
	t.Helper()
	ev, err := p.Evidence(nonce(t), []int{7})
	if err != nil {
		t.Fatal(err)
	}
	der := ev.EkPublic
	if der == nil {
		c, err := x509.ParseCertificate(ev.EkCertificate)
		if err != nil {
			t.Fatal(err)
		}
		der = c.RawSubjectPublicKeyInfo
	}
	pub, err := x509.ParsePKIXPublicKey(der)
	if err != nil {
		t.Fatal(err)
	}
	return pub.(*rsa.PublicKey)
}

// TestCloudEK: a TPM without an EK certificate (AWS's NitroTPM) attests with its EK public key, trusted only
// when the cloud reports that key for the instance the node is.
func TestCloudEK(t *testing.T) {
	ca := swtpmtest.NewCA(t)
	nitro, other, certified := proverOn(t, swtpmtest.NewTPMWithoutEKCertificate(t)), proverOn(t, swtpmtest.NewTPMWithoutEKCertificate(t)), newProver(t, ca)
	cloud := cloudEKs{"i-nitro": ekPublic(t, nitro), "i-other": ekPublic(t, other), "i-certified": ekPublic(t, certified)}
	v := attest.NewVerifier(attest.CloudEK{Cloud: "EC2", Source: cloud})
	pcrs := []int{0, 7}

	attestAs := func(t *testing.T, p *attest.Prover, instance string, tamper func(ev *berthv1.Evidence)) (*attest.Result, error) {
		t.Helper()
		n := nonce(t)
		ev, err := p.Evidence(n, pcrs)
		if err != nil {
			t.Fatal(err)
		}
		ev = proto.Clone(ev).(*berthv1.Evidence)
		if tamper != nil {
			tamper(ev)
		}
		pending, err := v.Verify(context.Background(), ev, n, instance)
		if err != nil {
			return nil, err
		}
		secret, err := p.Activate(pending.Challenge)
		if err != nil {
			secret = []byte("cannot activate")
		}
		return pending.Complete(&berthv1.ActivationProof{Secret: secret})
	}

	t.Run("accepted", func(t *testing.T) {
		ev, err := nitro.Evidence(nonce(t), pcrs)
		if err != nil {
			t.Fatal(err)
		}
		if len(ev.EkCertificate) != 0 || len(ev.EkPublic) == 0 {
			t.Fatalf("evidence of a TPM without EK certificate: certificate %d bytes, public key %d bytes", len(ev.EkCertificate), len(ev.EkPublic))
		}
		res, err := attestAs(t, nitro, "i-nitro", nil)
		if err != nil {
			t.Fatal(err)
		}
		if res.EKFingerprint != nitro.EKFingerprint() || res.EK.Certificate != nil {
			t.Errorf("result EK %s (certificate %v), want %s without certificate", res.EKFingerprint, res.EK.Certificate != nil, nitro.EKFingerprint())
		}
	})
	t.Run("a certificate is not needed and not enough", func(t *testing.T) {
		if _, err := attestAs(t, certified, "i-certified", nil); err != nil {
			t.Fatalf("TPM with a certificate whose key the cloud reports: %v", err)
		}
		_, err := attestAs(t, certified, "i-nitro", nil)
		if !errors.Is(err, attest.ErrUntrusted) {
			t.Fatalf("TPM with a valid certificate but not the instance's: %v, want ErrUntrusted", err)
		}
	})

	refusals := []struct {
		name     string
		instance string
		tamper   func(ev *berthv1.Evidence)
		want     error
		says     string
	}{
		{name: "another instance's TPM", instance: "i-other", want: attest.ErrUntrusted, says: "not the one EC2 reports for instance i-other"},
		{name: "instance the cloud does not know", instance: "i-gone", says: "asking EC2 for the EK of instance i-gone"},
		{name: "no instance id", instance: "", want: attest.ErrUntrusted, says: "no id"},
		{name: "the instance's EK claimed by a TPM that does not hold it", instance: "i-other", want: attest.ErrUntrusted,
			tamper: func(ev *berthv1.Evidence) { ev.EkPublic, _ = x509.MarshalPKIXPublicKey(cloud["i-other"]) },
			says:   "credential activation failed"},
		{name: "both a certificate and a public key", instance: "i-nitro", want: attest.ErrMalformed,
			tamper: func(ev *berthv1.Evidence) { ev.EkCertificate = []byte{0x30} }, says: "both"},
		{name: "EK public key not RSA", instance: "i-nitro", want: attest.ErrMalformed,
			tamper: func(ev *berthv1.Evidence) {
				k, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
				ev.EkPublic, _ = x509.MarshalPKIXPublicKey(k.Public())
			}, says: "want RSA"},
		{name: "EK public key garbage", instance: "i-nitro", want: attest.ErrMalformed,
			tamper: func(ev *berthv1.Evidence) { ev.EkPublic = []byte("garbage") }, says: "EK public key"},
	}
	for _, tc := range refusals {
		t.Run(tc.name, func(t *testing.T) {
			_, err := attestAs(t, nitro, tc.instance, tc.tamper)
			if err == nil {
				t.Fatal("accepted")
			}
			if tc.want != nil && !errors.Is(err, tc.want) {
				t.Errorf("error %v, want %v", err, tc.want)
			}
			if !strings.Contains(err.Error(), tc.says) {
				t.Errorf("error %q does not say %q", err, tc.says)
			}
		})
	}

	t.Run("certificate chains refuse a TPM without certificate", func(t *testing.T) {
		chain := attest.NewVerifier(attest.NewCertChain(ca.Roots(), ca.Intermediates(), nil))
		n := nonce(t)
		ev, err := nitro.Evidence(n, pcrs)
		if err != nil {
			t.Fatal(err)
		}
		_, err = chain.Verify(context.Background(), ev, n, "i-nitro")
		if !errors.Is(err, attest.ErrUntrusted) || !strings.Contains(err.Error(), "no EK certificate") {
			t.Fatalf("error %v, want ErrUntrusted naming the missing certificate", err)
		}
	})
}
