// Package certrenew renews a control-plane node's kubeadm certificates before they expire. kubeadm makes them
// for a year (the cluster's certificate validity), and nothing else renews them on a node that outlives
// that: Berth's nodes are not logged into, and a control-plane node that is never replaced would see its API
// server, its etcd client and its controllers' kubeconfigs expire together.
//
// Each control-plane node's agent watches its own certificates. When the first of them comes within
// RenewBefore of its end, the agent takes a Lease in kube-system, so that one node at a time renews; runs
// `kubeadm certs renew all`, which signs new certificates with the cluster's CA key the node holds since it
// joined (or initialized) attested; restarts the control-plane components that read their certificates only
// at their start; waits until they are back; and gives the Lease up.
package certrenew

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"time"

	"k8s.io/client-go/kubernetes"

	"github.com/berthlabs/berth/nodeagent/internal/cplease"
	"github.com/berthlabs/berth/nodeagent/internal/kubecerts"
)

const (
	// DefaultRenewBefore is how long before the first certificate's end the node renews: 30 days leave a
	// month of alerts (berth_certificate_expiry_timestamp_seconds) and retries if the renewal keeps failing.
	DefaultRenewBefore = 30 * 24 * time.Hour
	// checkEvery bounds the wait between two reads of the certificates: a certificate renewed by someone
	// else (an operator, kubeadm upgrade) moves the due time, and a clock that jumped is caught up with.
	checkEvery = time.Hour
	// retryAfter is the wait after a failed renewal, and busyAfter while another node holds the Lease.
	retryAfter = 10 * time.Minute
	busyAfter  = 30 * time.Second
	// leaseDuration outlasts a renewal (kubeadm, the components' restart, their readiness), so that only a
	// node that died while renewing lets the Lease lapse.
	leaseDuration = 10 * time.Minute
	// renewTimeout bounds one renewal.
	renewTimeout = 8 * time.Minute
)

// Kubeadm renews the node's kubeadm certificates and kubeconfigs (`kubeadm certs renew all`).
type Kubeadm interface {
	RenewCertificates(ctx context.Context, kubeconfig, certDir string, progress func(line string)) error
}

// Observer learns each renewal's outcome, for the node's metrics.
type Observer interface {
	CertificatesRenewed(err error)
}

// Config configures a Renewer.
type Config struct {
	// Node is the node's name: the Lease's holder, and the node whose control-plane pods are restarted.
	Node string
	// Files are the node's certificates (kubecerts.Files); those kubeadm renews decide when to renew.
	Files []kubecerts.File
	// Kubeconfig is kubeadm's admin.conf, CertDir its certificates' directory, ManifestDir its static pods'.
	Kubeconfig, CertDir, ManifestDir string
	Kubeadm                          Kubeadm
	// Client is a client of the node's own API server with the current admin.conf: called anew for each
	// renewal, since the one before renewed the certificate it authenticates with.
	Client func() (kubernetes.Interface, error)
	// RenewBefore is how long before the first certificate's end to renew; DefaultRenewBefore when zero.
	RenewBefore time.Duration
	Observer    Observer
	Logger      *slog.Logger
	// Now and After are the clock; time.Now and time.After when nil.
	Now   func() time.Time
	After func(time.Duration) <-chan time.Time
}

// Renewer renews one control-plane node's certificates (see the package documentation).
type Renewer struct {
	cfg Config
	log *slog.Logger
}

// New returns the renewer of cfg.
func New(cfg Config) *Renewer {
	if cfg.RenewBefore <= 0 {
		cfg.RenewBefore = DefaultRenewBefore
	}
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
	return &Renewer{cfg: cfg, log: log.With("component", "certificate-renewal")}
}

// Due is when the node's certificates are next to be renewed: RenewBefore before the end of the first of
// kubeadm's certificates, and which one that is. A node without any (a worker) gets an error.
func (r *Renewer) Due() (at time.Time, first string, err error) {
	for _, f := range r.cfg.Files {
		if !f.Kubeadm {
			continue
		}
		cert, err := kubecerts.Read(f.Path)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return time.Time{}, "", fmt.Errorf("reading certificate %s: %w", f.Name, err)
		}
		if due := cert.NotAfter.Add(-r.cfg.RenewBefore); first == "" || due.Before(at) {
			at, first = due, f.Name
		}
	}
	if first == "" {
		return time.Time{}, "", errors.New("no kubeadm certificate on this node")
	}
	return at, first, nil
}

// Run renews the node's certificates whenever they are due, until ctx ends.
func (r *Renewer) Run(ctx context.Context) {
	for {
		wait := r.step(ctx)
		select {
		case <-ctx.Done():
			return
		case <-r.cfg.After(wait):
		}
	}
}

// step renews if the certificates are due and returns how long to wait before the next look.
func (r *Renewer) step(ctx context.Context) time.Duration {
	due, first, err := r.Due()
	if err != nil {
		r.log.Error("cannot tell when the certificates are due; looking again later", "error", err, "retry_in", retryAfter.String())
		return retryAfter
	}
	if wait := due.Sub(r.cfg.Now()); wait > 0 {
		r.log.Debug("certificates not due", "first", first, "due", due.UTC().Format(time.RFC3339))
		return min(wait, checkEvery)
	}
	r.log.Info("renewing the control plane's certificates", "first", first, "due", due.UTC().Format(time.RFC3339))
	renewed, err := r.renew(ctx)
	switch {
	case err != nil:
		r.log.Error("certificate renewal failed; trying again later", "error", err, "retry_in", retryAfter.String())
		r.observe(err)
		return retryAfter
	case !renewed:
		return busyAfter
	}
	r.observe(nil)
	next, first, err := r.Due()
	if err == nil && !next.After(r.cfg.Now()) {
		// New certificates that are due at once: RenewBefore is as long as the cluster's certificate
		// validity. Renewing again would only restart the control plane over and over.
		r.log.Warn("the renewed certificates are due again at once: renewBefore is not shorter than the cluster's certificate validity",
			"first", first, "renew_before", r.cfg.RenewBefore.String())
		return checkEvery
	}
	return 0
}

func (r *Renewer) observe(err error) {
	if r.cfg.Observer != nil {
		r.cfg.Observer.CertificatesRenewed(err)
	}
}

// renew renews the certificates under the Lease; renewed is false when another node holds it.
func (r *Renewer) renew(ctx context.Context) (renewed bool, err error) {
	ctx, cancel := context.WithTimeout(ctx, renewTimeout)
	defer cancel()
	client, err := r.cfg.Client()
	if err != nil {
		return false, fmt.Errorf("connecting to the API server: %w", err)
	}
	l := &cplease.Lease{Client: client, Holder: r.cfg.Node, Duration: leaseDuration, Now: r.cfg.Now}
	taken, holder, err := l.Do(ctx, r.cfg.Client, r.log, r.renewHolding)
	if err == nil && !taken {
		r.log.Info("another control-plane node is renewing its certificates; waiting for it", "holder", holder)
	}
	return taken && err == nil, err
}

// renewHolding renews the certificates and restarts the control plane, with the Lease held.
func (r *Renewer) renewHolding(ctx context.Context) error {
	start := r.cfg.Now()
	err := r.cfg.Kubeadm.RenewCertificates(ctx, r.cfg.Kubeconfig, r.cfg.CertDir, func(line string) {
		r.log.Debug("kubeadm output", "line", line)
	})
	if err != nil {
		return fmt.Errorf("kubeadm certs renew: %w", err)
	}
	r.log.Info("certificates renewed; restarting the control-plane components")
	stamp := start.UTC().Format(time.RFC3339)
	restarted, err := restartStaticPods(r.cfg.ManifestDir, stamp)
	if err != nil {
		return err
	}
	client, err := r.cfg.Client()
	if err != nil {
		return fmt.Errorf("connecting to the API server with the renewed admin.conf: %w", err)
	}
	if err := waitRestarted(ctx, client, r.cfg.Node, restarted, stamp, r.log); err != nil {
		return err
	}
	r.log.Info("control plane back with renewed certificates", "components", restarted,
		"duration", r.cfg.Now().Sub(start).Round(time.Second).String())
	return nil
}
