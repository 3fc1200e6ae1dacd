// Package localunlock lets a node unlock its state disk from its own TPM, without the network, but only
// while it runs an image that the join policy allows for its role.
//
// After a node has its disk key (from a join or rejoin ticket, an init, or a recovery) it seals the key in
// its TPM under a policy that only the PCR values of the policy's images for its role satisfy — images it has
// never booted included, since the values come from the policy, computed offline. The sealed key and the
// policy it was sealed to live on the disk itself, in a LUKS2 token (statedisk.StoreSealedKey). When the
// join policy changes, the node seals again, so an image dropped from the policy stops unlocking at once.
//
// The TPM enforces the measurements but knows no wall clock, so an image's expiry is enforced here: what is
// sealed is the disk key together with the SHA-256 of the policy document stored beside it, so that the
// stored document (and the expiry it gives each image) is authentic once the key unseals; the image whose
// PCRs this boot matches must not have expired.
package localunlock

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/google/go-tpm/tpm2/transport"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/nodeagent/internal/statedisk"
	"github.com/berthlabs/berth/nodeagent/internal/tpmseal"
)

// TPM runs commands on the node's TPM (attest.Prover, which shares it with attestation).
type TPM interface {
	UseTPM(f func(transport.TPM) error) error
}

// Disk stores sealed keys (statedisk.Disk).
type Disk interface {
	SealedKeys(ctx context.Context) ([]statedisk.SealedKey, error)
	StoreSealedKey(ctx context.Context, data json.RawMessage) error
	PruneSealedKeys(ctx context.Context, newest uint64) error
	RemoveSealedKeys(ctx context.Context) error
}

// ErrNothingSealed reports a disk without a sealed key: the node never sealed one, or its policy allowed
// no image for its role when it last sealed.
var ErrNothingSealed = errors.New("no key is sealed on the state disk")

// recordVersion is the layout of a stored sealed key.
const recordVersion = 1

// keySize is the size of a disk key: the derived keys are 32 bytes.
const keySize = 32

// record is one sealed key as stored on the disk.
type record struct {
	Version int           `json:"version"`
	Role    metadata.Role `json:"role"`
	// Policy is the join policy document, cut to the role, that the key is sealed to.
	Policy []byte `json:"policy"`
	// Public and Private are the TPM's sealed object.
	Public  []byte `json:"public"`
	Private []byte `json:"private"`
}

// Unlocker seals and unseals one node's disk key.
type Unlocker struct {
	TPM    TPM
	Disk   Disk
	Role   metadata.Role
	Clock  func() time.Time
	Logger *slog.Logger

	mu sync.Mutex
	// current is the SHA-256 of the policy document that a sealed key which this TPM opens follows, once
	// this process knows one (it unsealed it or sealed it); Seal skips a policy it already follows.
	current []byte
}

func (u *Unlocker) now() time.Time {
	if u.Clock == nil {
		return time.Now()
	}
	return u.Clock()
}

func (u *Unlocker) log() *slog.Logger {
	if u.Logger == nil {
		return slog.New(slog.DiscardHandler)
	}
	return u.Logger
}

// Unlock returns the disk key from the newest stored sealed key, if this TPM unseals it at this boot's
// measurements, and the image that the measurements matched. Older sealed keys follow policies that were
// replaced (a node that dies while it reseals keeps both): they are never used, and are removed once the
// newest has unsealed. Unlock fails with ErrNothingSealed when no key is stored; otherwise its error says
// why the newest did not unseal (the PCR, expected and got; another or a cleared TPM; an expired image).
func (u *Unlocker) Unlock(ctx context.Context) (key []byte, image string, err error) {
	stored, err := u.Disk.SealedKeys(ctx)
	if err != nil {
		return nil, "", err
	}
	if len(stored) == 0 {
		return nil, "", ErrNothingSealed
	}
	newest := stored[0]
	key, image, digest, err := u.unseal(newest.Data)
	if err != nil {
		return nil, "", fmt.Errorf("sealed key %d: %w", newest.Seq, err)
	}
	if len(stored) > 1 {
		if err := u.Disk.PruneSealedKeys(ctx, newest.Seq); err != nil {
			return nil, "", err
		}
	}
	u.mu.Lock()
	u.current = digest
	u.mu.Unlock()
	return key, image, nil
}

func (u *Unlocker) unseal(data []byte) (key []byte, image string, digest []byte, err error) {
	var rec record
	if err := json.Unmarshal(data, &rec); err != nil {
		return nil, "", nil, fmt.Errorf("reading it: %w", err)
	}
	if rec.Version != recordVersion {
		return nil, "", nil, fmt.Errorf("it has layout version %d, this agent reads %d", rec.Version, recordVersion)
	}
	p, err := policy.Parse(rec.Policy)
	if err != nil {
		return nil, "", nil, fmt.Errorf("its policy: %w", err)
	}
	var secret []byte
	var branch int
	err = u.TPM.UseTPM(func(tpm transport.TPM) error {
		var err error
		secret, branch, err = tpmseal.Unseal(tpm, &tpmseal.Sealed{Public: rec.Public, Private: rec.Private}, branches(p))
		return err
	})
	if err != nil {
		return nil, "", nil, err
	}
	sum := sha256.Sum256(rec.Policy)
	if len(secret) != keySize+len(sum) || !bytes.Equal(secret[keySize:], sum[:]) {
		return nil, "", nil, errors.New("the policy stored beside it is not the one it was sealed with")
	}
	img := p.Images[branch]
	if img.Expires != nil && u.now().After(*img.Expires) {
		return nil, "", nil, fmt.Errorf("this boot's image %q expired at %s", img.Name, img.Expires.Format(time.RFC3339))
	}
	return secret[:keySize], img.Name, sum[:], nil
}

// Seal seals key to p, the join policy cut to the node's role (policy.ForRole), and stores it as the newest
// sealed key. It does nothing when the node already follows p. A policy without images removes every sealed
// key: no image may unlock the disk locally any more.
func (u *Unlocker) Seal(ctx context.Context, key []byte, p *policy.Policy) error {
	if len(key) != keySize {
		return fmt.Errorf("sealing the disk key: it is %d bytes, want %d", len(key), keySize)
	}
	doc, err := p.Marshal()
	if err != nil {
		return fmt.Errorf("sealing the disk key: %w", err)
	}
	sum := sha256.Sum256(doc)
	u.mu.Lock()
	defer u.mu.Unlock()
	if bytes.Equal(u.current, sum[:]) {
		return nil
	}
	if len(p.Images) == 0 {
		if err := u.Disk.RemoveSealedKeys(ctx); err != nil {
			return err
		}
		u.current = sum[:]
		u.log().Warn("the join policy allows no image for this role: local unlock is off until it does")
		return nil
	}
	var sealed *tpmseal.Sealed
	err = u.TPM.UseTPM(func(tpm transport.TPM) error {
		sealed, err = tpmseal.Seal(tpm, append(bytes.Clone(key), sum[:]...), branches(p))
		return err
	})
	if err != nil {
		return fmt.Errorf("sealing the disk key: %w", err)
	}
	data, err := json.Marshal(record{Version: recordVersion, Role: u.Role, Policy: doc, Public: sealed.Public, Private: sealed.Private})
	if err != nil {
		return fmt.Errorf("sealing the disk key: %w", err)
	}
	if err := u.Disk.StoreSealedKey(ctx, data); err != nil {
		return err
	}
	u.current = sum[:]
	names := make([]string, len(p.Images))
	for i, img := range p.Images {
		names[i] = img.Name
	}
	u.log().Info("disk key sealed to the join policy", "images", names)
	return nil
}

func branches(p *policy.Policy) []tpmseal.Branch {
	out := make([]tpmseal.Branch, len(p.Images))
	for i, img := range p.Images {
		out[i] = tpmseal.Branch{Name: img.Name, PCRs: img.PCRs}
	}
	return out
}
