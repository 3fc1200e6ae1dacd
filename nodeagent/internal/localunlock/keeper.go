package localunlock

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
)

// Keeper owns every rule of a node's local unlock: which policy its disk key is sealed to after each kind
// of boot, when it is sealed again, and where the policy it follows is recorded. The agent tells it the
// disk key whenever one is set and asks it to unlock; it decides the rest.
type Keeper struct {
	unlocker          *Unlocker
	role              metadata.Role
	policyFile        string
	initialPolicyFile string
	observer          SealObserver
	log               *slog.Logger

	mu sync.Mutex
	// key is the disk key once it is set in this boot.
	key []byte
}

// KeeperConfig configures a Keeper.
type KeeperConfig struct {
	TPM  TPM
	Disk Disk
	// Role is the node's role: its key is sealed to the policy's images for that role.
	Role metadata.Role
	// PolicyFile is where the node's unlock policy is recorded: the join ticket's at first, then every
	// policy the key is sealed to. InitialPolicyFile is the init request's policy, which a node that
	// initialized its cluster seals to until it learns another.
	PolicyFile, InitialPolicyFile string
	// Observer learns every seal's outcome, for the node's metrics; nil for none.
	Observer SealObserver
	Logger   *slog.Logger
}

// SealObserver learns the outcome of each seal: a failure costs the node its local unlock at the next boot
// without failing this one, so it is seen only in the log and here.
type SealObserver interface {
	Sealed(err error, took time.Duration, at time.Time)
}

// NewKeeper returns the keeper of a node that seals its key.
func NewKeeper(cfg KeeperConfig) *Keeper {
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Keeper{
		unlocker: &Unlocker{TPM: cfg.TPM, Disk: cfg.Disk, Role: cfg.Role, Logger: log},
		role:     cfg.Role, policyFile: cfg.PolicyFile, initialPolicyFile: cfg.InitialPolicyFile, observer: cfg.Observer, log: log,
	}
}

// SetKey tells the keeper the disk key set in this boot, which it seals from then on.
func (k *Keeper) SetKey(key []byte) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.key = bytes.Clone(key)
}

// Unlock unseals the disk key from the TPM (Unlocker.Unlock).
func (k *Keeper) Unlock(ctx context.Context) (key []byte, image string, err error) {
	return k.unlocker.Unlock(ctx)
}

// SealAfterBoot seals the disk key to the policy this boot learnt: a rejoin ticket's, else the newest the
// node learnt before (the recorded policy, then the init request's). A node that unlocked from its TPM does
// not call it: its key is sealed already, and to a policy no older than the recorded one. A control-plane
// node seals again when its join service loads the policy (Follow), a worker at its next refresh
// (Refresh). A failure to seal costs the node its local unlock, not its membership: it is logged.
func (k *Keeper) SealAfterBoot(ctx context.Context, ticketPolicy []byte) {
	doc := ticketPolicy
	if doc == nil {
		for _, path := range []string{k.policyFile, k.initialPolicyFile} {
			data, err := os.ReadFile(path)
			if err == nil {
				doc = data
				break
			}
			if !errors.Is(err, os.ErrNotExist) {
				k.log.Warn("reading the unlock policy", "error", err)
			}
		}
	}
	if doc != nil {
		k.SealTo(ctx, doc)
	}
}

// SealTo seals the disk key to the policy document doc, cut to the node's role.
func (k *Keeper) SealTo(ctx context.Context, doc []byte) {
	p, err := policy.Parse(doc)
	if err != nil {
		k.log.Warn("the unlock policy does not parse; the disk key stays sealed as it was", "error", err)
		return
	}
	k.seal(ctx, p.ForRole(k.role, time.Now()))
}

// seal seals the disk key to p, after recording p as the node's unlock policy: a later boot that does not
// unlock from the TPM (an operator's recovery) then seals to it rather than to the join ticket's, which may
// still allow images dropped since.
func (k *Keeper) seal(ctx context.Context, p *policy.Policy) {
	k.mu.Lock()
	key := k.key
	k.mu.Unlock()
	start := time.Now()
	if key == nil {
		k.log.Error("sealing the disk key: no key was set in this boot")
		k.observe(errors.New("no key"), start)
		return
	}
	if err := k.record(p); err != nil {
		// Sealing to p still drops what p dropped; only a recovery would seal to an older policy.
		k.log.Warn("recording the unlock policy failed; a recovery would seal the disk key to an older one", "error", err)
	}
	err := k.unlocker.Seal(ctx, key, p)
	if err != nil {
		k.log.Warn("sealing the disk key failed; the next boot unlocks with a rejoin ticket", "error", err)
	}
	k.observe(err, start)
}

func (k *Keeper) observe(err error, start time.Time) {
	if k.observer != nil {
		now := time.Now()
		k.observer.Sealed(err, now.Sub(start), now)
	}
}

// record writes p to the unlock policy file unless the file holds it already.
func (k *Keeper) record(p *policy.Policy) error {
	doc, err := p.Marshal()
	if err != nil {
		return err
	}
	if old, err := os.ReadFile(k.policyFile); err == nil && bytes.Equal(old, doc) {
		return nil
	}
	return nodestate.WriteFile(k.policyFile, doc, 0o600)
}

// Follow seals the disk key again whenever store's policy changes, and when an image it was sealed to
// expires, until ctx ends: a control-plane node follows its join service's policy. changed is the store's
// Changed from before the first policy was loaded.
func (k *Keeper) Follow(ctx context.Context, store *policy.Store, changed <-chan struct{}) {
	var expiry <-chan time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-changed:
			changed = store.Changed()
		case <-expiry:
		}
		now := time.Now()
		p := store.Load().ForRole(k.role, now)
		k.seal(ctx, p)
		expiry = nil
		if next, ok := nextExpiry(p, now); ok {
			expiry = time.After(next.Sub(now))
		}
	}
}

// Refresh asks current for the node's unlock policy every interval and seals the key to it, until ctx
// ends: a worker asks the join service through an attested rejoin exchange. A document of nil changes
// nothing.
func (k *Keeper) Refresh(ctx context.Context, every time.Duration, current func(context.Context) ([]byte, error)) {
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		doc, err := current(ctx)
		if err != nil {
			if ctx.Err() == nil {
				k.log.Warn("asking for the current unlock policy", "error", err)
			}
			continue
		}
		if len(doc) > 0 {
			k.SealTo(ctx, doc)
		}
	}
}

// nextExpiry is the earliest expiry among p's images after now.
func nextExpiry(p *policy.Policy, now time.Time) (time.Time, bool) {
	var next time.Time
	for _, img := range p.Images {
		if img.Expires != nil && img.Expires.After(now) && (next.IsZero() || img.Expires.Before(next)) {
			next = *img.Expires
		}
	}
	return next, !next.IsZero()
}
