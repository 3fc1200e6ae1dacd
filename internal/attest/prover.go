package attest

import (
	"crypto/rsa"
	"crypto/x509"
	"errors"
	"fmt"
	"slices"
	"sync"

	gattest "github.com/google/go-attestation/attest"
	"github.com/google/go-tpm/tpm2/transport"

	"github.com/berthlabs/berth/internal/api/berthv1"
)

// Prover makes evidence with one TPM. It creates its attestation key once and serializes all TPM use: a
// TPM executes one command at a time.
type Prover struct {
	mu  sync.Mutex
	tpm *TPM
	ek  gattest.EK
	ak  *gattest.AK
}

// NewProver takes ownership of tpm: Close closes it. It presents the TPM's RSA EK with its certificate from
// the NV index, as TPMs from every manufacturer and most clouds' vTPMs have one; a TPM without one (AWS's
// NitroTPM) presents the EK's public key alone, which only a cloud's EK trust accepts.
func NewProver(tpm *TPM) (*Prover, error) {
	eks, err := tpm.EKs()
	if err != nil {
		return nil, fmt.Errorf("reading endorsement keys: %w", err)
	}
	var ek *gattest.EK
	for i := range eks {
		if _, ok := eks[i].Public.(*rsa.PublicKey); !ok {
			continue
		}
		if ek == nil || (ek.Certificate == nil && eks[i].Certificate != nil) {
			ek = &eks[i]
		}
	}
	if ek == nil {
		return nil, errors.New("the TPM has no RSA endorsement key")
	}
	// ECDSA because key generation inside a TPM is much faster for P-256 than for RSA-2048.
	ak, err := tpm.NewAK(&gattest.AKConfig{Algorithm: gattest.ECDSA})
	if err != nil {
		return nil, fmt.Errorf("creating attestation key: %w", err)
	}
	return &Prover{tpm: tpm, ek: *ek, ak: ak}, nil
}

// Evidence quotes the given PCRs (SHA-256 bank) over nonce.
func (p *Prover) Evidence(nonce []byte, pcrs []int) (*berthv1.Evidence, error) {
	if len(pcrs) == 0 {
		return nil, errors.New("no PCRs to quote")
	}
	for _, i := range pcrs {
		if i < 0 || i > 23 {
			return nil, fmt.Errorf("PCR index %d out of range 0-23", i)
		}
	}
	pcrs = slices.Clone(pcrs)
	slices.Sort(pcrs)
	pcrs = slices.Compact(pcrs)

	p.mu.Lock()
	defer p.mu.Unlock()
	quote, err := p.ak.QuotePCRs(p.tpm.TPM, nonce, gattest.HashSHA256, pcrs)
	if err != nil {
		return nil, fmt.Errorf("quoting PCRs %v: %w", pcrs, err)
	}
	values, err := p.tpm.PCRs(gattest.HashSHA256)
	if err != nil {
		return nil, fmt.Errorf("reading PCRs: %w", err)
	}
	ev := &berthv1.Evidence{
		Quote:          quote.Quote,
		QuoteSignature: quote.Signature,
		Pcrs:           make(map[uint32][]byte, len(pcrs)),
	}
	if p.ek.Certificate != nil {
		ev.EkCertificate = p.ek.Certificate.Raw
	} else if ev.EkPublic, err = x509.MarshalPKIXPublicKey(p.ek.Public); err != nil {
		return nil, fmt.Errorf("encoding the EK public key: %w", err)
	}
	params := p.ak.AttestationParameters()
	ev.AkPublic, ev.AkCreateData, ev.AkCreateAttestation, ev.AkCreateSignature =
		params.Public, params.CreateData, params.CreateAttestation, params.CreateSignature
	for _, v := range values {
		if slices.Contains(pcrs, v.Index) {
			ev.Pcrs[uint32(v.Index)] = v.Digest
		}
	}
	// A PCR can move between the quote and the read (the kernel keeps extending PCR 10). The verifier would
	// refuse such evidence; it is retried by the caller, whose next attempt sees settled values.
	return ev, nil
}

// Activate recovers the secret of a challenge made for this TPM's EK and attestation key.
func (p *Prover) Activate(c *berthv1.ActivationChallenge) ([]byte, error) {
	if c == nil {
		return nil, errors.New("no activation challenge")
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	secret, err := p.ak.ActivateCredentialWithEK(p.tpm.TPM, gattest.EncryptedCredential{Credential: c.Credential, Secret: c.Secret}, p.ek)
	if err != nil {
		return nil, fmt.Errorf("activating credential: %w", err)
	}
	return secret, nil
}

// UseTPM runs f with the TPM's raw command channel, while no evidence or activation uses it, for the
// commands go-attestation does not offer. f must flush every handle it loads: a TPM without a resource
// manager (swtpm on a socket) has room for very few objects, and the attestation key holds one.
func (p *Prover) UseTPM(f func(transport.TPM) error) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return f(p.tpm.raw)
}

// EKFingerprint names this TPM the way a Verifier's Result does.
func (p *Prover) EKFingerprint() string {
	return EK{Public: p.ek.Public.(*rsa.PublicKey)}.Fingerprint()
}

// Close releases the attestation key and the TPM.
func (p *Prover) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return errors.Join(p.ak.Close(p.tpm.TPM), p.tpm.Close())
}
