// Package pki makes and checks the cluster's certificate authorities and the certificates they
// issue: ECDSA P-256, standard library only.
//
// A node learns the join CA not from a certificate but from a pin in its user-data: the SHA-256
// of the CA's SubjectPublicKeyInfo, in the same "sha256:<hex>" form as kubeadm's
// discovery-token-ca-cert-hash. The join service therefore sends the CA certificate with its own,
// and VerifyPinnedChain accepts the chain only if that CA matches the pin and signed the leaf.
package pki

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"strings"
	"time"
)

// clockSkew backdates NotBefore: a freshly booted VM's clock may lag until NTP has run, and a
// certificate that is "not yet valid" for a few minutes would fail its first join for no reason.
const clockSkew = 5 * time.Minute

const (
	pinPrefix    = "sha256:"
	pinHexLen    = 2 * sha256.Size
	pemCert      = "CERTIFICATE"
	pemKeyPKCS8  = "PRIVATE KEY"
	serialBits   = 128
	maxPinInErrs = len(pinPrefix) + pinHexLen
)

// CA is a certificate authority: its certificate and the key that signs with it.
type CA struct {
	Cert *x509.Certificate
	Key  crypto.Signer
}

// NewKey returns a new ECDSA P-256 key.
func NewKey() (*ecdsa.PrivateKey, error) {
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generating P-256 key: %w", err)
	}
	return k, nil
}

func newSerial() (*big.Int, error) {
	// 128 random bits, plus one so that the serial is never zero (RFC 5280 wants it positive).
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), serialBits))
	if err != nil {
		return nil, fmt.Errorf("generating serial number: %w", err)
	}
	return n.Add(n, big.NewInt(1)), nil
}

func checkValidity(now time.Time, validity time.Duration) error {
	if now.IsZero() {
		return errors.New("current time is zero")
	}
	if validity <= 0 {
		return fmt.Errorf("validity %v is not positive", validity)
	}
	return nil
}

// NewCA makes a self-signed CA with a new P-256 key, valid from now for validity. It may sign
// leaf certificates only (path length 0): Berth has no intermediate CAs.
func NewCA(commonName string, now time.Time, validity time.Duration) (*CA, error) {
	key, err := NewKey()
	if err != nil {
		return nil, fmt.Errorf("creating CA %q: %w", commonName, err)
	}
	return NewCAWithKey(commonName, key, now, validity)
}

// NewCAWithKey is NewCA for a key the caller made (Berth derives its cluster CAs' keys from a root key).
func NewCAWithKey(commonName string, key crypto.Signer, now time.Time, validity time.Duration) (*CA, error) {
	if commonName == "" {
		return nil, errors.New("creating CA: empty common name")
	}
	if err := checkValidity(now, validity); err != nil {
		return nil, fmt.Errorf("creating CA %q: %w", commonName, err)
	}
	serial, err := newSerial()
	if err != nil {
		return nil, fmt.Errorf("creating CA %q: %w", commonName, err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: commonName},
		NotBefore:             now.Add(-clockSkew),
		NotAfter:              now.Add(validity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLen:            0,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, fmt.Errorf("creating CA %q: signing certificate: %w", commonName, err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("creating CA %q: parsing own certificate: %w", commonName, err)
	}
	return &CA{Cert: cert, Key: key}, nil
}

// ParseCA reads a CA from its PEM certificate and PEM PKCS#8 key, and checks that the
// certificate is a CA certificate and that the key is its key.
func ParseCA(certPEM, keyPEM []byte) (*CA, error) {
	cert, err := ParseCertPEM(certPEM)
	if err != nil {
		return nil, fmt.Errorf("parsing CA: %w", err)
	}
	if !cert.BasicConstraintsValid || !cert.IsCA {
		return nil, fmt.Errorf("parsing CA: certificate %q is not a CA certificate", cert.Subject.CommonName)
	}
	if cert.KeyUsage&x509.KeyUsageCertSign == 0 {
		return nil, fmt.Errorf("parsing CA: certificate %q may not sign certificates (no certSign key usage)", cert.Subject.CommonName)
	}
	key, err := ParseKeyPEM(keyPEM)
	if err != nil {
		return nil, fmt.Errorf("parsing CA %q: %w", cert.Subject.CommonName, err)
	}
	pub, ok := key.Public().(interface{ Equal(crypto.PublicKey) bool })
	if !ok || !pub.Equal(cert.PublicKey) {
		return nil, fmt.Errorf("parsing CA %q: private key does not belong to the certificate", cert.Subject.CommonName)
	}
	return &CA{Cert: cert, Key: key}, nil
}

// CertPEM returns the CA certificate in PEM.
func (ca *CA) CertPEM() []byte { return EncodeCertPEM(ca.Cert) }

// KeyPEM returns the CA key in PEM (PKCS#8, "PRIVATE KEY").
func (ca *CA) KeyPEM() ([]byte, error) { return EncodeKeyPEM(ca.Key) }

// IssueServer issues a TLS server certificate for key, naming dnsNames and ips.
func (ca *CA) IssueServer(key crypto.PublicKey, dnsNames []string, ips []net.IP, now time.Time, validity time.Duration) (*x509.Certificate, error) {
	if len(dnsNames) == 0 && len(ips) == 0 {
		return nil, errors.New("issuing server certificate: no DNS name or IP address to name")
	}
	var cn string
	if len(dnsNames) > 0 {
		cn = dnsNames[0]
	} else {
		cn = ips[0].String()
	}
	tmpl := &x509.Certificate{
		Subject:     pkix.Name{CommonName: cn},
		DNSNames:    dnsNames,
		IPAddresses: ips,
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	cert, err := ca.issue(tmpl, key, now, validity)
	if err != nil {
		return nil, fmt.Errorf("issuing server certificate for %q: %w", cn, err)
	}
	return cert, nil
}

// ClientTemplate names the subject of a TLS client certificate. For Kubernetes, CommonName is
// the user and Organization the groups.
type ClientTemplate struct {
	CommonName   string
	Organization []string
	IPAddresses  []net.IP
	DNSNames     []string
}

// IssueClient issues a TLS client certificate for key.
func (ca *CA) IssueClient(tmpl ClientTemplate, key crypto.PublicKey, now time.Time, validity time.Duration) (*x509.Certificate, error) {
	if tmpl.CommonName == "" {
		return nil, errors.New("issuing client certificate: empty common name")
	}
	c := &x509.Certificate{
		Subject:     pkix.Name{CommonName: tmpl.CommonName, Organization: tmpl.Organization},
		DNSNames:    tmpl.DNSNames,
		IPAddresses: tmpl.IPAddresses,
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	cert, err := ca.issue(c, key, now, validity)
	if err != nil {
		return nil, fmt.Errorf("issuing client certificate for %q: %w", tmpl.CommonName, err)
	}
	return cert, nil
}

func (ca *CA) issue(tmpl *x509.Certificate, key crypto.PublicKey, now time.Time, validity time.Duration) (*x509.Certificate, error) {
	if ca == nil || ca.Cert == nil || ca.Key == nil {
		return nil, errors.New("CA has no certificate or key")
	}
	if key == nil {
		return nil, errors.New("no public key")
	}
	if err := checkValidity(now, validity); err != nil {
		return nil, err
	}
	notAfter := now.Add(validity)
	if notAfter.After(ca.Cert.NotAfter) {
		return nil, fmt.Errorf("validity ends %s, after CA %q expires (%s)",
			notAfter.UTC().Format(time.RFC3339), ca.Cert.Subject.CommonName, ca.Cert.NotAfter.UTC().Format(time.RFC3339))
	}
	serial, err := newSerial()
	if err != nil {
		return nil, err
	}
	tmpl.SerialNumber = serial
	tmpl.NotBefore = now.Add(-clockSkew)
	tmpl.NotAfter = notAfter
	tmpl.BasicConstraintsValid = true
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, key, ca.Key)
	if err != nil {
		return nil, fmt.Errorf("signing certificate: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("parsing issued certificate: %w", err)
	}
	return cert, nil
}

// SPKIPin returns the pin of cert's public key: "sha256:" and the lowercase hex SHA-256 of its
// DER SubjectPublicKeyInfo, the form of kubeadm's --discovery-token-ca-cert-hash.
func SPKIPin(cert *x509.Certificate) string {
	sum := sha256.Sum256(cert.RawSubjectPublicKeyInfo)
	return pinPrefix + hex.EncodeToString(sum[:])
}

// ParsePin checks that s is a pin as SPKIPin makes it and returns the hash it holds.
func ParsePin(s string) ([]byte, error) {
	hexPart, ok := strings.CutPrefix(s, pinPrefix)
	if !ok {
		return nil, fmt.Errorf("pin %s: want the form sha256:<64 lowercase hex digits>", shortPin(s))
	}
	if len(hexPart) != pinHexLen {
		return nil, fmt.Errorf("pin %s: hash has %d hex digits, want %d", shortPin(s), len(hexPart), pinHexLen)
	}
	for i := 0; i < len(hexPart); i++ {
		if c := hexPart[i]; !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return nil, fmt.Errorf("pin %s: %q is not a lowercase hex digit", shortPin(s), c)
		}
	}
	sum, err := hex.DecodeString(hexPart)
	if err != nil {
		return nil, fmt.Errorf("pin %s: %w", shortPin(s), err)
	}
	return sum, nil
}

// shortPin quotes a pin for an error message, cut so that a wrong argument is not echoed at length.
func shortPin(s string) string {
	if len(s) > maxPinInErrs {
		return fmt.Sprintf("%q... (%d bytes)", s[:maxPinInErrs], len(s))
	}
	return fmt.Sprintf("%q", s)
}

// PinMatches reports whether cert's public key has the given pin. A malformed pin matches nothing.
func PinMatches(pin string, cert *x509.Certificate) bool {
	want, err := ParsePin(pin)
	if err != nil || cert == nil {
		return false
	}
	got := sha256.Sum256(cert.RawSubjectPublicKeyInfo)
	return subtle.ConstantTimeCompare(want, got[:]) == 1
}

// VerifyPinnedChain checks the chain a join service presented, for use in
// tls.Config.VerifyPeerCertificate on a node that has no CA certificate, only a pin. The leaf
// (rawCerts[0]) must be a server certificate valid at now, signed directly by a CA certificate among
// the other certificates whose SPKI pin is pin, and, when serverName is not empty, issued for
// serverName. Nodes pass no name: they reach join services by address or through a load balancer
// whose name the services' certificates need not carry, and only join services ever get
// certificates from the join CA.
func VerifyPinnedChain(pin string, rawCerts [][]byte, serverName string, now time.Time) error {
	if _, err := ParsePin(pin); err != nil {
		return fmt.Errorf("verifying join service certificate: %w", err)
	}
	if len(rawCerts) == 0 {
		return errors.New("verifying join service certificate: the service presented no certificate")
	}
	certs := make([]*x509.Certificate, len(rawCerts))
	for i, raw := range rawCerts {
		c, err := x509.ParseCertificate(raw)
		if err != nil {
			return fmt.Errorf("verifying join service certificate: parsing certificate %d of the chain: %w", i, err)
		}
		certs[i] = c
	}
	leaf := certs[0]

	var ca *x509.Certificate
	presented := make([]string, 0, len(certs)-1)
	for _, c := range certs[1:] {
		if PinMatches(pin, c) {
			ca = c
			break
		}
		presented = append(presented, SPKIPin(c))
	}
	if ca == nil {
		if len(presented) == 0 {
			return fmt.Errorf("join service certificate is not signed by the pinned join CA (pin %s): the service sent no CA certificate with it", pin)
		}
		return fmt.Errorf("join service certificate is not signed by the pinned join CA (pin %s): the service sent CA certificates with pins %s",
			pin, strings.Join(presented, ", "))
	}
	if !ca.BasicConstraintsValid || !ca.IsCA {
		return fmt.Errorf("join service certificate is not signed by the pinned join CA (pin %s): the certificate with that key is not a CA certificate", pin)
	}

	roots := x509.NewCertPool()
	roots.AddCert(ca)
	_, err := leaf.Verify(x509.VerifyOptions{
		DNSName:     serverName,
		Roots:       roots,
		CurrentTime: now,
		KeyUsages:   []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	})
	if err != nil {
		return fmt.Errorf("join service certificate %q does not verify against the pinned join CA (pin %s): %w", leaf.Subject.CommonName, pin, err)
	}
	return nil
}

// EncodeCertPEM returns cert in PEM.
func EncodeCertPEM(cert *x509.Certificate) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: pemCert, Bytes: cert.Raw})
}

// ParseCertPEM reads exactly one PEM certificate.
func ParseCertPEM(data []byte) (*x509.Certificate, error) {
	block, err := singleBlock(data, pemCert)
	if err != nil {
		return nil, fmt.Errorf("parsing certificate: %w", err)
	}
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		return nil, fmt.Errorf("parsing certificate: %w", err)
	}
	return cert, nil
}

// EncodeKeyPEM returns key in PEM, as PKCS#8 ("PRIVATE KEY").
func EncodeKeyPEM(key crypto.Signer) ([]byte, error) {
	if key == nil {
		return nil, errors.New("encoding private key: no key")
	}
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, fmt.Errorf("encoding private key: %w", err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: pemKeyPKCS8, Bytes: der}), nil
}

// ParseKeyPEM reads exactly one PEM PKCS#8 private key.
func ParseKeyPEM(data []byte) (crypto.Signer, error) {
	block, err := singleBlock(data, pemKeyPKCS8)
	if err != nil {
		return nil, fmt.Errorf("parsing private key: %w", err)
	}
	// The parser's error names the ASN.1 structure it expected, never key bytes.
	key, err := x509.ParsePKCS8PrivateKey(block.Bytes)
	if err != nil {
		return nil, fmt.Errorf("parsing private key: %w", err)
	}
	signer, ok := key.(crypto.Signer)
	if !ok {
		return nil, fmt.Errorf("parsing private key: a %T cannot sign", key)
	}
	return signer, nil
}

// singleBlock returns the only PEM block in data, which must be of type want. More than one block
// is refused so that a bundle is never silently cut to its first entry.
func singleBlock(data []byte, want string) (*pem.Block, error) {
	block, rest := pem.Decode(data)
	if block == nil {
		return nil, fmt.Errorf("no PEM block (want %q)", want)
	}
	if block.Type != want {
		return nil, fmt.Errorf("PEM block is %q, want %q", block.Type, want)
	}
	if next, _ := pem.Decode(rest); next != nil {
		return nil, fmt.Errorf("more than one PEM block, want a single %q", want)
	}
	return block, nil
}
