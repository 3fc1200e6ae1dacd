// Package kubeupgrade carries a Kubernetes upgrade out on a control-plane node. The provider writes the
// cluster's target release into its record (clusterinfo.InstructUpgrade); the nodes of an image that carries
// the target's kubeadm, which join the cluster at its current release as the group rolls, then take the
// control-plane Lease one at a time: the first runs `kubeadm upgrade apply`, each later one `kubeadm upgrade
// node`, and once every node runs the target (the roll is over) one of them upgrades kube-proxy and CoreDNS
// and records the upgrade done. Nodes of any other image do nothing. Each phase is written into the record,
// with the node and the time, for the provider's wait and for an operator. The design and its reasons are in
// docs/kubernetes-upgrades.md.
package kubeupgrade

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/berthlabs/berth/internal/clusterinfo"
	"github.com/berthlabs/berth/internal/kubeadm"
	"github.com/berthlabs/berth/nodeagent/internal/cplease"
)

const (
	// lookEvery is the wait between two looks at the record and the cluster: an instructed upgrade starts
	// within it, and the roll's progress is seen within it.
	lookEvery = 30 * time.Second
	// retryAfter is the wait after a failed step, busyAfter while another node holds the Lease.
	retryAfter = 2 * time.Minute
	busyAfter  = 15 * time.Second
	// stepTimeout bounds one kubeadm run: `kubeadm upgrade apply` took 3 min 38 s in the lab, and kubeadm
	// waits up to 5 minutes for each static pod it replaces.
	stepTimeout = 20 * time.Minute
	// leaseDuration outlasts a step, so that only a node that died in one lets the Lease lapse.
	leaseDuration = stepTimeout + 5*time.Minute
)

// Kubeadm is the node's own kubeadm (kubeadm.Exec).
type Kubeadm interface {
	Version(ctx context.Context) (string, error)
	UpgradeApply(ctx context.Context, kubeconfig, release string, progress func(line string)) error
	UpgradeNode(ctx context.Context, kubeconfig string, progress func(line string)) error
	UpgradeAddons(ctx context.Context, kubeconfig, release string, progress func(line string)) error
}

// Config configures an Upgrader.
type Config struct {
	// Node is the node's name: the Lease's holder, and the node whose API server decides its own step.
	Node string
	// Kubeconfig is kubeadm's admin.conf.
	Kubeconfig string
	Kubeadm    Kubeadm
	// Client is a client of the node's own API server with the current admin.conf, called anew for each
	// look: an upgrade renews the certificate it authenticates with.
	Client func() (kubernetes.Interface, error)
	// Upgraded runs right after kubeadm upgraded this node's control plane (apply or node): it undoes what
	// `kubeadm upgrade apply` restores and Berth keeps out of the cluster (the bootstrap tokens'
	// auto-approval, joinservice.RemoveBootstrapAutoApproval), and passes on the certificates kubeadm
	// renewed with the control plane. When it fails, it runs again at the next look, before anything else.
	Upgraded func(ctx context.Context, kube kubernetes.Interface) error
	Logger   *slog.Logger
	// Now and After are the clock; time.Now and time.After when nil.
	Now   func() time.Time
	After func(time.Duration) <-chan time.Time
}

// Upgrader carries upgrades out on one control-plane node (see the package documentation).
type Upgrader struct {
	cfg Config
	log *slog.Logger
	// own is the node's kubeadm release, read once: the image does not change under a running agent.
	own string
	// said is the last reason logged, so that a node waiting on the roll says so once, not every look.
	said string
	// pending is set while Config.Upgraded has yet to succeed after the last upgrade of this node.
	pending bool
}

// New returns the upgrader of cfg.
func New(cfg Config) *Upgrader {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.After == nil {
		cfg.After = time.After
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Upgrader{cfg: cfg, log: log.With("component", "kubernetes-upgrade")}
}

// Run looks at the record and the cluster, and takes this node's step when there is one, until ctx ends.
func (u *Upgrader) Run(ctx context.Context) {
	for {
		wait := u.step(ctx)
		select {
		case <-ctx.Done():
			return
		case <-u.cfg.After(wait):
		}
	}
}

// step takes this node's next step, if any, and returns how long to wait before the next look.
func (u *Upgrader) step(ctx context.Context) time.Duration {
	// A look that fails is taken again at the next look, not after retryAfter: it is a few reads, and it
	// fails mostly at boot, before the node's own API server answers, where a reimaged control-plane node
	// that is to lead an upgrade would otherwise wait two minutes for nothing.
	kube, err := u.cfg.Client()
	if err != nil {
		u.log.Warn("cannot reach the API server to look for an upgrade", "error", err, "retry_in", lookEvery.String())
		return lookEvery
	}
	if u.pending {
		if err := u.upgraded(ctx, kube); err != nil {
			u.log.Error("upgraded, but what follows an upgrade failed; trying again later", "error", err, "retry_in", retryAfter.String())
			return retryAfter
		}
	}
	s, err := u.observe(ctx, kube)
	if err != nil {
		u.log.Warn("cannot tell where an upgrade stands", "error", err, "retry_in", lookEvery.String())
		return lookEvery
	}
	act, why := decide(u.cfg.Node, s)
	if act == idle || act == wait {
		u.say(act, s.rec.Target, why)
		return lookEvery
	}
	done, err := u.underLease(ctx, kube)
	switch {
	case err != nil:
		u.log.Error("upgrade step failed; trying again later", "target", s.rec.Target, "step", act.String(), "error", err, "retry_in", retryAfter.String())
		u.note(ctx, s.rec.Target, err)
		return retryAfter
	case !done:
		return busyAfter
	}
	return 0
}

// say logs why the node does nothing now, once for each new reason.
func (u *Upgrader) say(act action, target, why string) {
	if why == u.said {
		return
	}
	u.said = why
	if act == idle {
		u.log.Debug("no upgrade step for this node", "target", target, "reason", why)
		return
	}
	u.log.Info("upgrade waiting", "target", target, "reason", why)
}

// underLease takes the control-plane Lease and, holding it, looks again and takes the step: another node
// may have taken it while this one waited. done is false when another node holds the Lease.
func (u *Upgrader) underLease(ctx context.Context, kube kubernetes.Interface) (done bool, err error) {
	ctx, cancel := context.WithTimeout(ctx, stepTimeout)
	defer cancel()
	l := &cplease.Lease{Client: kube, Holder: u.cfg.Node, Duration: leaseDuration, Now: u.cfg.Now}
	taken, holder, err := l.Do(ctx, u.cfg.Client, u.log, func(ctx context.Context) error {
		s, err := u.observe(ctx, kube)
		if err != nil {
			return err
		}
		act, why := decide(u.cfg.Node, s)
		return u.take(ctx, kube, act, why, s)
	})
	if err == nil && !taken {
		u.log.Info("another control-plane node holds the control-plane lease; waiting for it", "holder", holder)
	}
	return taken, err
}

// take runs step act of the upgrade s.rec.
func (u *Upgrader) take(ctx context.Context, kube kubernetes.Interface, act action, why string, s state) error {
	target, rec := s.rec.Target, s.rec
	log := u.log.With("target", target, "step", act.String())
	progress := func(line string) { log.Info("kubeadm", "line", line) }
	var err error
	switch act {
	case idle, wait:
		u.say(act, target, why)
		return nil
	case apply:
		log.Info("upgrading the control plane: this node leads", "reason", why)
		if rec, err = rec.Record(ctx, kube, clusterinfo.PhaseApplying, u.cfg.Node, "", u.cfg.Now()); err != nil {
			return err
		}
		if err := u.cfg.Kubeadm.UpgradeApply(ctx, u.cfg.Kubeconfig, target, progress); err != nil {
			return err
		}
		if err := u.upgraded(ctx, kube); err != nil {
			return err
		}
		_, err = rec.Record(ctx, kube, clusterinfo.PhaseApplied, u.cfg.Node, "", u.cfg.Now())
	case upgradeNode:
		log.Info("upgrading this node's control plane", "reason", why)
		if err := u.cfg.Kubeadm.UpgradeNode(ctx, u.cfg.Kubeconfig, progress); err != nil {
			return err
		}
		err = u.upgraded(ctx, kube)
	case addons:
		log.Info("upgrading kube-proxy and CoreDNS", "reason", why)
		if rec, err = rec.Record(ctx, kube, clusterinfo.PhaseAddons, u.cfg.Node, "", u.cfg.Now()); err != nil {
			return err
		}
		if err := u.cfg.Kubeadm.UpgradeAddons(ctx, u.cfg.Kubeconfig, target, progress); err != nil {
			return err
		}
		_, err = rec.Record(ctx, kube, clusterinfo.PhaseDone, u.cfg.Node, "", u.cfg.Now())
		if err == nil {
			log.Info("the upgrade is done: the control plane, every node and the addons run the target")
		}
	}
	return err
}

// upgraded runs Config.Upgraded after a step that upgraded this node's control plane, with a client of the
// admin.conf kubeadm renewed.
func (u *Upgrader) upgraded(ctx context.Context, kube kubernetes.Interface) error {
	if u.cfg.Upgraded == nil {
		return nil
	}
	if c, err := u.cfg.Client(); err == nil {
		kube = c
	}
	u.pending = true
	if err := u.cfg.Upgraded(ctx, kube); err != nil {
		return fmt.Errorf("after kubeadm upgraded this node: %w", err)
	}
	u.pending = false
	return nil
}

// note writes a failed step's error into the record, keeping its phase, so that the provider's wait and an
// operator see why the upgrade does not move. A record that moved meanwhile is left as it is.
func (u *Upgrader) note(ctx context.Context, target string, failure error) {
	kube, err := u.cfg.Client()
	if err != nil {
		return
	}
	rec, err := clusterinfo.ReadUpgrade(ctx, kube)
	if err != nil || rec.Target != target {
		return
	}
	if _, err := rec.Record(ctx, kube, rec.Phase, u.cfg.Node, failure.Error(), u.cfg.Now()); err != nil {
		u.log.Warn("the failure is not in the cluster record", "error", err)
	}
}

// observe reads what decide needs: the record, and while an upgrade is under way the node's kubeadm,
// kubeadm-config, the API servers' and the kubelets' releases.
func (u *Upgrader) observe(ctx context.Context, kube kubernetes.Interface) (state, error) {
	var s state
	var err error
	if s.rec, err = clusterinfo.ReadUpgrade(ctx, kube); err != nil {
		return state{}, err
	}
	if s.rec.Target == "" || s.rec.Phase == clusterinfo.PhaseDone {
		// Nothing to do: kubeadm is not run at all.
		return s, nil
	}
	if u.own == "" {
		if u.own, err = u.cfg.Kubeadm.Version(ctx); err != nil {
			return state{}, fmt.Errorf("reading this node's kubeadm release: %w", err)
		}
	}
	s.own = u.own
	if s.own != s.rec.Target {
		// decide needs no more to leave this node idle.
		return s, nil
	}
	release, found, err := kubeadm.ClusterRelease(ctx, kube)
	switch {
	case err != nil:
		return state{}, err
	case !found:
		return state{}, errors.New("kubeadm-config names no Kubernetes release")
	}
	s.cluster = release
	if s.apiServers, err = kubeadm.APIServerReleases(ctx, kube); err != nil {
		return state{}, err
	}
	nodes, err := kube.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return state{}, fmt.Errorf("listing nodes: %w", err)
	}
	s.kubelets = kubeletReleases(nodes.Items)
	return s, nil
}

// kubeletReleases is each Node's kubelet release.
func kubeletReleases(nodes []corev1.Node) map[string]string {
	releases := make(map[string]string, len(nodes))
	for _, n := range nodes {
		releases[n.Name] = n.Status.NodeInfo.KubeletVersion
	}
	return releases
}
