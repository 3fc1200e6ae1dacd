package attest_test

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"math/big"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/attest"
)

var t0 = time.Date(2030, 6, 1, 0, 0, 0, 0, time.UTC)

type testCA struct {
	cert *x509.Certificate
	key  crypto.Signer
}

// issue makes a certificate for pub, signed by parent (self-signed when parent is nil).
func issue(t testing.TB, parent *testCA, tmpl *x509.Certificate, pub crypto.PublicKey, key crypto.Signer) *x509.Certificate {
	t.Helper()
	signer, issuer := key, tmpl
	if parent != nil {
		signer, issuer = parent.key, parent.cert
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, issuer, pub, signer)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return cert
}

func newCA(t testing.TB, parent *testCA, name string, serial int64, from, until time.Time, edit func(*x509.Certificate)) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: name}, NotBefore: from, NotAfter: until,
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	if edit != nil {
		edit(tmpl)
	}
	return &testCA{cert: issue(t, parent, tmpl, key.Public(), key), key: key}
}

// ekCert is an EK certificate for ek issued by ca, valid around t0.
func ekCert(t testing.TB, ca *testCA, ek *rsa.PublicKey, serial int64) attest.EK {
	t.Helper()
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), NotBefore: t0.AddDate(0, 0, -1), NotAfter: t0.AddDate(1, 0, 0),
		KeyUsage: x509.KeyUsageKeyEncipherment}
	return attest.EK{Public: ek, Certificate: issue(t, ca, tmpl, ek, nil)}
}

func pools(roots []*testCA, inters []*testCA) (*x509.CertPool, *x509.CertPool) {
	r, i := x509.NewCertPool(), x509.NewCertPool()
	for _, c := range roots {
		r.AddCert(c.cert)
	}
	for _, c := range inters {
		i.AddCert(c.cert)
	}
	return r, i
}

// The intermediate a first certificate was verified through is remembered; what the full chain would refuse
// is still refused after that: a certificate of an impostor intermediate with the same name, one seen after
// the root or the intermediate expired, or before the intermediate was valid.
func TestCertChainRemembersOnlyWhatHolds(t *testing.T) {
	ekKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	ek := &ekKey.PublicKey
	root := newCA(t, nil, "EK root", 1, t0.AddDate(-1, 0, 0), t0.AddDate(0, 0, 2), nil)
	inter := newCA(t, root, "EK issuer", 2, t0.AddDate(0, 0, -1), t0.AddDate(0, 0, 5), nil)
	impostor := newCA(t, nil, "EK issuer", 3, t0.AddDate(-1, 0, 0), t0.AddDate(1, 0, 0), nil)
	roots, inters := pools([]*testCA{root}, []*testCA{inter})

	now := t0
	chain := attest.NewCertChain(roots, inters, func() time.Time { return now })
	for i := range 3 {
		if err := chain.TrustEK(context.Background(), ekCert(t, inter, ek, int64(10+i)), ""); err != nil {
			t.Fatalf("EK certificate %d of the configured intermediate: %v", i, err)
		}
	}
	refused := func(what string, e attest.EK) {
		t.Helper()
		if err := chain.TrustEK(context.Background(), e, ""); !errors.Is(err, attest.ErrUntrusted) {
			t.Errorf("%s: %v, want ErrUntrusted", what, err)
		}
	}
	refused("certificate of an impostor intermediate of the same name", ekCert(t, impostor, ek, 20))

	now = t0.AddDate(0, 0, 3)
	refused("certificate verified after the root expired", ekCert(t, inter, ek, 21))
	now = t0.AddDate(0, 0, 6)
	refused("certificate verified after the intermediate expired", ekCert(t, inter, ek, 22))
	now = t0.AddDate(0, 0, -2)
	refused("certificate verified before the intermediate was valid", ekCert(t, inter, ek, 23))
}

// An intermediate under a root that constrains names is not taken as an anchor: the root's constraints keep
// applying to every certificate the intermediate issues after the first.
func TestCertChainUnderConstrainedRoot(t *testing.T) {
	ekKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	root := newCA(t, nil, "constrained root", 1, t0.AddDate(-1, 0, 0), t0.AddDate(1, 0, 0), func(c *x509.Certificate) {
		c.PermittedDNSDomains = []string{"tpm.example"}
	})
	inter := newCA(t, root, "EK issuer", 2, t0.AddDate(-1, 0, 0), t0.AddDate(1, 0, 0), nil)
	roots, inters := pools([]*testCA{root}, []*testCA{inter})
	chain := attest.NewCertChain(roots, inters, func() time.Time { return t0 })
	if err := chain.TrustEK(context.Background(), ekCert(t, inter, &ekKey.PublicKey, 10), ""); err != nil {
		t.Fatalf("EK certificate within the constraints: %v", err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(11), NotBefore: t0.AddDate(0, 0, -1), NotAfter: t0.AddDate(1, 0, 0),
		DNSNames: []string{"tpm.elsewhere.example"}}
	outside := attest.EK{Public: &ekKey.PublicKey, Certificate: issue(t, inter, tmpl, &ekKey.PublicKey, nil)}
	if err := chain.TrustEK(context.Background(), outside, ""); !errors.Is(err, attest.ErrUntrusted) {
		t.Fatalf("EK certificate naming what the root does not permit: %v, want ErrUntrusted", err)
	}
}

// BenchmarkCertChain verifies EK certificates of one intermediate, as in a storm: "fresh" with a CertChain
// that has seen none before (the whole chain each time), "remembered" with one that has.
func BenchmarkCertChain(b *testing.B) {
	ekKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		b.Fatal(err)
	}
	rootKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		b.Fatal(err)
	}
	interKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		b.Fatal(err)
	}
	caTmpl := func(name string, serial int64) *x509.Certificate {
		return &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: name}, NotBefore: t0.AddDate(-1, 0, 0),
			NotAfter: t0.AddDate(1, 0, 0), IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	}
	root := &testCA{key: rootKey}
	root.cert = issue(b, nil, caTmpl("EK root", 1), &rootKey.PublicKey, rootKey)
	inter := &testCA{key: interKey, cert: issue(b, root, caTmpl("EK issuer", 2), &interKey.PublicKey, nil)}
	roots, inters := pools([]*testCA{root}, []*testCA{inter})
	ek := ekCert(b, inter, &ekKey.PublicKey, 10)
	now := func() time.Time { return t0 }

	b.Run("fresh", func(b *testing.B) {
		for b.Loop() {
			if err := attest.NewCertChain(roots, inters, now).TrustEK(context.Background(), ek, ""); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("remembered", func(b *testing.B) {
		chain := attest.NewCertChain(roots, inters, now)
		for b.Loop() {
			if err := chain.TrustEK(context.Background(), ek, ""); err != nil {
				b.Fatal(err)
			}
		}
	})
}
