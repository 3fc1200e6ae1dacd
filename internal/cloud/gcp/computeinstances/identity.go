package computeinstances

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"golang.org/x/time/rate"
	compute "google.golang.org/api/compute/v1"

	"github.com/berthlabs/berth/internal/cloud/ttlcache"
	"github.com/berthlabs/berth/internal/metadata"
)

// Bounds of the keys a vTPM identity holds. Shielded VM vTPMs have RSA-2048 EKs; anything below 2048 bits
// is no EK a TPM 2.0 makes, anything above 4096 is no vTPM's.
const (
	minEKBits = 2048
	maxEKBits = 4096
	// maxPEMLen bounds a key or certificate as the API sends it: an RSA-4096 key is under 1 KiB of PEM, an
	// EK certificate 2 to 3 KiB.
	maxPEMLen = 16 << 10
)

// ShieldedIdentity is the identity of an instance's vTPM as Compute Engine reports it.
type ShieldedIdentity struct {
	// InstanceID is the instance's id in records (InstanceID).
	InstanceID string
	// EK is the public endorsement key (encryptionKey.ekPub), RSA.
	EK *rsa.PublicKey
	// EKCertificate is the EK certificate (encryptionKey.ekCert), issued by Google's vTPM CA; nil when
	// Compute Engine reports none. Its key is EK.
	EKCertificate *x509.Certificate
	// AK and AKCertificate are the vTPM's signing key (signingKey.ekPub, .ekCert), each nil when none is
	// reported.
	AK            crypto.PublicKey
	AKCertificate *x509.Certificate
}

// Identities reports the vTPM identities of Shielded VM instances. Every Lookup has one; alone, it serves
// callers that know the instance already (the init of the first control-plane node, by its instance id).
type Identities struct {
	svc         *compute.Service
	log         *slog.Logger
	callTimeout time.Duration
	rateLimit   rate.Limit
	rl          *rate.Limiter
	cache       *ttlcache.Cache[identityEntry]
}

// identityEntry holds an identity as DER, so that every caller gets certificates of its own: callers
// change them (attest's chain check drops the EK certificate's critical subjectAltName before verifying).
type identityEntry struct {
	ek, ekCert, ak, akCert []byte
}

// NewIdentities asks svc, with the defaults of Config.
func NewIdentities(svc *compute.Service, log *slog.Logger) *Identities {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return newIdentities(svc, log.With("subsystem", "computeinstances"), time.Now, DefaultIdentityCacheTTL, DefaultIdentityCacheSize,
		DefaultCallTimeout, DefaultIdentityRate, DefaultBurst)
}

func newIdentities(svc *compute.Service, log *slog.Logger, clock func() time.Time, ttl time.Duration, size int, callTimeout time.Duration, r rate.Limit, burst int) *Identities {
	return &Identities{svc: svc, log: log, callTimeout: callTimeout, rateLimit: r, rl: rate.NewLimiter(r, burst),
		cache: ttlcache.New[identityEntry](clock, ttl, size)}
}

// EKPublic returns the public endorsement key of the vTPM of instance instanceID (as InstanceID makes it),
// as Compute Engine reports it. An instance Compute Engine does not know gives an error wrapping
// metadata.ErrNotFound.
func (s *Identities) EKPublic(ctx context.Context, instanceID string) (*rsa.PublicKey, error) {
	id, err := s.Identity(ctx, instanceID)
	if err != nil {
		return nil, err
	}
	return id.EK, nil
}

// Identity returns the vTPM identity of instance instanceID (getShieldedInstanceIdentity), for callers
// that check its certificates too. Identities are cached for the cache TTL, and concurrent requests for
// one instance share one call. Each caller gets its own copy.
func (s *Identities) Identity(ctx context.Context, instanceID string) (*ShieldedIdentity, error) {
	project, zone, id, err := ParseInstanceID(instanceID)
	if err != nil {
		return nil, fmt.Errorf("Compute Engine vTPM identity: %w", err)
	}
	e, stopped, err := s.cache.Get(ctx, instanceID, s.callTimeout, func(ctx context.Context) (identityEntry, error) {
		e, err := s.fetch(ctx, project, zone, id)
		if err != nil {
			err = fmt.Errorf("Compute Engine vTPM identity of %s: %w", instanceID, err)
			s.log.Warn("Compute Engine vTPM identity request failed", "instance", instanceID, "error", err)
		}
		return e, err
	})
	switch {
	case stopped:
		return nil, fmt.Errorf("Compute Engine vTPM identity of %s: %w", instanceID, err)
	case err != nil:
		return nil, err
	}
	return e.identity(instanceID)
}

func (s *Identities) fetch(ctx context.Context, project, zone string, id uint64) (identityEntry, error) {
	if err := s.rl.Wait(ctx); err != nil {
		return identityEntry{}, fmt.Errorf("the join service's own pacing of %s (%v calls a second): %w", methodShieldedIdentity, s.rateLimit, err)
	}
	out, err := s.svc.Instances.GetShieldedInstanceIdentity(project, zone, strconv.FormatUint(id, 10)).Context(ctx).Do()
	if err != nil {
		if isNotFound(err) {
			return identityEntry{}, fmt.Errorf("%w: Compute Engine has no instance %d in zone %s of project %s: %w", metadata.ErrNotFound, id, zone, project, apiError(methodShieldedIdentity, err))
		}
		return identityEntry{}, apiError(methodShieldedIdentity, err)
	}
	if out.Kind != "" && out.Kind != "compute#shieldedInstanceIdentity" {
		return identityEntry{}, fmt.Errorf("the answer is a %q, not a compute#shieldedInstanceIdentity", bounded(out.Kind))
	}
	if out.EncryptionKey == nil || out.EncryptionKey.EkPub == "" {
		return identityEntry{}, errors.New("the instance reports no vTPM endorsement key: it is not a Shielded VM, or its vTPM is off (shieldedInstanceConfig.enableVtpm)")
	}
	var e identityEntry
	ek, err := parsePublicKey(out.EncryptionKey.EkPub)
	if err != nil {
		return identityEntry{}, fmt.Errorf("endorsement key: %w", err)
	}
	rsaEK, ok := ek.(*rsa.PublicKey)
	if !ok {
		return identityEntry{}, fmt.Errorf("the endorsement key is %s, not RSA", keyKind(ek))
	}
	if n := rsaEK.N.BitLen(); n < minEKBits || n > maxEKBits {
		return identityEntry{}, fmt.Errorf("the endorsement key is RSA-%d, not %d to %d bits", n, minEKBits, maxEKBits)
	}
	if e.ek, err = x509.MarshalPKIXPublicKey(rsaEK); err != nil {
		return identityEntry{}, fmt.Errorf("endorsement key: %w", err)
	}
	if c := out.EncryptionKey.EkCert; c != "" {
		cert, err := parseCertificate(c)
		if err != nil {
			return identityEntry{}, fmt.Errorf("EK certificate: %w", err)
		}
		// A certificate of another key beside the key is an answer that contradicts itself.
		if !rsaEK.Equal(cert.PublicKey) {
			return identityEntry{}, fmt.Errorf("the EK certificate (serial %s) certifies another key than the endorsement key reported with it", cert.SerialNumber.Text(16))
		}
		e.ekCert = cert.Raw
	}
	if sk := out.SigningKey; sk != nil && sk.EkPub != "" {
		ak, err := parsePublicKey(sk.EkPub)
		if err != nil {
			return identityEntry{}, fmt.Errorf("signing key: %w", err)
		}
		if e.ak, err = x509.MarshalPKIXPublicKey(ak); err != nil {
			return identityEntry{}, fmt.Errorf("signing key: %w", err)
		}
		if sk.EkCert != "" {
			cert, err := parseCertificate(sk.EkCert)
			if err != nil {
				return identityEntry{}, fmt.Errorf("signing key certificate: %w", err)
			}
			e.akCert = cert.Raw
		}
	}
	return e, nil
}

// identity parses an entry again: every caller gets keys and certificates of its own.
func (e identityEntry) identity(instanceID string) (*ShieldedIdentity, error) {
	ek, err := x509.ParsePKIXPublicKey(e.ek)
	if err != nil {
		return nil, err
	}
	out := &ShieldedIdentity{InstanceID: instanceID, EK: ek.(*rsa.PublicKey)}
	if e.ekCert != nil {
		if out.EKCertificate, err = x509.ParseCertificate(e.ekCert); err != nil {
			return nil, err
		}
	}
	if e.ak != nil {
		if out.AK, err = x509.ParsePKIXPublicKey(e.ak); err != nil {
			return nil, err
		}
	}
	if e.akCert != nil {
		if out.AKCertificate, err = x509.ParseCertificate(e.akCert); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// parsePublicKey reads one PEM "PUBLIC KEY" block (a SubjectPublicKeyInfo), as the API sends keys.
func parsePublicKey(s string) (crypto.PublicKey, error) {
	der, err := pemBlock(s, "PUBLIC KEY")
	if err != nil {
		return nil, err
	}
	pub, err := x509.ParsePKIXPublicKey(der)
	if err != nil {
		return nil, fmt.Errorf("not a SubjectPublicKeyInfo: %w", err)
	}
	return pub, nil
}

func parseCertificate(s string) (*x509.Certificate, error) {
	der, err := pemBlock(s, "CERTIFICATE")
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("not an X.509 certificate: %w", err)
	}
	return cert, nil
}

// pemBlock returns the bytes of the one PEM block of type typ that s holds.
func pemBlock(s, typ string) ([]byte, error) {
	if len(s) > maxPEMLen {
		return nil, fmt.Errorf("%d bytes of PEM, more than %d", len(s), maxPEMLen)
	}
	block, rest := pem.Decode([]byte(s))
	if block == nil {
		return nil, errors.New("not PEM")
	}
	if block.Type != typ {
		return nil, fmt.Errorf("PEM block is %q, not %q", bounded(block.Type), typ)
	}
	if strings.TrimSpace(string(rest)) != "" {
		return nil, errors.New("more than one PEM block")
	}
	return block.Bytes, nil
}

func keyKind(pub crypto.PublicKey) string {
	switch k := pub.(type) {
	case *ecdsa.PublicKey:
		return "ECDSA " + k.Curve.Params().Name
	case *rsa.PublicKey:
		return "RSA"
	}
	return fmt.Sprintf("a %T", pub)
}
