// Package joinserver runs a join service (package joinservice's gRPC service) as a server: its certificate
// from the join CA, its listener with admission, its policy source and records, the sweep of dead nodes'
// disk records, its readiness. It serves on a control-plane node (the agent's ServeJoinService) or beside a
// control plane kubeadm did not make (ServeStandalone, from join-service.yaml).
package joinserver

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"k8s.io/client-go/kubernetes"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/internal/rpc"
	"github.com/berthlabs/berth/nodeagent/internal/joinservice"
	"github.com/berthlabs/berth/nodeagent/internal/telemetry"
)

// Connections bounds the connections served at once. A connection costs memory while its node's TPM
// quotes and activates, not CPU: the service's workers (joinservice.Config.Workers) bound the CPU. So the
// bound is memory's (about 32 KiB of heap a connection that sent nothing yet, TestAdmittedAttackers), high
// enough that peers slow on purpose need more than 256 addresses with instance records to fill it.
const Connections = 512

// serverCertValidity is the join service's certificate lifetime; the service makes a new one each start.
const serverCertValidity = 90 * 24 * time.Hour

// Options say where and how a join service serves, whether on a control-plane node or beside an external
// control plane.
type Options struct {
	Listen string
	// Names and IPs go into the service's certificate.
	Names []string
	IPs   []net.IP
	Kube  kubernetes.Interface
	// The policy comes from PolicyFile if set, else from the ConfigMap PolicyConfigMap in kube-system,
	// which InitialPolicy, if set, may create first.
	PolicyFile, PolicyConfigMap string
	InitialPolicy               func(context.Context, kubernetes.Interface) error
	// FollowPolicy, if set, runs beside the service with its policy store and the store's first Changed.
	FollowPolicy func(ctx context.Context, store *policy.Store, changed <-chan struct{})
	Log          *slog.Logger
	// Metrics and Health, if set, are the process's metrics, which the service's then count in, and its
	// health server, which it makes ready once the service is.
	Metrics *telemetry.Metrics
	Health  *telemetry.Server
	// BootstrapTokens: the service's tickets carry kubeadm bootstrap tokens (the kubeadm join method).
	BootstrapTokens bool
	// GoneNodeGrace, if set, is how long a NotReady Node whose instance the lookup no longer finds stays
	// before the service removes it (joinservice.GoneNodes): for inventories that list an instance until it
	// is deleted, not merely stopped.
	GoneNodeGrace time.Duration
}

// Serve runs a join service with cfg (its policy from s) until ctx ends. It owns every goroutine it starts:
// they end when ctx does or when it returns.
func Serve(ctx context.Context, s Options, cfg joinservice.Config) error {
	var running sync.WaitGroup
	defer running.Wait()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	store := policy.NewStore(&policy.Policy{})
	if s.Metrics != nil {
		cfg.Metrics = s.Metrics
		telemetry.CountKubernetesRequests(s.Metrics.Calls(telemetry.APIKubernetes))
		loaded := watchPolicyLoads(ctx, &running, store, s.Metrics)
		if s.Health != nil {
			api := telemetry.StartProbe(ctx, apiProbeInterval, apiProbeTimeout, apiVersion(s.Kube), s.Metrics.APIReachable)
			s.Health.AddCheck("policy", loaded)
			s.Health.AddCheck("kubernetes-api", api.Err)
		}
	}
	if s.FollowPolicy != nil {
		// The empty policy the store starts with is no one's: only what a watcher loads is followed.
		changed := store.Changed()
		running.Go(func() { s.FollowPolicy(ctx, store, changed) })
	}
	watchErr := make(chan error, 1)
	if s.PolicyFile != "" {
		running.Go(func() { watchErr <- policy.WatchFile(ctx, s.PolicyFile, 5*time.Second, store, s.Log) })
	} else {
		if s.InitialPolicy != nil {
			if err := s.InitialPolicy(ctx, s.Kube); err != nil {
				s.Log.Warn("publishing the initial join policy", "error", err)
			}
		}
		running.Go(func() {
			watchErr <- policy.WatchConfigMap(ctx, s.Kube, joinservice.Namespace, s.PolicyConfigMap, store, s.Log)
		})
	}
	cfg.Policy = store
	records, err := joinservice.WatchNodeRecords(ctx, s.Kube, s.BootstrapTokens)
	if err != nil {
		return fmt.Errorf("watching the nodes' records: %w", err)
	}
	if s.BootstrapTokens {
		cfg.Tokens = &joinservice.KubeTokens{Client: s.Kube, Records: records}
		// A kubeadm control plane runs its API servers as static pods this service's credentials can list;
		// beside an external control plane, the configured version stands for them.
		cfg.APIServers = &joinservice.KubeAPIServers{Client: s.Kube}
		cfg.UpgradeTarget = joinservice.KubeUpgradeTarget{Client: s.Kube}
	}
	disks := &joinservice.KubeDisks{Client: s.Kube, Records: records}
	cfg.Disks = disks
	running.Go(func() { collectDiskRecords(ctx, disks, cfg.Instances, s.Log) })
	if s.GoneNodeGrace > 0 {
		gone := &joinservice.GoneNodes{Client: s.Kube, Lookup: cfg.Instances}
		running.Go(func() { removeGoneNodes(ctx, gone, s.GoneNodeGrace, s.Log) })
	}
	svc, err := joinservice.New(cfg)
	if err != nil {
		return err
	}
	cert, err := serverCert(cfg.JoinCA, s.Names, s.IPs)
	if err != nil {
		return fmt.Errorf("join service certificate: %w", err)
	}
	lis, err := net.Listen("tcp", s.Listen)
	if err != nil {
		return fmt.Errorf("join service: %w", err)
	}
	admitted := svc.Listen(lis, Connections, rpc.DefaultPerAddress)
	if s.Metrics != nil {
		s.Metrics.WatchAdmission(admitted)
	}
	gs := grpc.NewServer(append(rpc.ServerOptions(cert), rpc.OneExchange())...)
	berthv1.RegisterJoinServiceServer(gs, svc)
	served := make(chan error, 1)
	running.Go(func() { served <- gs.Serve(admitted) })
	s.Log.Info("join service listening", "address", lis.Addr().String(), "method", cfg.Method.String())
	select {
	case <-ctx.Done():
		rpc.StopGracefully(gs, 10*time.Second)
		return nil
	case err := <-served:
		return fmt.Errorf("join service: %w", err)
	case err := <-watchErr:
		gs.Stop()
		return fmt.Errorf("join service: watching the join policy: %w", err)
	}
}

// apiVersion asks the API server for /version, which every client may read, within its context: discovery's
// own ServerVersion takes none, and a probe stuck on a dead connection would keep reporting its last success.
func apiVersion(kube kubernetes.Interface) func(context.Context) error {
	return func(ctx context.Context) error {
		rc := kube.Discovery().RESTClient()
		if rc == nil {
			return errors.New("the Kubernetes client has no REST client to check the API server with")
		}
		if err := rc.Get().AbsPath("/version").Do(ctx).Error(); err != nil {
			return fmt.Errorf("API server /version: %w", err)
		}
		return nil
	}
}

// diskRecordSweep is how often a join service looks for the disk records of instances that are gone.
const diskRecordSweep = 10 * time.Minute

// removeGoneNodes removes, until ctx ends, the Nodes whose instances have been gone for grace, looking a few
// times within each grace. Every join service sweeps; removing a Node twice is harmless.
func removeGoneNodes(ctx context.Context, gone *joinservice.GoneNodes, grace time.Duration, log *slog.Logger) {
	sweep(ctx, min(max(grace/4, 5*time.Second), diskRecordSweep),
		func(now time.Time) ([]string, error) { return gone.Collect(ctx, grace, now) },
		log.With("grace", grace.String()), "removed the Nodes of instances deleted from the inventory", "nodes", "removing the Nodes of deleted instances")
}

// collectDiskRecords removes, every diskRecordSweep until ctx ends, the disk records of instances that have
// been gone for joinservice.DefaultRetention. Every join service sweeps; removing a record twice is harmless.
func collectDiskRecords(ctx context.Context, disks *joinservice.KubeDisks, lookup joinservice.InstanceLookup, log *slog.Logger) {
	sweep(ctx, diskRecordSweep,
		func(now time.Time) ([]string, error) {
			return disks.Collect(ctx, lookup, joinservice.DefaultRetention, now)
		},
		log.With("retention", joinservice.DefaultRetention.String()), "removed the disk records of instances gone for longer than the retention",
		"disks", "collecting disk records")
}

// sweep calls collect every interval until ctx ends, logging what it removed (removedMsg, the names under
// key) and why it failed (failedMsg).
func sweep(ctx context.Context, every time.Duration, collect func(now time.Time) ([]string, error), log *slog.Logger, removedMsg, key, failedMsg string) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		removed, err := collect(time.Now())
		if len(removed) > 0 {
			log.Info(removedMsg, key, removed)
		}
		if err != nil && ctx.Err() == nil {
			log.Warn(failedMsg, "error", err)
		}
	}
}

// How the readiness check sees the Kubernetes API: a cheap request (/version) in the background, so that a
// load balancer's probes never reach the API server.
const (
	apiProbeInterval = 10 * time.Second
	apiProbeTimeout  = 5 * time.Second
)

// watchPolicyLoads records each policy the store's source loads in metrics, until ctx ends, in a goroutine
// of running, and returns a readiness check that passes once one was loaded. It takes the store's Changed at
// once, before any source can set the store.
func watchPolicyLoads(ctx context.Context, running *sync.WaitGroup, store *policy.Store, metrics *telemetry.Metrics) telemetry.Check {
	var loaded atomic.Bool
	changed := store.Changed()
	running.Go(func() {
		for {
			select {
			case <-ctx.Done():
				return
			case <-changed:
			}
			// The next change is taken before the policy is read, so that none falls between the two.
			changed = store.Changed()
			p := store.Load()
			// A policy whose version cannot be shown is loaded all the same: the version only labels it.
			version := "unknown"
			if data, err := p.Marshal(); err == nil {
				sum := sha256.Sum256(data)
				version = hex.EncodeToString(sum[:6])
			}
			metrics.PolicyLoaded(len(p.Images), version, time.Now())
			loaded.Store(true)
		}
	})
	return func() error {
		if !loaded.Load() {
			return errors.New("no join policy loaded yet")
		}
		return nil
	}
}
