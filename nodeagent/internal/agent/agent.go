package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"path/filepath"
	"time"

	"google.golang.org/grpc"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/util/connrotation"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/backoff"
	"github.com/berthlabs/berth/internal/clusterinfo"
	"github.com/berthlabs/berth/internal/kubeadm"
	"github.com/berthlabs/berth/internal/luks"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/podnetwork"
	"github.com/berthlabs/berth/internal/rpc"
	"github.com/berthlabs/berth/nodeagent/internal/certrenew"
	"github.com/berthlabs/berth/nodeagent/internal/failpoint"
	"github.com/berthlabs/berth/nodeagent/internal/initserver"
	"github.com/berthlabs/berth/nodeagent/internal/joinclient"
	"github.com/berthlabs/berth/nodeagent/internal/joinservice"
	"github.com/berthlabs/berth/nodeagent/internal/kubeupgrade"
	"github.com/berthlabs/berth/nodeagent/internal/localunlock"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
	"github.com/berthlabs/berth/nodeagent/internal/platform"
	"github.com/berthlabs/berth/nodeagent/internal/statedisk"
	"github.com/berthlabs/berth/nodeagent/internal/telemetry"
)

// Prover is the TPM (attest.Prover).
type Prover interface {
	joinclient.Prover
	localunlock.TPM
	// EKFingerprint names the TPM as the join service's disk registry does.
	EKFingerprint() string
	Close() error
}

// Kubeadm runs kubeadm (kubeadm.Exec); Reset clears what an interrupted join left behind, and a
// control-plane node renews its certificates (package certrenew) and upgrades its control plane (package
// kubeupgrade) with it.
type Kubeadm interface {
	kubeadm.Runner
	certrenew.Kubeadm
	kubeupgrade.Kubeadm
	Reset(ctx context.Context, progress func(line string)) error
}

// The join service's request rate limit towards the API server, instead of client-go's default of 5 a second.
// A ticket takes two writes (its token and its disk record; the node's earlier ones are found from a watch),
// so a storm of 1,000 nodes needs 2,000: at 500 a second they wait for the API server, not for the limit, and
// the API server's priority and fairness protects it.
const (
	kubeQPS   = 500
	kubeBurst = 1000
)

// Deps are the agent's ties to the machine.
type Deps struct {
	// OpenProver opens the TPM.
	OpenProver func(device string) (Prover, error)
	Kubeadm    Kubeadm
	// KubeClient connects the join service to the API server with kubeconfig's credentials; server, if set,
	// is the API server to use instead of the kubeconfig's.
	KubeClient func(kubeconfig, server string) (kubernetes.Interface, error)
	// ReconnectKube closes the connections of the clients KubeClient made, so that each opens again with the
	// client certificate now in its kubeconfig's files; nil when they need not.
	ReconnectKube func()
	Logger        *slog.Logger
	// Build names the agent's build in its metrics (berth_build_info).
	Build telemetry.Build
}

// RealDeps are the dependencies of a real node.
func RealDeps(cfg *Config, logger *slog.Logger) Deps {
	conns := connrotation.NewDialer((&net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}).DialContext)
	return Deps{
		OpenProver: func(device string) (Prover, error) {
			tpm, err := attest.OpenTPM(device)
			if err != nil {
				return nil, err
			}
			p, err := attest.NewProver(tpm)
			if err != nil {
				tpm.Close()
				return nil, err
			}
			return p, nil
		},
		Kubeadm: &kubeadm.Exec{Binary: cfg.Kubeadm, IgnorePreflightErrors: cfg.IgnorePreflightErrors, Logger: logger},
		KubeClient: func(kubeconfig, server string) (kubernetes.Interface, error) {
			return kubeClientAt(kubeconfig, server, conns.DialContext)
		},
		ReconnectKube: conns.CloseAll,
		Logger:        logger,
	}
}

// KubeClient connects a join service to the API server with kubeconfig.
func KubeClient(kubeconfig string) (kubernetes.Interface, error) {
	return kubeClientAt(kubeconfig, "", nil)
}

// kubeClientAt is KubeClient talking to server (https://host:port) instead of the kubeconfig's, if set, and
// connecting with dial, if set.
func kubeClientAt(kubeconfig, server string, dial func(ctx context.Context, network, address string) (net.Conn, error)) (kubernetes.Interface, error) {
	rc, err := clientcmd.BuildConfigFromFlags(server, kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("loading kubeconfig %s: %w", kubeconfig, err)
	}
	rc.Dial = dial
	rc.QPS, rc.Burst = kubeQPS, kubeBurst
	// Protobuf, which the API server speaks for every built-in type, costs both ends less than JSON.
	rc.ContentType = runtime.ContentTypeProtobuf
	rc.AcceptContentTypes = runtime.ContentTypeProtobuf + "," + runtime.ContentTypeJSON
	return kubernetes.NewForConfig(rc)
}

// Agent is one node's agent.
type Agent struct {
	cfg  *Config
	deps Deps
	log  *slog.Logger
	// platform is the environment the node runs in.
	platform platform.Platform
	disk     *statedisk.Disk
	vol      *luks.Volume
	// mounted is set once the state volume is mounted in this boot.
	mounted bool
	// telemetry is the process's metrics and health server, if agent.yaml sets metricsListen.
	telemetry processTelemetry
	// keeper seals the disk key in the TPM; nil on nodes that do not.
	keeper *localunlock.Keeper
}

// New wires an agent.
func New(cfg *Config, deps Deps) (*Agent, error) {
	log := deps.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if cfg.SourceAddress != "" {
		if _, err := netip.ParseAddr(cfg.SourceAddress); err != nil {
			return nil, fmt.Errorf("sourceAddress: %w", err)
		}
	}
	vol := luks.New(cfg.StateDisk, log)
	return &Agent{cfg: cfg, deps: deps, log: log, platform: cfg.Platform(), vol: vol, disk: statedisk.New(vol, log, diskOptions()...)}, nil
}

// diskOptions are the state disk's options; a failpoint build can crash after each of its steps, at the
// failpoint "disk-<step>".
func diskOptions() []statedisk.Option {
	if !failpoint.Enabled {
		return nil
	}
	return []statedisk.Option{statedisk.WithStepHook(func(step string) error {
		failpoint.Crash("disk-" + step)
		return nil
	})}
}

// unlockingDisk mounts the state volume and binds the state directories from it as soon as its key is set,
// so that everything the join client and the init server write next lands on the encrypted disk. A node that
// joins again after an interrupted join sets the same key twice in one boot; the volume is mounted once, and
// binds already in place are kept.
type unlockingDisk struct{ a *Agent }

func (u unlockingDisk) SetKey(ctx context.Context, initial, key []byte) error {
	if err := u.a.disk.SetKey(ctx, initial, key); err != nil {
		return err
	}
	if u.a.keeper != nil {
		u.a.keeper.SetKey(key)
	}
	if u.a.cfg.StateMount == "" {
		return nil
	}
	if !u.a.mounted {
		if err := u.a.disk.Mount(ctx, key, u.a.cfg.MapperName, u.a.cfg.StateMount); err != nil {
			return err
		}
		u.a.mounted = true
	}
	// Before kubeadm, the kubelet or etcd write a byte: the binds decide which disk it lands on.
	return statedisk.BindDirs(ctx, u.a.log, u.a.cfg.StateMount, u.a.cfg.StateDirs)
}

// firstBoot runs the init server (on control-plane nodes that have an init secret) beside the join client;
// whichever takes the node lock first makes the node a member, and the other stops.
func (a *Agent) firstBoot(ctx context.Context, log *slog.Logger, self *metadata.Self, prepared statedisk.Prepared, prover Prover, lock *nodestate.Lock, jc *joinclient.Client) error {
	var initDone <-chan struct{}
	if self.Instance.Role == metadata.RoleControlPlane && self.UserData.InitSecretHash != "" {
		srv, stop, err := a.startInitServer(ctx, prover, lock, self, prepared, log)
		if err != nil {
			return err
		}
		defer stop()
		initDone = srv.Done()
	}
	joined := make(chan error, 1)
	go func() {
		_, err := jc.Join(ctx, prepared)
		joined <- err
	}()
	select {
	case err := <-joined:
		if !errors.Is(err, joinclient.ErrLockTaken) {
			return err
		}
		select {
		case <-initDone:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	case <-initDone:
		jc.Stop()
		<-joined
		log.Info("initialized by the init server; join client stopped")
		return nil
	case <-ctx.Done():
		jc.Stop()
		<-joined
		return ctx.Err()
	}
}

func (a *Agent) startInitServer(ctx context.Context, prover Prover, lock *nodestate.Lock, self *metadata.Self, prepared statedisk.Prepared, log *slog.Logger) (*initserver.Server, func(), error) {
	tel, err := a.startTelemetry(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("init server: %w", err)
	}
	var metrics initserver.Metrics
	if tel.metrics != nil {
		metrics = tel.metrics
	}
	srv, err := initserver.New(initserver.Config{
		Prover: prover, Lock: lock, Disk: unlockingDisk{a}, Prepared: prepared, Self: self, Metrics: metrics,
		Kubeadm: a.deps.Kubeadm, Recorder: clusterRecorder{a: a, log: log, disk: prepared.UUID, ek: prover.EKFingerprint(), inst: &self.Instance}, Paths: a.cfg.Paths, Logger: log.With("component", "init-server"),
		KubeadmInit: kubeadm.InitParams{
			ImageRepository: a.cfg.ImageRepository, SkipPhases: a.cfg.SkipPhases, KubeletExtraArgs: a.cfg.Kubelet.ExtraArgs,
			Cloud:     kubeadm.Cloud{External: a.cfg.Kubelet.externalCloud(), ProviderID: self.ProviderID},
			Kubelet:   kubeadm.KubeletSettings{CgroupDriver: a.cfg.Kubelet.CgroupDriver, AllowCgroupV1: a.cfg.Kubelet.AllowCgroupV1},
			KubeProxy: a.cfg.KubeProxy,
		},
	})
	if err != nil {
		return nil, nil, err
	}
	stop, err := a.serveOnInitPort(func(gs *grpc.Server) { berthv1.RegisterInitServiceServer(gs, srv) },
		initserver.DefaultTimeout+initserver.DefaultInitTimeout, 30*time.Second)
	if err != nil {
		return nil, nil, fmt.Errorf("init server: %w", err)
	}
	log.Info("init server listening", "address", a.cfg.InitListen)
	return srv, stop, nil
}

// serveOnInitPort serves what register registers on the init port, with a certificate no one pins (the
// clients authenticate the node by attestation), one exchange of at most exchange per connection, and
// returns how to stop it, giving running calls grace.
func (a *Agent) serveOnInitPort(register func(*grpc.Server), exchange, grace time.Duration) (stop func(), err error) {
	cert, err := initserver.ServerCredentials()
	if err != nil {
		return nil, err
	}
	inner, err := net.Listen("tcp", a.cfg.InitListen)
	if err != nil {
		return nil, err
	}
	lis := initserver.Listen(inner, exchange, a.log.With("component", "init-port"))
	gs := grpc.NewServer(append(rpc.ServerOptions(cert), rpc.OneExchange())...)
	register(gs)
	go gs.Serve(lis)
	return func() { rpc.StopGracefully(gs, grace) }, nil
}

// clusterRecorder writes into the new cluster right after kubeadm init: it publishes the cluster record,
// records this node's TPM as its disk's owner, as the join service does for every node it keys, so that the
// node gets rejoin tickets from the control-plane nodes that join after it, removes kubeadm's auto-approval
// of bootstrap tokens' node CSRs (joinservice.RemoveBootstrapAutoApproval) before the cluster is handed out,
// and installs the pod network. The API server answered kubeadm's last phases a moment ago, so failures are
// retried only briefly: a node whose records cannot be written fails its init rather than hand out a cluster
// Terraform could not recognize later, or be a node that can never rejoin.
type clusterRecorder struct {
	a        *Agent
	log      *slog.Logger
	disk, ek string
	inst     *metadata.Instance
}

func (r clusterRecorder) RecordCluster(ctx context.Context, info clusterinfo.Info) error {
	return r.onCluster(ctx, "publishing the cluster record", func(ctx context.Context, kube kubernetes.Interface) error {
		if err := (&joinservice.KubeDisks{Client: kube}).Claim(ctx, r.disk, r.ek, r.inst); err != nil {
			return err
		}
		if _, err := joinservice.RemoveBootstrapAutoApproval(ctx, kube); err != nil {
			return err
		}
		return clusterinfo.Publish(ctx, kube, info)
	})
}

// InstallPodNetwork installs the pod network the init request named, with this image's settings.
func (r clusterRecorder) InstallPodNetwork(ctx context.Context, plugin, podSubnet string) error {
	return r.onCluster(ctx, "installing the pod network", func(ctx context.Context, kube kubernetes.Interface) error {
		return podnetwork.Install(ctx, kube, plugin, podSubnet, r.a.cfg.PodNetwork)
	})
}

// onCluster runs op with the admin kubeconfig kubeadm wrote, retrying it for up to a minute.
func (r clusterRecorder) onCluster(ctx context.Context, what string, op func(context.Context, kubernetes.Interface) error) error {
	kube, err := r.a.deps.KubeClient(filepath.Join(r.a.cfg.Paths.KubernetesDir, "admin.conf"), "")
	if err != nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	return backoff.Retry(ctx, backoff.Policy{}, nil, nil, func(ctx context.Context) error { return op(ctx, kube) },
		func(attempt int, err error, next time.Duration) {
			r.log.Warn(what+" failed; retrying", "attempt", attempt, "error", err, "retry_in", next)
		})
}

func (a *Agent) joinClient(prover Prover, lock *nodestate.Lock, log *slog.Logger) *joinclient.Client {
	src, _ := netip.ParseAddr(a.cfg.SourceAddress)
	return joinclient.New(joinclient.Config{
		Metadata: a.platform.Node(), Prover: prover, Disk: unlockingDisk{a}, Lock: lock, Kubeadm: a.deps.Kubeadm,
		KubeadmJoin: kubeadm.JoinParams{KubeletExtraArgs: a.cfg.Kubelet.ExtraArgs, Cloud: kubeadm.Cloud{External: a.cfg.Kubelet.externalCloud()}},
		Kubelet:     kubeadm.KubeletSettings{CgroupDriver: a.cfg.Kubelet.CgroupDriver, AllowCgroupV1: a.cfg.Kubelet.AllowCgroupV1},
		Paths:       a.cfg.Paths, PCRs: a.cfg.PCRs, LocalAddr: src,
		Backoff: backoff.Policy{Max: a.cfg.RetryMax.Duration}, Logger: log.With("component", "join-client"),
	})
}

func (a *Agent) self(ctx context.Context) (*metadata.Self, error) {
	return metadata.WaitSelf(ctx, a.platform.Node(), backoff.Policy{Max: a.cfg.RetryMax.Duration}, backoff.Sleep, nil, a.log)
}
