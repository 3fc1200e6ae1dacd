package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/nodeagent/internal/joinclient"
	"github.com/berthlabs/berth/nodeagent/internal/kubelet"
	"github.com/berthlabs/berth/nodeagent/internal/localunlock"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
	"github.com/berthlabs/berth/nodeagent/internal/statedisk"
	"github.com/berthlabs/berth/nodeagent/internal/verifiedroot"
)

// boot is one run of Boot: what its steps learn and hand on, and the work it started. It owns every
// goroutine it starts (running): Boot cancels them and waits for them before it returns, so none outlives
// the boot or uses the TPM after Boot closed it.
type boot struct {
	a   *Agent
	log *slog.Logger

	prover   Prover
	self     *metadata.Self
	prepared statedisk.Prepared
	lock     *nodestate.Lock
	jc       *joinclient.Client
	keeper   *localunlock.Keeper
	// unlockPolicy is what the node learnt in this boot that it may seal its key to, if anything; unsealed
	// says the key came from its TPM, where it is sealed already, to the policy the node followed last.
	unlockPolicy []byte
	unsealed     bool
	// duties counts the work that goes on while the node runs and keeps the agent up.
	duties int

	running     sync.WaitGroup
	kubeletDone chan error
}

// step is one named part of a boot; the name is also its label in the metrics (berth_boot_step).
type step struct {
	name string
	run  func(context.Context) error
}

// steps are the boot's steps, in their order.
func (b *boot) steps() []step {
	return []step{
		{"verified_root", b.readRoot},
		{"tpm", b.openTPM},
		{"metadata", b.readSelf},
		{"state_disk", b.prepareDisk},
		{"local_unlock", b.setUpLocalUnlock},
		{"membership", b.becomeMember},
		{"seal", b.seal},
		{"duties", b.startDuties},
	}
}

// bootSteps are the steps' names, the fixed label values of the boot metrics.
func bootSteps() []string {
	var names []string
	for _, s := range (&boot{}).steps() {
		names = append(names, s.name)
	}
	return names
}

// Boot makes this node a cluster member (or a member again), then, on control-plane nodes, serves the join
// service until ctx ends. It runs as named steps, each logged at debug level when it starts and shown in the
// metrics while it runs; a step's failure ends the boot with the step's own error. The metrics server is the
// process's: it serves until ctx ends, after the boot too.
func (a *Agent) Boot(ctx context.Context) error {
	// This line and the instance's below mark where a boot's time goes (the lab's join figures read them).
	a.log.Info("boot started", "state_disk", a.cfg.StateDisk)
	tel, err := a.startTelemetry(ctx)
	if err != nil {
		return err
	}
	metrics := tel.metrics
	b := &boot{a: a, log: a.log, kubeletDone: make(chan error, 1)}
	defer b.closeTPM()
	ctx, cancel := context.WithCancel(ctx)
	defer func() {
		cancel()
		b.running.Wait()
	}()
	for _, s := range b.steps() {
		b.log.Debug("boot step", "step", s.name)
		start := time.Now()
		metrics.BootStepStarted(s.name)
		if err := s.run(ctx); err != nil {
			return err
		}
		metrics.BootStepDone(s.name, time.Since(start))
	}
	metrics.BootFinished(time.Now())
	b.log.Info("boot finished")
	err = b.serve(ctx)
	// The kubelet stops with the boot; what it said on its way out is its supervisor's to log.
	cancel()
	<-b.kubeletDone
	return err
}

// readRoot reads the verified root end to end before anything is attested (package verifiedroot).
func (b *boot) readRoot(ctx context.Context) error {
	dev := b.a.cfg.VerifiedRoot
	if dev == "none" {
		return nil
	}
	start := time.Now()
	n, err := verifiedroot.Read(ctx, dev)
	switch {
	case errors.Is(err, verifiedroot.ErrAbsent):
		b.log.Info("no verified root: this image's root file system is not covered by its measurements", "device", dev)
		return nil
	case err != nil:
		return err
	}
	b.log.Info("verified root read", "device", dev, "bytes", n, "duration", time.Since(start).Round(time.Millisecond).String())
	return nil
}

func (b *boot) openTPM(context.Context) error {
	prover, err := b.a.deps.OpenProver(b.a.cfg.TPM)
	if err != nil {
		return fmt.Errorf("opening the TPM: %w", err)
	}
	b.prover = prover
	return nil
}

func (b *boot) closeTPM() {
	if b.prover != nil {
		b.prover.Close()
	}
}

func (b *boot) readSelf(ctx context.Context) error {
	self, err := b.a.self(ctx)
	if err != nil {
		return err
	}
	b.self = self
	b.log = b.a.log.With("node", self.Instance.Name, "role", string(self.Instance.Role))
	b.log.Info("instance metadata read", "image", self.Instance.ImageID)
	return nil
}

func (b *boot) prepareDisk(ctx context.Context) error {
	prepared, err := b.a.disk.Prepare(ctx)
	if err != nil {
		return err
	}
	b.prepared = prepared
	b.lock = &nodestate.Lock{}
	// The join client names the node in its own lines.
	b.jc = b.a.joinClient(b.prover, b.lock, b.a.log)
	return nil
}

func (b *boot) setUpLocalUnlock(ctx context.Context) error {
	keeper, err := b.a.localUnlock(ctx, b.prover, b.self.Instance.Role, b.log)
	b.keeper = keeper
	return err
}

// startKubelet starts the kubelet's supervisor, on machines where the agent runs the kubelet; kubeadm waits
// for a running kubelet during init and join, and the supervisor starts it as soon as kubeadm has written
// its configuration.
func (b *boot) startKubelet(ctx context.Context) {
	cfg := b.a.cfg
	if !cfg.Kubelet.Run {
		b.kubeletDone <- nil
		return
	}
	sup := &kubelet.Supervisor{Binary: cfg.Kubelet.Binary, Paths: cfg.Paths, ExtraArgs: cfg.Kubelet.ExtraArgs, Logger: b.log}
	b.running.Go(func() { b.kubeletDone <- sup.Run(ctx) })
}

// becomeMember makes the node a member: a fresh disk's node joins or is initialized; a keyed disk's node
// unlocks it, from its TPM, a rejoin ticket or an operator's recovery, and joins again if an earlier boot
// died before its join finished.
func (b *boot) becomeMember(ctx context.Context) error {
	a, log := b.a, b.log
	metrics, start := a.telemetry.metrics, time.Now()
	if b.prepared.Fresh {
		b.startKubelet(ctx)
		if err := a.firstBoot(ctx, log, b.self, b.prepared, b.prover, b.lock, b.jc); err != nil {
			return err
		}
		metrics.StateDiskUnlocked(unlockedNewDisk, time.Since(start))
		return nil
	}
	unlockPolicy, via, err := a.unlockKeyed(ctx, log, b.jc, b.keeper, b.prover, b.self, b.prepared.UUID)
	if err != nil {
		return err
	}
	metrics.StateDiskUnlocked(via, time.Since(start))
	b.unlockPolicy, b.unsealed = unlockPolicy, via == unlockedTPM
	state, err := nodestate.Read(a.cfg.Paths.State)
	switch {
	case errors.Is(err, nodestate.ErrNoState):
		// An earlier boot keyed the disk and died before the join finished. The disk is this TPM's (the
		// service checked), so the node joins again; the join client clears what the kubeadm method
		// half-wrote, and the kubelet waits for the new join's configuration.
		log.Warn("the state disk was keyed but the node never finished joining; joining again")
		if err := kubelet.RemoveStartFiles(a.cfg.Paths); err != nil {
			return err
		}
		b.startKubelet(ctx)
		if _, err := b.jc.Join(ctx, statedisk.Prepared{UUID: b.prepared.UUID}); err != nil {
			return err
		}
		// The join ticket brought the current policy.
		b.unsealed = false
		return nil
	case err != nil:
		return fmt.Errorf("state disk unlocked but: %w", err)
	}
	b.startKubelet(ctx)
	log.Info("node rejoined", "cluster", state.ClusterID, "member_since", state.Since)
	return nil
}

// seal seals the disk key to what this boot learnt, unless the key came from the TPM.
func (b *boot) seal(ctx context.Context) error {
	if b.keeper != nil && !b.unsealed {
		b.keeper.SealAfterBoot(ctx, b.unlockPolicy)
	}
	return nil
}

// startDuties starts the work that goes on while the node runs: a sealing worker's refresh of its seal, the
// kubelet certificate's renewal where the join service signs it, a control-plane node's renewal of its
// kubeadm certificates and its part in Kubernetes upgrades.
func (b *boot) startDuties(ctx context.Context) error {
	if b.self.Instance.Role == metadata.RoleControlPlane {
		b.running.Go(func() { b.a.renewCertificates(ctx, b.self, b.log) })
		b.running.Go(func() { b.a.upgradeKubernetes(ctx, b.self, b.log) })
		b.duties += 2
	}
	if b.keeper != nil && b.self.Instance.Role != metadata.RoleControlPlane {
		b.running.Go(func() { b.a.refreshSeal(ctx, b.jc, b.keeper, b.prepared.UUID) })
		b.duties++
	}
	if state, err := nodestate.Read(b.a.cfg.Paths.State); err == nil && state.KubeletRenewal {
		b.running.Go(func() { b.a.renewKubeletCertificate(ctx, b.log, b.jc, b.prepared.UUID) })
		b.duties++
	}
	return nil
}

// serve is what the node does once it is a member: a control-plane node serves the join service; a node
// whose agent supervises the kubelet, or has duties, stays until ctx ends; any other is done.
func (b *boot) serve(ctx context.Context) error {
	switch {
	case b.self.Instance.Role == metadata.RoleControlPlane:
		return b.a.ServeJoinService(ctx)
	case b.a.cfg.Kubelet.Run || b.duties > 0:
		<-ctx.Done()
		return ctx.Err()
	}
	return nil
}
