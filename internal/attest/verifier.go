package attest

import (
	"crypto"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/x509"
	"encoding/asn1"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"slices"
	"time"

	gattest "github.com/google/go-attestation/attest"

	"github.com/berthlabs/berth/internal/api/berthv1"
)

// Errors of a Verifier, for callers that map them to protocol status codes. The wrapped message says why;
// none of them carries a secret.
var (
	// ErrMalformed: the evidence does not parse or lacks a part.
	ErrMalformed = errors.New("malformed evidence")
	// ErrUntrusted: the evidence parses but does not prove what it must.
	ErrUntrusted = errors.New("untrusted evidence")
)

// Limits on evidence fields, far above what any TPM produces, so that a peer cannot make the verifier parse
// megabytes.
const (
	maxCertSize = 8 << 10
	maxBlobSize = 2 << 10
)

var oidSubjectAltName = asn1.ObjectIdentifier{2, 5, 29, 17}

// Verifier checks evidence against a set of EK roots. It holds no per-connection state, so one Verifier
// serves any number of concurrent attestations.
type Verifier struct {
	roots, intermediates *x509.CertPool
	now                  func() time.Time
}

// NewVerifier trusts EK certificates that chain to roots, through intermediates when needed.
func NewVerifier(roots, intermediates *x509.CertPool, now func() time.Time) *Verifier {
	if intermediates == nil {
		intermediates = x509.NewCertPool()
	}
	if now == nil {
		now = time.Now
	}
	return &Verifier{roots: roots, intermediates: intermediates, now: now}
}

// ParseCABundle splits a PEM bundle of EK CAs: self-signed certificates become roots, the rest
// intermediates, so operators configure one file as TPM vendors publish them.
func ParseCABundle(data []byte) (roots, intermediates *x509.CertPool, err error) {
	roots, intermediates = x509.NewCertPool(), x509.NewCertPool()
	n := 0
	for {
		var block *pem.Block
		block, data = pem.Decode(data)
		if block == nil {
			break
		}
		if block.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			return nil, nil, fmt.Errorf("parsing EK CA certificate %d: %w", n+1, err)
		}
		n++
		if c.CheckSignatureFrom(c) == nil {
			roots.AddCert(c)
		} else {
			intermediates.AddCert(c)
		}
	}
	if n == 0 {
		return nil, nil, errors.New("no certificate in the EK CA bundle")
	}
	return roots, intermediates, nil
}

// Result is what verified evidence proves.
type Result struct {
	// EKFingerprint is the hex SHA-256 of the EK certificate's public key: the TPM's identity.
	EKFingerprint string
	EKCertificate *x509.Certificate
	// PCRs holds the quoted SHA-256 values.
	PCRs map[int][]byte
}

// Pending is evidence whose quote verified, waiting for the proof that its attestation key sits in the EK's
// TPM.
type Pending struct {
	Challenge *berthv1.ActivationChallenge
	result    Result
	secret    []byte
}

// Verify checks ev for a connection whose nonce is nonce. On success the caller sends the challenge and
// hands the peer's answer to Pending.Complete; only then is the result proven.
func (v *Verifier) Verify(ev *berthv1.Evidence, nonce []byte) (*Pending, error) {
	if err := checkSizes(ev); err != nil {
		return nil, err
	}
	ekCert, err := gattest.ParseEKCertificate(ev.EkCertificate)
	if err != nil {
		return nil, fmt.Errorf("%w: EK certificate: %v", ErrMalformed, err)
	}
	if err := v.verifyEKChain(ekCert); err != nil {
		return nil, err
	}
	ekPub, ok := ekCert.PublicKey.(*rsa.PublicKey)
	if !ok {
		return nil, fmt.Errorf("%w: EK certificate key is %T, want RSA", ErrUntrusted, ekCert.PublicKey)
	}

	akPub, err := gattest.ParseAKPublic(ev.AkPublic)
	if err != nil {
		return nil, fmt.Errorf("%w: attestation key: %v", ErrMalformed, err)
	}
	pcrs := make([]gattest.PCR, 0, len(ev.Pcrs))
	for idx, digest := range ev.Pcrs {
		if idx > 23 || len(digest) != sha256.Size {
			return nil, fmt.Errorf("%w: PCR %d: want a SHA-256 value of index 0-23", ErrMalformed, idx)
		}
		pcrs = append(pcrs, gattest.PCR{Index: int(idx), Digest: digest, DigestAlg: crypto.SHA256})
	}
	if len(pcrs) == 0 {
		return nil, fmt.Errorf("%w: no PCR values", ErrMalformed)
	}
	if err := akPub.Verify(gattest.Quote{Quote: ev.Quote, Signature: ev.QuoteSignature}, pcrs, nonce); err != nil {
		return nil, fmt.Errorf("%w: quote: %v", ErrUntrusted, err)
	}
	for _, p := range pcrs {
		if !p.QuoteVerified() {
			return nil, fmt.Errorf("%w: PCR %d is not covered by the quote", ErrUntrusted, p.Index)
		}
	}

	// Generate also checks that the attestation key is a restricted signing key that the TPM created
	// (fixedTPM, sensitiveDataOrigin), by the creation attestation that the key signed itself.
	act := gattest.ActivationParameters{
		EK: ekPub,
		AK: gattest.AttestationParameters{
			Public:            ev.AkPublic,
			CreateData:        ev.AkCreateData,
			CreateAttestation: ev.AkCreateAttestation,
			CreateSignature:   ev.AkCreateSignature,
		},
	}
	secret, cred, err := act.Generate()
	if err != nil {
		return nil, fmt.Errorf("%w: attestation key: %v", ErrUntrusted, err)
	}

	values := make(map[int][]byte, len(pcrs))
	for _, p := range pcrs {
		values[p.Index] = slices.Clone(p.Digest)
	}
	return &Pending{
		Challenge: &berthv1.ActivationChallenge{Credential: cred.Credential, Secret: cred.Secret},
		result:    Result{EKFingerprint: ekFingerprint(ekCert), EKCertificate: ekCert, PCRs: values},
		secret:    secret,
	}, nil
}

// Complete checks the peer's answer to the challenge.
func (p *Pending) Complete(proof *berthv1.ActivationProof) (*Result, error) {
	if proof == nil || len(proof.Secret) == 0 {
		return nil, fmt.Errorf("%w: no activation proof", ErrMalformed)
	}
	if subtle.ConstantTimeCompare(proof.Secret, p.secret) != 1 {
		return nil, fmt.Errorf("%w: credential activation failed: the attestation key is not in the EK's TPM", ErrUntrusted)
	}
	r := p.result
	return &r, nil
}

func (v *Verifier) verifyEKChain(cert *x509.Certificate) error {
	// EK certificates have an empty subject and name the TPM in a critical subjectAltName made only of
	// directoryName entries (TCG EK Credential Profile §3.2.9), which crypto/x509 does not interpret and so
	// reports as unhandled. The chain and signatures are still checked in full.
	cert.UnhandledCriticalExtensions = slices.DeleteFunc(cert.UnhandledCriticalExtensions, func(oid asn1.ObjectIdentifier) bool {
		return oid.Equal(oidSubjectAltName)
	})
	_, err := cert.Verify(x509.VerifyOptions{
		Roots:         v.roots,
		Intermediates: v.intermediates,
		CurrentTime:   v.now(),
		KeyUsages:     []x509.ExtKeyUsage{x509.ExtKeyUsageAny},
	})
	if err != nil {
		return fmt.Errorf("%w: EK certificate (issuer %q, serial %s) does not chain to a trusted EK root: %v",
			ErrUntrusted, cert.Issuer.String(), cert.SerialNumber.Text(16), err)
	}
	return nil
}

func checkSizes(ev *berthv1.Evidence) error {
	if ev == nil {
		return fmt.Errorf("%w: no evidence", ErrMalformed)
	}
	if len(ev.EkCertificate) == 0 || len(ev.EkCertificate) > maxCertSize {
		return fmt.Errorf("%w: EK certificate of %d bytes", ErrMalformed, len(ev.EkCertificate))
	}
	for _, f := range []struct {
		name string
		b    []byte
	}{
		{"AK public", ev.AkPublic}, {"AK creation data", ev.AkCreateData}, {"AK creation attestation", ev.AkCreateAttestation},
		{"AK creation signature", ev.AkCreateSignature}, {"quote", ev.Quote}, {"quote signature", ev.QuoteSignature},
	} {
		if len(f.b) == 0 || len(f.b) > maxBlobSize {
			return fmt.Errorf("%w: %s of %d bytes", ErrMalformed, f.name, len(f.b))
		}
	}
	if len(ev.Pcrs) > 24 {
		return fmt.Errorf("%w: %d PCR values", ErrMalformed, len(ev.Pcrs))
	}
	return nil
}

func ekFingerprint(cert *x509.Certificate) string {
	sum := sha256.Sum256(cert.RawSubjectPublicKeyInfo)
	return hex.EncodeToString(sum[:])
}
