package clustersecrets

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"errors"
	"math/big"
	"strings"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/initsecret"
	"github.com/berthlabs/berth/internal/pki"
)

func root(b byte) []byte { return bytes.Repeat([]byte{b}, 32) }

// hkdfExpand is RFC 5869 written out from HMAC, to check the derivation independently of crypto/hkdf.
func hkdfExpand(t *testing.T, ikm []byte, info string, n int) []byte {
	t.Helper()
	prk := hmac.New(sha256.New, make([]byte, sha256.Size))
	prk.Write(ikm)
	key := prk.Sum(nil)
	var out, prev []byte
	for i := byte(1); len(out) < n; i++ {
		m := hmac.New(sha256.New, key)
		m.Write(prev)
		m.Write([]byte(info))
		m.Write([]byte{i})
		prev = m.Sum(nil)
		out = append(out, prev...)
	}
	return out[:n]
}

func TestDeriveIsStableAndSeparated(t *testing.T) {
	a, err := Derive(root(1))
	if err != nil {
		t.Fatal(err)
	}
	again, err := Derive(root(1))
	if err != nil {
		t.Fatal(err)
	}
	other, err := Derive(root(2))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a.MasterSecret, again.MasterSecret) || a.InitSecret != again.InitSecret ||
		!a.KubernetesCAKey.Equal(again.KubernetesCAKey) || !a.JoinCAKey.Equal(again.JoinCAKey) {
		t.Error("the same root key gave different secrets")
	}
	if bytes.Equal(a.MasterSecret, other.MasterSecret) || a.InitSecret == other.InitSecret || a.KubernetesCAKey.Equal(other.KubernetesCAKey) {
		t.Error("two root keys gave the same secrets")
	}
	if bytes.Equal(a.MasterSecret, a.Salt) || a.KubernetesCAKey.Equal(a.JoinCAKey) {
		t.Error("two purposes share a secret")
	}
	if want := hkdfExpand(t, root(1), "berth/v1/root/master-secret", 32); !bytes.Equal(a.MasterSecret, want) {
		t.Errorf("master secret %x, want HKDF-SHA256 %x", a.MasterSecret, want)
	}
	d := new(big.Int).SetBytes(hkdfExpand(t, root(1), "berth/v1/root/kubernetes-ca", 48))
	n := a.KubernetesCAKey.Curve.Params().N
	d.Mod(d, new(big.Int).Sub(n, big.NewInt(1))).Add(d, big.NewInt(1))
	raw, err := a.KubernetesCAKey.Bytes()
	if err != nil {
		t.Fatal(err)
	}
	if new(big.Int).SetBytes(raw).Cmp(d) != 0 {
		t.Error("the Kubernetes CA key is not the reduced HKDF output")
	}
}

// TestInitSecretHashIsStable: an import makes the hash again from the root key, and the first control-plane
// node's user-data, which carries the hash, must come out unchanged.
func TestInitSecretHashIsStable(t *testing.T) {
	hash := func(r []byte) string {
		t.Helper()
		s, err := Derive(r)
		if err != nil {
			t.Fatal(err)
		}
		h, err := s.InitSecretHash()
		if err != nil {
			t.Fatal(err)
		}
		if ok, err := initsecret.Verify(h, []byte(s.InitSecret)); !ok || err != nil {
			t.Fatalf("the hash %q does not verify the init secret: %v", h, err)
		}
		return h
	}
	first, again, other := hash(root(1)), hash(root(1)), hash(root(2))
	if first != again {
		t.Errorf("the same root key gave two hashes: %q, %q", first, again)
	}
	if first == other {
		t.Error("two root keys gave the same hash")
	}
	// The salt is not the init secret's own bytes, nor another derivation's.
	s, err := Derive(root(1))
	if err != nil {
		t.Fatal(err)
	}
	if want := hkdfExpand(t, root(1), "berth/v1/root/init-secret-hash-salt", initsecret.SaltSize); !bytes.Equal(s.InitSecretSalt, want) {
		t.Errorf("init secret salt %x, want HKDF-SHA256 %x", s.InitSecretSalt, want)
	}
}

func TestDeriveRefusesShortRoot(t *testing.T) {
	_, err := Derive(make([]byte, 31))
	if err == nil || !strings.Contains(err.Error(), "at least 32") {
		t.Fatalf("short root key: %v", err)
	}
}

func TestCAs(t *testing.T) {
	s, err := Derive(root(3))
	if err != nil {
		t.Fatal(err)
	}
	kube, join, err := s.NewCAs(time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	kubePin, joinPin, err := s.Pins()
	if err != nil {
		t.Fatal(err)
	}
	if kubePin != pki.SPKIPin(kube.Cert) || joinPin != pki.SPKIPin(join.Cert) {
		t.Error("pins differ from the certificates' pins")
	}
	if kube.Cert.Subject.CommonName != KubernetesCAName || join.Cert.Subject.CommonName != JoinCAName {
		t.Errorf("subjects %q %q", kube.Cert.Subject, join.Cert.Subject)
	}
	// A later run pairs the kept certificates with the keys it derives.
	later, err := Derive(root(3))
	if err != nil {
		t.Fatal(err)
	}
	k2, j2, err := later.CAs(kube.CertPEM(), join.CertPEM())
	if err != nil {
		t.Fatal(err)
	}
	leafKey, err := pki.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := k2.IssueClient(pki.ClientTemplate{CommonName: "x"}, leafKey.Public(), time.Now(), time.Minute)
	if err != nil || leaf.CheckSignatureFrom(kube.Cert) != nil || j2.Cert.SerialNumber.Cmp(join.Cert.SerialNumber) != 0 {
		t.Errorf("a CA paired from kept certificate and derived key does not sign as the original: %v", err)
	}
	wrong, err := Derive(root(4))
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := wrong.CAs(kube.CertPEM(), join.CertPEM()); !errors.Is(err, ErrWrongRootKey) {
		t.Errorf("certificates of another root key: %v, want ErrWrongRootKey", err)
	}
	if _, _, err := later.CAs([]byte("not pem"), join.CertPEM()); err == nil {
		t.Error("garbage certificate accepted")
	}
	// A join service beside an external control plane pairs the join CA alone.
	if j3, err := later.JoinCA(join.CertPEM()); err != nil || !j3.Cert.Equal(join.Cert) {
		t.Errorf("JoinCA: %v", err)
	}
	for name, certPEM := range map[string][]byte{"another root key's": nil, "the Kubernetes CA's": kube.CertPEM()} {
		s := later
		if certPEM == nil {
			s, certPEM = wrong, join.CertPEM()
		}
		if _, err := s.JoinCA(certPEM); !errors.Is(err, ErrWrongRootKey) {
			t.Errorf("JoinCA with %s certificate: %v, want ErrWrongRootKey", name, err)
		}
	}
}
