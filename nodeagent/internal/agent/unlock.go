package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"sync"
	"time"

	"google.golang.org/grpc"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/nodeagent/internal/joinclient"
	"github.com/berthlabs/berth/nodeagent/internal/localunlock"
	"github.com/berthlabs/berth/nodeagent/internal/recoveryserver"
)

// localUnlock is the keeper of the node's local unlock, nil when it does not seal; a node whose local unlock
// was turned off loses the keys it sealed before, so that it no longer unlocks from its TPM.
func (a *Agent) localUnlock(ctx context.Context, prover Prover, role metadata.Role, log *slog.Logger) (*localunlock.Keeper, error) {
	if !a.cfg.sealsLocally(role) {
		return nil, a.disk.RemoveSealedKeys(ctx)
	}
	var observer localunlock.SealObserver
	if a.telemetry.metrics != nil {
		observer = a.telemetry.metrics
	}
	a.keeper = localunlock.NewKeeper(localunlock.KeeperConfig{TPM: prover, Disk: a.disk, Role: role, Observer: observer,
		PolicyFile:        filepath.Join(a.cfg.Paths.State, joinclient.UnlockPolicyFile),
		InitialPolicyFile: filepath.Join(a.cfg.Paths.State, InitialPolicyFile),
		Logger:            log.With("component", "local-unlock")})
	return a.keeper, nil
}

// followPolicy is how a control-plane node's join service keeps the node's sealed key following its policy;
// nil when the node does not seal.
func (a *Agent) followPolicy() func(context.Context, *policy.Store, <-chan struct{}) {
	if a.keeper == nil {
		return nil
	}
	return a.keeper.Follow
}

// refreshSeal keeps a sealing worker's key sealed to its current unlock policy, which it asks the join
// service for every LocalUnlockRefresh through an attested rejoin exchange, until ctx ends.
func (a *Agent) refreshSeal(ctx context.Context, jc *joinclient.Client, keeper *localunlock.Keeper, disk string) {
	keeper.Refresh(ctx, a.cfg.LocalUnlockRefresh.Duration, func(ctx context.Context) ([]byte, error) {
		ticket, err := jc.Rejoin(ctx, disk)
		if err != nil {
			return nil, err
		}
		return ticket.UnlockPolicy, nil
	})
}

// How a boot opened its state disk, as berth_state_disk_unlock_duration_seconds labels it.
const (
	unlockedNewDisk  = "new_disk"
	unlockedTPM      = "tpm"
	unlockedRejoin   = "rejoin_ticket"
	unlockedRecovery = "recovery"
)

var unlockVias = []string{unlockedNewDisk, unlockedTPM, unlockedRejoin, unlockedRecovery}

// Why a sealing node's TPM did not open its state disk, as berth_local_unlock_fallbacks_total labels it:
// nothing sealed (the first boot after its join, or sealing failed), the TPM refused to unseal (the boot's
// measurements are not among the images the key was sealed to), or the unsealed key did not open the disk.
var localUnlockFallbacks = []string{"nothing_sealed", "refused", "wrong_key"}

// unlockKeyed opens a disk that was keyed on an earlier boot: from the TPM when a key sealed there opens at
// this boot's measurements, and otherwise with a rejoin ticket, whose unlock policy it returns, or by an
// operator's recovery, whichever comes first. via says which (unlockVias).
func (a *Agent) unlockKeyed(ctx context.Context, log *slog.Logger, jc *joinclient.Client, unlock *localunlock.Keeper, prover Prover, self *metadata.Self, disk string) (unlockPolicy []byte, via string, err error) {
	if unlock != nil {
		key, image, err := unlock.Unlock(ctx)
		switch {
		case err == nil:
			if err := (unlockingDisk{a}).SetKey(ctx, nil, key); err != nil {
				log.Warn("the key unsealed from the TPM does not open the state disk; asking for a rejoin ticket", "disk", disk, "error", err)
				a.telemetry.metrics.LocalUnlockFellBack("wrong_key")
				break
			}
			log.Info("state disk unlocked from the TPM", "disk", disk, "image", image)
			return nil, unlockedTPM, nil
		case errors.Is(err, localunlock.ErrNothingSealed):
			log.Info("no key is sealed on the state disk; asking for a rejoin ticket", "disk", disk)
			a.telemetry.metrics.LocalUnlockFellBack("nothing_sealed")
		default:
			log.Warn("local unlock refused; asking for a rejoin ticket", "disk", disk, "reason", err)
			a.telemetry.metrics.LocalUnlockFellBack("refused")
		}
	}
	log.Info("state disk was keyed on an earlier boot; asking for a rejoin ticket", "disk", disk)
	// Until a ticket comes, an operator may give the key back (berth-agent recover): when no join service
	// can help, that is the way back.
	rec, stop, err := a.startRecoveryServer(ctx, prover, self, disk, log)
	if err != nil {
		return nil, "", err
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
			return nil, "", r.err
		}
		// No recovery may set the key at the same time.
		stop()
		if err := (unlockingDisk{a}).SetKey(ctx, nil, r.ticket.DiskKey); err != nil {
			return nil, "", fmt.Errorf("unlocking the state disk: %w", err)
		}
		return r.ticket.UnlockPolicy, unlockedRejoin, nil
	case <-rec.Done():
		jc.Stop()
		<-done
		log.Info("state disk unlocked by the operator's recovery; rejoin stopped", "disk", disk)
		return nil, unlockedRecovery, nil
	case <-ctx.Done():
		jc.Stop()
		<-done
		return nil, "", ctx.Err()
	}
}

// startRecoveryServer serves RecoveryService on the init server's address, for a keyed disk's boot.
func (a *Agent) startRecoveryServer(ctx context.Context, prover Prover, self *metadata.Self, disk string, log *slog.Logger) (*recoveryserver.Server, func(), error) {
	admission, err := a.disk.RecoveryAdmissionKey(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("recovery server: %w", err)
	}
	if admission == nil {
		log.Warn("the state disk keeps no recovery admission key (its keying was interrupted): the recovery server quotes for anyone who says hello", "disk", disk)
	}
	srv, err := recoveryserver.New(recoveryserver.Config{Prover: prover, Disk: unlockingDisk{a}, DiskUUID: disk,
		AdmissionKey: admission, Self: &self.Instance, Logger: log.With("component", "recovery")})
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
