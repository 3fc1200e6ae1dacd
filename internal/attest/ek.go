package attest

import (
	"bytes"
	"context"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"encoding/asn1"
	"encoding/hex"
	"fmt"
	"slices"
	"sync"
	"time"
)

// EK is the endorsement key a node presents.
type EK struct {
	Public *rsa.PublicKey
	// Certificate is the EK certificate from the TPM's NV index; nil for TPMs that have none (AWS's
	// NitroTPM), whose EK a cloud's API vouches for instead.
	Certificate *x509.Certificate
}

// Fingerprint is the hex SHA-256 of the EK's SubjectPublicKeyInfo: the TPM's identity. It depends on the key
// alone, so a TPM keeps its identity whichever way its EK is trusted.
func (ek EK) Fingerprint() string {
	der, err := x509.MarshalPKIXPublicKey(ek.Public)
	if err != nil {
		// An RSA public key always marshals; this guards a zero EK only.
		return ""
	}
	sum := sha256.Sum256(der)
	return hex.EncodeToString(sum[:])
}

// EKTrust decides whether an endorsement key belongs to a genuine TPM of the peer.
type EKTrust interface {
	// TrustEK returns nil when ek is trusted for the instance whose cloud id is instanceID (empty where the
	// caller knows no instance), and otherwise an error wrapping ErrUntrusted that says why.
	TrustEK(ctx context.Context, ek EK, instanceID string) error
}

// CertChain trusts EKs whose certificate chains to one of its roots: TPM vendors' CAs, the lab's EK CA,
// clouds that put EK certificates in their vTPMs.
//
// Every EK certificate of a vendor or cloud is issued by one of a few intermediates, and a storm of nodes
// would verify the same intermediate against its root once per node. CertChain remembers each intermediate
// that chained to a root, by its exact bytes, and verifies a later certificate against it directly: the
// certificate's own signature, validity and extensions are checked in full every time, the remembered
// intermediate's validity by crypto/x509 as the anchor, and the validity of every certificate above it at
// each use.
type CertChain struct {
	roots, intermediates *x509.CertPool
	now                  func() time.Time

	mu sync.RWMutex
	// verified are the intermediates that issued a verified EK certificate, by their RawSubject; an
	// intermediate can only come from the configured pools, so there are at most as many as were configured.
	verified map[string][]*verifiedIssuer
}

// verifiedIssuer is an intermediate that was verified up to a root.
type verifiedIssuer struct {
	cert *x509.Certificate
	// anchor holds cert alone, as the root of a shorter verification.
	anchor *x509.CertPool
	// above is the rest of the chain cert was verified by, up to the root.
	above []*x509.Certificate
}

// NewCertChain trusts EK certificates that chain to roots, through intermediates when needed; now is the
// clock certificates are checked at (time.Now when nil).
func NewCertChain(roots, intermediates *x509.CertPool, now func() time.Time) *CertChain {
	if intermediates == nil {
		intermediates = x509.NewCertPool()
	}
	if now == nil {
		now = time.Now
	}
	return &CertChain{roots: roots, intermediates: intermediates, now: now, verified: map[string][]*verifiedIssuer{}}
}

var oidSubjectAltName = asn1.ObjectIdentifier{2, 5, 29, 17}

// TrustEK implements EKTrust.
func (c *CertChain) TrustEK(_ context.Context, ek EK, _ string) error {
	cert := ek.Certificate
	if cert == nil {
		return fmt.Errorf("%w: the TPM has no EK certificate, and this service trusts EKs by their certificate chain (a cloud that vouches for its TPMs by API needs that cloud's EK trust configured)", ErrUntrusted)
	}
	// EK certificates have an empty subject and name the TPM in a critical subjectAltName made only of
	// directoryName entries (TCG EK Credential Profile §3.2.9), which crypto/x509 does not interpret and so
	// reports as unhandled. The chain and signatures are still checked in full.
	cert.UnhandledCriticalExtensions = slices.DeleteFunc(cert.UnhandledCriticalExtensions, func(oid asn1.ObjectIdentifier) bool {
		return oid.Equal(oidSubjectAltName)
	})
	now := c.now()
	if c.issuedByVerified(cert, now) {
		return nil
	}
	chains, err := cert.Verify(x509.VerifyOptions{
		Roots:         c.roots,
		Intermediates: c.intermediates,
		CurrentTime:   now,
		KeyUsages:     []x509.ExtKeyUsage{x509.ExtKeyUsageAny},
	})
	if err != nil {
		return fmt.Errorf("%w: EK certificate (issuer %q, serial %s) does not chain to a trusted EK root: %v",
			ErrUntrusted, cert.Issuer.String(), cert.SerialNumber.Text(16), err)
	}
	c.remember(chains[0])
	return nil
}

// issuedByVerified reports whether cert verifies with a remembered intermediate as its anchor, at now.
func (c *CertChain) issuedByVerified(cert *x509.Certificate, now time.Time) bool {
	c.mu.RLock()
	candidates := c.verified[string(cert.RawIssuer)]
	c.mu.RUnlock()
	for _, v := range candidates {
		if !validAt(v.above, now) {
			continue
		}
		if _, err := cert.Verify(x509.VerifyOptions{Roots: v.anchor, CurrentTime: now, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err == nil {
			return true
		}
	}
	return false
}

// remember keeps the intermediate that issued chain's certificate (chain[1], when chain is leaf,
// intermediates, root). It is only remembered when neither it nor anything above it constrains names or
// policies: crypto/x509 applies those of intermediates, not all of an anchor's, and none of the certificates
// above the anchor, so a shorter verification could accept what the full one refuses.
func (c *CertChain) remember(chain []*x509.Certificate) {
	if len(chain) < 3 {
		return
	}
	issuer, above := chain[1], chain[2:]
	for _, a := range chain[1:] {
		if constrains(a) {
			return
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	key := string(issuer.RawSubject)
	for _, v := range c.verified[key] {
		if bytes.Equal(v.cert.Raw, issuer.Raw) {
			return
		}
	}
	anchor := x509.NewCertPool()
	anchor.AddCert(issuer)
	c.verified[key] = append(c.verified[key], &verifiedIssuer{cert: issuer, anchor: anchor, above: slices.Clone(above)})
}

func validAt(certs []*x509.Certificate, now time.Time) bool {
	for _, c := range certs {
		if now.Before(c.NotBefore) || now.After(c.NotAfter) {
			return false
		}
	}
	return true
}

// constrains reports whether a CA certificate constrains the names or policies of what it issues.
func constrains(c *x509.Certificate) bool {
	names := len(c.PermittedDNSDomains)+len(c.ExcludedDNSDomains)+len(c.PermittedIPRanges)+len(c.ExcludedIPRanges)+
		len(c.PermittedEmailAddresses)+len(c.ExcludedEmailAddresses)+len(c.PermittedURIDomains)+len(c.ExcludedURIDomains) > 0 ||
		c.PermittedDNSDomainsCritical
	policies := c.RequireExplicitPolicy > 0 || c.RequireExplicitPolicyZero || c.InhibitPolicyMapping > 0 || c.InhibitPolicyMappingZero ||
		c.InhibitAnyPolicy > 0 || c.InhibitAnyPolicyZero || len(c.PolicyMappings) > 0
	return names || policies
}

// EKPublicSource is a cloud's API that reports the EK public key of an instance's TPM.
type EKPublicSource interface {
	EKPublic(ctx context.Context, instanceID string) (*rsa.PublicKey, error)
}

// CloudEK trusts an EK when the cloud reports the same public key for the instance the connection comes
// from. That binds the TPM to the instance: a TPM of another instance, or a software TPM, is refused even
// when it proves everything else, and so is a peer that merely took over the instance's address.
type CloudEK struct {
	// Cloud names the source in refusals ("EC2").
	Cloud  string
	Source EKPublicSource
}

// TrustEK implements EKTrust. A certificate the TPM may also carry is neither needed nor trusted: only the
// cloud's word counts.
func (c CloudEK) TrustEK(ctx context.Context, ek EK, instanceID string) error {
	if instanceID == "" {
		return fmt.Errorf("%w: %s vouches only for the TPM of a known instance, and the instance record has no id", ErrUntrusted, c.Cloud)
	}
	want, err := c.Source.EKPublic(ctx, instanceID)
	if err != nil {
		return fmt.Errorf("asking %s for the EK of instance %s: %w", c.Cloud, instanceID, err)
	}
	if !want.Equal(ek.Public) {
		return fmt.Errorf("%w: the node's EK (%s) is not the one %s reports for instance %s (%s)",
			ErrUntrusted, short(ek.Fingerprint()), c.Cloud, instanceID, short(EK{Public: want}.Fingerprint()))
	}
	return nil
}

func short(fingerprint string) string {
	if len(fingerprint) > 16 {
		return fingerprint[:16]
	}
	return fingerprint
}
