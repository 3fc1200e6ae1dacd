package ec2instances

import (
	"context"
	"crypto/rsa"
	"crypto/x509"
	"encoding/base64"
	"fmt"
	"log/slog"
	"math/big"
	"regexp"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"
	"golang.org/x/time/rate"

	"github.com/berthlabs/berth/internal/cloud/ttlcache"
)

// ekBits is the size of the EK GetInstanceTpmEkPub is asked for (KeyType rsa-2048).
const ekBits = 2048

// maxKeyValueLen bounds the base64 key EC2 returns: an RSA-2048 SubjectPublicKeyInfo is 294 bytes.
const maxKeyValueLen = 4096

var instanceIDPattern = regexp.MustCompile(`^i-[0-9a-f]{8}([0-9a-f]{9})?$`)

// IsInstanceID reports whether id has the shape of an EC2 instance id (i- and 8 or 17 hex digits).
func IsInstanceID(id string) bool { return instanceIDPattern.MatchString(id) }

// EKs reports the EK public keys of instances' NitroTPMs. Every Lookup has one; alone, it serves callers
// that know the instance already (Terraform's init of the first control-plane node, by its instance id).
type EKs struct {
	api         API
	log         *slog.Logger
	callTimeout time.Duration
	rateLimit   rate.Limit
	rl          *rate.Limiter
	cache       *ttlcache.Cache[*rsa.PublicKey]
}

// NewEKs asks api, with the defaults of Config.
func NewEKs(api API, log *slog.Logger) *EKs {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return newEKs(api, log, time.Now, DefaultEKCacheTTL, DefaultEKCacheSize, DefaultCallTimeout, DefaultEKRate, DefaultBurst)
}

func newEKs(api API, log *slog.Logger, clock func() time.Time, ttl time.Duration, size int, callTimeout time.Duration, r rate.Limit, burst int) *EKs {
	return &EKs{api: api, log: log, callTimeout: callTimeout, rateLimit: r, rl: rate.NewLimiter(r, burst),
		cache: ttlcache.New[*rsa.PublicKey](clock, ttl, size)}
}

// EKPublic returns the public endorsement key of the NitroTPM of instance instanceID, as EC2 reports it
// (GetInstanceTpmEkPub, RSA 2048, DER). Keys are cached for the EK cache TTL, and concurrent requests for one
// instance share one call. Each caller gets its own copy of the key.
func (l *EKs) EKPublic(ctx context.Context, instanceID string) (*rsa.PublicKey, error) {
	if !IsInstanceID(instanceID) {
		return nil, fmt.Errorf("EC2 EK of %q: not an EC2 instance id (i- and 8 or 17 lowercase hex digits)", bounded(instanceID))
	}
	k, stopped, err := l.cache.Get(ctx, instanceID, l.callTimeout, func(ctx context.Context) (*rsa.PublicKey, error) {
		k, err := l.fetchEK(ctx, instanceID)
		if err != nil {
			l.log.Warn("EC2 EK request failed", "instance", instanceID, "error", err)
		}
		return k, err
	})
	switch {
	case stopped:
		return nil, fmt.Errorf("EC2 EK of %s: %w", instanceID, err)
	case err != nil:
		return nil, err
	}
	return copyKey(k), nil
}

func (l *EKs) fetchEK(ctx context.Context, id string) (*rsa.PublicKey, error) {
	if err := l.rl.Wait(ctx); err != nil {
		return nil, fmt.Errorf("EC2 EK of %s: the join service's own pacing of GetInstanceTpmEkPub (%v calls a second): %w", id, l.rateLimit, err)
	}
	out, err := l.api.GetInstanceTpmEkPub(ctx, &ec2.GetInstanceTpmEkPubInput{
		InstanceId: aws.String(id),
		KeyType:    types.EkPubKeyTypeRsa2048,
		KeyFormat:  types.EkPubKeyFormatDer,
	})
	if err != nil {
		return nil, fmt.Errorf("EC2 EK of %s: %w", id, apiError("GetInstanceTpmEkPub", err))
	}
	// An answer about another instance or another kind of key is a broken endpoint, not a key.
	if got := aws.ToString(out.InstanceId); got != "" && got != id {
		return nil, fmt.Errorf("EC2 EK of %s: the answer is about instance %q", id, bounded(got))
	}
	if out.KeyType != "" && out.KeyType != types.EkPubKeyTypeRsa2048 || out.KeyFormat != "" && out.KeyFormat != types.EkPubKeyFormatDer {
		return nil, fmt.Errorf("EC2 EK of %s: asked for an %s key in %s, got %q in %q", id,
			types.EkPubKeyTypeRsa2048, types.EkPubKeyFormatDer, bounded(string(out.KeyType)), bounded(string(out.KeyFormat)))
	}
	value := strings.TrimSpace(aws.ToString(out.KeyValue))
	if value == "" {
		return nil, fmt.Errorf("EC2 EK of %s: the answer holds no key", id)
	}
	if len(value) > maxKeyValueLen {
		return nil, fmt.Errorf("EC2 EK of %s: the key is %d bytes of base64, more than an RSA-%d key needs", id, len(value), ekBits)
	}
	der, err := base64.StdEncoding.DecodeString(value)
	if err != nil {
		return nil, fmt.Errorf("EC2 EK of %s: the key is not base64: %w", id, err)
	}
	pub, err := x509.ParsePKIXPublicKey(der)
	if err != nil {
		return nil, fmt.Errorf("EC2 EK of %s: the key is not a DER SubjectPublicKeyInfo: %w", id, err)
	}
	rsaPub, ok := pub.(*rsa.PublicKey)
	if !ok {
		return nil, fmt.Errorf("EC2 EK of %s: asked for an RSA key, got a %T", id, pub)
	}
	if n := rsaPub.N.BitLen(); n != ekBits {
		return nil, fmt.Errorf("EC2 EK of %s: asked for an RSA-%d key, got %d bits", id, ekBits, n)
	}
	return rsaPub, nil
}

// copyKey keeps callers from changing the cached key.
func copyKey(k *rsa.PublicKey) *rsa.PublicKey {
	return &rsa.PublicKey{N: new(big.Int).Set(k.N), E: k.E}
}
