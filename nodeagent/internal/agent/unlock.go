package agent

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"google.golang.org/grpc"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/nodeagent/internal/joinclient"
	"github.com/berthlabs/berth/nodeagent/internal/localunlock"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
	"github.com/berthlabs/berth/nodeagent/internal/recoveryserver"
)

// localUnlocker is the node's local unlock, nil when it does not seal; a node whose local unlock was turned
// off loses the keys it sealed before, so that it no longer unlocks from its TPM.
func (a *Agent) localUnlocker(ctx context.Context, prover Prover, role metadata.Role, log *slog.Logger) (*localunlock.Unlocker, error) {
	if !a.cfg.sealsLocally(role) {
		return nil, a.disk.RemoveSealedKeys(ctx)
	}
	a.unlock = &localunlock.Unlocker{TPM: prover, Disk: a.disk, Role: role, Logger: log.With("component", "local-unlock")}
	return a.unlock, nil
}

// unlockKeyed opens a disk that was keyed on an earlier boot: from the TPM when a key sealed there opens at
// this boot's measurements (unsealed), and otherwise with a rejoin ticket, whose unlock policy it returns,
// or by an operator's recovery, whichever comes first.
func (a *Agent) unlockKeyed(ctx context.Context, log *slog.Logger, jc *joinclient.Client, unlock *localunlock.Unlocker, prover Prover, self *metadata.Self, disk string) (unlockPolicy []byte, unsealed bool, err error) {
	if unlock != nil {
		key, image, err := unlock.Unlock(ctx)
		switch {
		case err == nil:
			if err := (unlockingDisk{a}).SetKey(ctx, nil, key); err != nil {
				log.Warn("the key unsealed from the TPM does not open the state disk; asking for a rejoin ticket", "disk", disk, "error", err)
				break
			}
			log.Info("state disk unlocked from the TPM", "disk", disk, "image", image)
			return nil, true, nil
		case errors.Is(err, localunlock.ErrNothingSealed):
			log.Info("no key is sealed on the state disk; asking for a rejoin ticket", "disk", disk)
		default:
			log.Warn("local unlock refused; asking for a rejoin ticket", "disk", disk, "reason", err)
		}
	}
	log.Info("state disk was keyed on an earlier boot; asking for a rejoin ticket", "disk", disk)
	// Until a ticket comes, an operator may give the key back (berth-agent recover): when no join service
	// can help, that is the way back.
	rec, stop, err := a.startRecoveryServer(prover, self, disk, log)
	if err != nil {
		return nil, false, err
	}
	defer stop()
	type rejoined struct {
		ticket *berthv1.RejoinTicket
		err    error
	}
	done := make(chan rejoined, 1)
	go func() {
		t, err := jc.Rejoin(ctx, disk)
		done <- rejoined{t, err}
	}()
	select {
	case r := <-done:
		if r.err != nil {
			return nil, false, r.err
		}
		// No recovery may set the key at the same time.
		stop()
		if err := (unlockingDisk{a}).SetKey(ctx, nil, r.ticket.DiskKey); err != nil {
			return nil, false, fmt.Errorf("unlocking the state disk: %w", err)
		}
		return r.ticket.UnlockPolicy, false, nil
	case <-rec.Done():
		jc.Stop()
		<-done
		log.Info("state disk unlocked by the operator's recovery; rejoin stopped", "disk", disk)
		return nil, false, nil
	case <-ctx.Done():
		return nil, false, ctx.Err()
	}
}

// startRecoveryServer serves RecoveryService on the init server's address, for a keyed disk's boot.
func (a *Agent) startRecoveryServer(prover Prover, self *metadata.Self, disk string, log *slog.Logger) (*recoveryserver.Server, func(), error) {
	srv, err := recoveryserver.New(recoveryserver.Config{Prover: prover, Disk: unlockingDisk{a}, DiskUUID: disk,
		Self: &self.Instance, Logger: log.With("component", "recovery")})
	if err != nil {
		return nil, nil, err
	}
	stop, err := a.serveOnInitPort(func(gs *grpc.Server) { berthv1.RegisterRecoveryServiceServer(gs, srv) },
		recoveryserver.DefaultTimeout, 10*time.Second)
	if err != nil {
		return nil, nil, fmt.Errorf("recovery server: %w", err)
	}
	log.Info("recovery server listening: an operator can recover this node with berth-agent recover", "address", a.cfg.InitListen)
	var once sync.Once
	return srv, func() { once.Do(stop) }, nil
}

// sealAfterBoot seals the disk key to the policy this boot learnt: a rejoin ticket's, else the newest the node
// learnt before, which the state directory holds (what seal last recorded, the join ticket's, or the init
// request's). A node that unlocked from its TPM does not call it: its key is sealed already, and to a
// policy no older than the state directory's. A control-plane node seals again when its join service loads
// the policy, a worker at its next refresh. A failure to seal costs the node its local unlock, not its
// membership: it is logged.
func (a *Agent) sealAfterBoot(ctx context.Context, log *slog.Logger, unlock *localunlock.Unlocker, role metadata.Role, ticketPolicy []byte) {
	doc := ticketPolicy
	if doc == nil {
		for _, name := range []string{joinclient.UnlockPolicyFile, InitialPolicyFile} {
			data, err := os.ReadFile(filepath.Join(a.cfg.Paths.State, name))
			if err == nil {
				doc = data
				break
			}
			if !errors.Is(err, os.ErrNotExist) {
				log.Warn("reading the unlock policy", "error", err)
			}
		}
	}
	if doc != nil {
		a.sealTo(ctx, log, unlock, role, doc)
	}
}

// sealTo seals the disk key to the policy document doc, cut to role.
func (a *Agent) sealTo(ctx context.Context, log *slog.Logger, unlock *localunlock.Unlocker, role metadata.Role, doc []byte) {
	p, err := policy.Parse(doc)
	if err != nil {
		log.Warn("the unlock policy does not parse; the disk key stays sealed as it was", "error", err)
		return
	}
	a.seal(ctx, log, unlock, p.ForRole(role, time.Now()))
}

// seal seals the disk key to p, after recording p as the node's unlock policy: a later boot that does not
// unlock from the TPM (an operator's recovery) then seals to it rather than to the join ticket's, which may
// still allow images dropped since.
func (a *Agent) seal(ctx context.Context, log *slog.Logger, unlock *localunlock.Unlocker, p *policy.Policy) {
	if a.key == nil {
		log.Error("sealing the disk key: no key was set in this boot")
		return
	}
	if err := a.recordUnlockPolicy(p); err != nil {
		// Sealing to p still drops what p dropped; only a recovery would seal to an older policy.
		log.Warn("recording the unlock policy failed; a recovery would seal the disk key to an older one", "error", err)
	}
	if err := unlock.Seal(ctx, a.key, p); err != nil {
		log.Warn("sealing the disk key failed; the next boot unlocks with a rejoin ticket", "error", err)
	}
}

// recordUnlockPolicy writes p to the state directory's unlock policy file unless the file holds it already.
func (a *Agent) recordUnlockPolicy(p *policy.Policy) error {
	doc, err := p.Marshal()
	if err != nil {
		return err
	}
	path := filepath.Join(a.cfg.Paths.State, joinclient.UnlockPolicyFile)
	if old, err := os.ReadFile(path); err == nil && bytes.Equal(old, doc) {
		return nil
	}
	return nodestate.WriteFile(path, doc, 0o600)
}

// followPolicy is how a control-plane node's join service keeps the node's sealed key following its policy;
// nil when the node does not seal.
func (a *Agent) followPolicy(log *slog.Logger) func(context.Context, *policy.Store, <-chan struct{}) {
	if a.unlock == nil {
		return nil
	}
	return func(ctx context.Context, store *policy.Store, changed <-chan struct{}) {
		a.resealOnPolicy(ctx, log.With("component", "local-unlock"), a.unlock, metadata.RoleControlPlane, store, changed)
	}
}

// resealOnPolicy seals the disk key again whenever the join service's policy changes, and when an image
// it was sealed to expires, until ctx ends.
func (a *Agent) resealOnPolicy(ctx context.Context, log *slog.Logger, unlock *localunlock.Unlocker, role metadata.Role, store *policy.Store, changed <-chan struct{}) {
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
		p := store.Load().ForRole(role, now)
		a.seal(ctx, log, unlock, p)
		expiry = nil
		if next, ok := nextExpiry(p, now); ok {
			expiry = time.After(next.Sub(now))
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

// refreshSeal asks the join service, through an attested rejoin exchange, for the worker's current unlock
// policy every LocalUnlockRefresh, and seals the key to it, until ctx ends.
func (a *Agent) refreshSeal(ctx context.Context, log *slog.Logger, jc *joinclient.Client, unlock *localunlock.Unlocker, disk string) {
	tick := time.NewTicker(a.cfg.LocalUnlockRefresh.Duration)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		ticket, err := jc.Rejoin(ctx, disk)
		if err != nil {
			if ctx.Err() == nil {
				log.Warn("asking for the current unlock policy", "error", err)
			}
			continue
		}
		if len(ticket.UnlockPolicy) > 0 {
			a.sealTo(ctx, log, unlock, metadata.RoleWorker, ticket.UnlockPolicy)
		}
	}
}
