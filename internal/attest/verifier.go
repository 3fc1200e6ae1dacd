package attest

import (
	"context"
	"crypto"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"slices"

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

// Verifier checks evidence and asks its EKTrust whether the presented endorsement key is a genuine TPM's.
// It holds no per-connection state, so one Verifier serves any number of concurrent attestations.
type Verifier struct {
	trust EKTrust
}

// NewVerifier trusts endorsement keys that trust accepts.
func NewVerifier(trust EKTrust) *Verifier {
	return &Verifier{trust: trust}
}

// ParseCABundle splits a PEM bundle of EK CAs: self-signed certificates become roots, the rest
// intermediates, so operators configure one file as TPM vendors publish them.
func ParseCABundle(data []byte) (roots, intermediates *x509.CertPool, err error) {
	roots, intermediates = x509.NewCertPool(), x509.NewCertPool()
	if err := AddCABundle(roots, intermediates, data); err != nil {
		return nil, nil, err
	}
	return roots, intermediates, nil
}

// AddCABundle adds a PEM bundle of EK CAs to roots and intermediates, split as ParseCABundle splits them.
func AddCABundle(roots, intermediates *x509.CertPool, data []byte) error {
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
			return fmt.Errorf("parsing EK CA certificate %d: %w", n+1, err)
		}
		n++
		if c.CheckSignatureFrom(c) == nil {
			roots.AddCert(c)
		} else {
			intermediates.AddCert(c)
		}
	}
	if n == 0 {
		return errors.New("no certificate in the EK CA bundle")
	}
	return nil
}

// Result is what verified evidence proves.
type Result struct {
	// EKFingerprint is the EK's Fingerprint: the TPM's identity.
	EKFingerprint string
	EK            EK
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

// Verify checks ev for a connection whose nonce is nonce, from the instance whose cloud id is instanceID
// (empty where the caller knows no instance). On success the caller sends the challenge and hands the
// peer's answer to Pending.Complete; only then is the result proven.
func (v *Verifier) Verify(ctx context.Context, ev *berthv1.Evidence, nonce []byte, instanceID string) (*Pending, error) {
	if err := checkSizes(ev); err != nil {
		return nil, err
	}
	ek, err := parseEK(ev)
	if err != nil {
		return nil, err
	}
	if err := v.trust.TrustEK(ctx, ek, instanceID); err != nil {
		return nil, err
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
		EK: ek.Public,
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
		result:    Result{EKFingerprint: ek.Fingerprint(), EK: ek, PCRs: values},
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

// parseEK reads the EK the evidence presents: its certificate, or for TPMs without one its public key.
func parseEK(ev *berthv1.Evidence) (EK, error) {
	if len(ev.EkPublic) > 0 {
		pub, err := x509.ParsePKIXPublicKey(ev.EkPublic)
		if err != nil {
			return EK{}, fmt.Errorf("%w: EK public key: %v", ErrMalformed, err)
		}
		rsaPub, ok := pub.(*rsa.PublicKey)
		if !ok {
			return EK{}, fmt.Errorf("%w: EK public key is %T, want RSA", ErrMalformed, pub)
		}
		return EK{Public: rsaPub}, nil
	}
	cert, err := gattest.ParseEKCertificate(ev.EkCertificate)
	if err != nil {
		return EK{}, fmt.Errorf("%w: EK certificate: %v", ErrMalformed, err)
	}
	rsaPub, ok := cert.PublicKey.(*rsa.PublicKey)
	if !ok {
		return EK{}, fmt.Errorf("%w: EK certificate key is %T, want RSA", ErrUntrusted, cert.PublicKey)
	}
	return EK{Public: rsaPub, Certificate: cert}, nil
}

func checkSizes(ev *berthv1.Evidence) error {
	if ev == nil {
		return fmt.Errorf("%w: no evidence", ErrMalformed)
	}
	// One way to name the EK, so that what is trusted is what is used.
	switch {
	case len(ev.EkCertificate) == 0 && len(ev.EkPublic) == 0:
		return fmt.Errorf("%w: neither an EK certificate nor an EK public key", ErrMalformed)
	case len(ev.EkCertificate) > 0 && len(ev.EkPublic) > 0:
		return fmt.Errorf("%w: both an EK certificate and an EK public key", ErrMalformed)
	case len(ev.EkCertificate) > maxCertSize:
		return fmt.Errorf("%w: EK certificate of %d bytes", ErrMalformed, len(ev.EkCertificate))
	case len(ev.EkPublic) > maxBlobSize:
		return fmt.Errorf("%w: EK public key of %d bytes", ErrMalformed, len(ev.EkPublic))
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
