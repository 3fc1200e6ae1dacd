// Package clustersecrets derives all of a cluster's secrets from one root key that the operator keeps:
// the master secret and salt (roots of every node key), the init secret, and the private keys of the
// Kubernetes CA and the join CA.
//
// Nothing secret ever has to be stored by Berth, in Terraform state or anywhere else: the provider takes the
// root key as an ephemeral value, keeps only public results (CA certificates, pins, the init secret's hash),
// and derives the secrets again whenever a resource needs them. A CA certificate kept from an earlier run is
// paired with the key derived now, and the pair is refused if the key does not match, so a wrong root key
// is caught before it reaches a node.
package clustersecrets

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/hkdf"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"errors"
	"fmt"
	"math/big"
	"time"

	"github.com/berthlabs/berth/internal/initsecret"
	"github.com/berthlabs/berth/internal/pki"
)

// MinRootKeySize is the shortest root key accepted: 256 bits of entropy, like the master secret it yields.
const MinRootKeySize = 32

// infoPrefix keeps these derivations apart from those of package keys ("berth/v1/<label>"), whose labels are
// fixed names and disk/<uuid>.
const infoPrefix = "berth/v1/root/"

// Certificate subjects of the cluster's CAs.
const (
	KubernetesCAName = "kubernetes"
	JoinCAName       = "berth-join-ca"
)

// Secrets are what a root key yields.
type Secrets struct {
	MasterSecret []byte
	Salt         []byte
	InitSecret   string // base64url, as operators and the init server handle it
	// InitSecretSalt salts the init secret's hash, so that the same root key always gives the same hash.
	InitSecretSalt  []byte
	KubernetesCAKey *ecdsa.PrivateKey
	JoinCAKey       *ecdsa.PrivateKey
}

// Derive computes the secrets of root. The same root key always gives the same secrets.
func Derive(root []byte) (*Secrets, error) {
	if len(root) < MinRootKeySize {
		return nil, fmt.Errorf("root key is %d bytes, want at least %d random bytes", len(root), MinRootKeySize)
	}
	s := &Secrets{}
	var err error
	if s.MasterSecret, err = expand(root, "master-secret", 32); err != nil {
		return nil, err
	}
	if s.Salt, err = expand(root, "salt", 32); err != nil {
		return nil, err
	}
	init, err := expand(root, "init-secret", 32)
	if err != nil {
		return nil, err
	}
	s.InitSecret = base64.RawURLEncoding.EncodeToString(init)
	if s.InitSecretSalt, err = expand(root, "init-secret-hash-salt", initsecret.SaltSize); err != nil {
		return nil, err
	}
	if s.KubernetesCAKey, err = p256Key(root, "kubernetes-ca"); err != nil {
		return nil, err
	}
	if s.JoinCAKey, err = p256Key(root, "join-ca"); err != nil {
		return nil, err
	}
	return s, nil
}

// InitSecretHash is the argon2id hash of the init secret that the first control-plane node's user-data
// carries. It is the same for every run from the same root key: made again at an import, it must not
// change that user-data, which would replace the node.
func (s *Secrets) InitSecretHash() (string, error) {
	return initsecret.HashWithSalt([]byte(s.InitSecret), s.InitSecretSalt)
}

// NewCAs makes the cluster's CA certificates for the derived keys; done once, the certificates are public
// and kept.
func (s *Secrets) NewCAs(now time.Time, validity time.Duration) (kube, join *pki.CA, err error) {
	if kube, err = pki.NewCAWithKey(KubernetesCAName, s.KubernetesCAKey, now, validity); err != nil {
		return nil, nil, err
	}
	if join, err = pki.NewCAWithKey(JoinCAName, s.JoinCAKey, now, validity); err != nil {
		return nil, nil, err
	}
	return kube, join, nil
}

// ErrWrongRootKey means kept CA certificates do not belong to the root key given now.
var ErrWrongRootKey = errors.New("the CA certificates were made from another root key")

// CAs pairs kept CA certificates (PEM) with the keys derived now.
func (s *Secrets) CAs(kubeCertPEM, joinCertPEM []byte) (kube, join *pki.CA, err error) {
	if kube, err = pair("Kubernetes CA", kubeCertPEM, s.KubernetesCAKey); err != nil {
		return nil, nil, err
	}
	if join, err = s.JoinCA(joinCertPEM); err != nil {
		return nil, nil, err
	}
	return kube, join, nil
}

// JoinCA pairs the kept join CA certificate (PEM) with the join CA key derived now: all a join service
// beside an external control plane needs, whose Kubernetes CA is not Berth's.
func (s *Secrets) JoinCA(certPEM []byte) (*pki.CA, error) {
	return pair("join CA", certPEM, s.JoinCAKey)
}

func pair(what string, certPEM []byte, key *ecdsa.PrivateKey) (*pki.CA, error) {
	cert, err := pki.ParseCertPEM(certPEM)
	if err != nil {
		return nil, fmt.Errorf("%s certificate: %w", what, err)
	}
	if !key.PublicKey.Equal(cert.PublicKey) {
		return nil, fmt.Errorf("%s: %w", what, ErrWrongRootKey)
	}
	if !cert.IsCA {
		return nil, fmt.Errorf("%s certificate is not a CA certificate", what)
	}
	return &pki.CA{Cert: cert, Key: key}, nil
}

// Pins are the SPKI pins of the derived CA keys, the form nodes and kubeadm check.
func (s *Secrets) Pins() (kube, join string, err error) {
	for _, p := range []struct {
		key *ecdsa.PrivateKey
		out *string
	}{{s.KubernetesCAKey, &kube}, {s.JoinCAKey, &join}} {
		der, err := x509.MarshalPKIXPublicKey(&p.key.PublicKey)
		if err != nil {
			return "", "", err
		}
		*p.out = pki.SPKIPin(&x509.Certificate{RawSubjectPublicKeyInfo: der})
	}
	return kube, join, nil
}

func expand(root []byte, purpose string, n int) ([]byte, error) {
	out, err := hkdf.Key(sha256.New, root, nil, infoPrefix+purpose, n)
	if err != nil {
		return nil, fmt.Errorf("deriving %s: %w", purpose, err)
	}
	return out, nil
}

// p256Key derives a P-256 private key: 48 bytes of HKDF output reduced into [1, n-1], so that the bias of
// the reduction is below 2^-128 (FIPS 186-5 A.2.1).
func p256Key(root []byte, purpose string) (*ecdsa.PrivateKey, error) {
	b, err := expand(root, purpose, 48)
	if err != nil {
		return nil, err
	}
	n := elliptic.P256().Params().N
	d := new(big.Int).SetBytes(b)
	d.Mod(d, new(big.Int).Sub(n, big.NewInt(1)))
	d.Add(d, big.NewInt(1))
	raw := make([]byte, 32)
	d.FillBytes(raw)
	key, err := ecdsa.ParseRawPrivateKey(elliptic.P256(), raw)
	if err != nil {
		return nil, fmt.Errorf("deriving %s: %w", purpose, err)
	}
	return key, nil
}
