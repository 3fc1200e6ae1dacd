package agent

import (
	"cmp"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/backoff"
	"github.com/berthlabs/berth/internal/cfssl"
	"github.com/berthlabs/berth/internal/cloud/apicalls"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/internal/rpc"
	"github.com/berthlabs/berth/nodeagent/internal/initserver"
	"github.com/berthlabs/berth/nodeagent/internal/joinservice"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
	"github.com/berthlabs/berth/nodeagent/internal/platform"
	"github.com/berthlabs/berth/nodeagent/internal/telemetry"
)

// InitialPolicyFile is where the init server leaves the policy of the init request, for the join service
// to publish as its ConfigMap when none exists yet.
const InitialPolicyFile = "join-policy.yaml"

// joinConnectionsPerCPU bounds the exchanges in progress: a node holds its connection while its TPM quotes
// and activates (up to a few hundred milliseconds on a vTPM), so a few dozen per CPU keep the CPUs busy
// while a storm beyond that waits in the listen queue instead of costing memory.
const joinConnectionsPerCPU = 32

// serverCertValidity is the join service's certificate lifetime; the service makes a new one each start.
const serverCertValidity = 90 * 24 * time.Hour

// ServeJoinService serves join tickets from this control-plane node's stored cluster secrets until ctx ends.
func (a *Agent) ServeJoinService(ctx context.Context) error {
	self, err := a.self(ctx)
	if err != nil {
		return err
	}
	log := a.log.With("component", "join-service", "node", self.Instance.Name)
	tel, err := a.startTelemetry(ctx)
	if err != nil {
		return fmt.Errorf("join service: %w", err)
	}
	secrets, err := nodestate.ReadSecrets(a.cfg.Paths.State)
	if err != nil {
		return fmt.Errorf("join service: %w", err)
	}
	dir := a.cfg.Paths.PKIDir()
	kubeCA, signer, err := kubeletSigning(filepath.Join(dir, "ca.crt"), filepath.Join(dir, "ca.key"), a.cfg.CFSSL, a.log)
	if err != nil {
		return fmt.Errorf("join service: %w", err)
	}
	joinCA, err := pki.ParseCA(secrets.JoinCACert, secrets.JoinCAKey)
	if err != nil {
		return fmt.Errorf("join service: join CA: %w", err)
	}
	records, err := a.platform.Records(ctx, self, platform.Env{Calls: apiCalls(tel.metrics), Logger: log})
	if err != nil {
		return fmt.Errorf("join service: %w", err)
	}
	kubeconfig, server := a.cfg.Kubeconfig, ""
	if kubeconfig == "" {
		kubeconfig = filepath.Join(a.cfg.Paths.KubernetesDir, "admin.conf")
		// kubeadm's admin.conf names the cluster's endpoint, which may be another control-plane node. The
		// join service asks this node's own API server instead, so that it serves whenever this node's
		// control plane does: after a power cut, the first control-plane node up gives the others their
		// rejoin tickets.
		if server, err = localAPIServer(kubeconfig, self.Instance.Addresses); err != nil {
			return fmt.Errorf("join service: %w", err)
		}
	}
	kube, err := a.deps.KubeClient(kubeconfig, server)
	if err != nil {
		return fmt.Errorf("join service: %w", err)
	}
	go removeBootstrapAutoApproval(ctx, kube, log)
	ips := make([]net.IP, len(self.Instance.Addresses))
	for i, addr := range self.Instance.Addresses {
		ips[i] = addr.AsSlice()
	}
	return serveJoins(ctx, joinServer{
		listen: net.JoinHostPort(a.cfg.JoinListenHost, strconv.Itoa(int(self.UserData.JoinPort))),
		names:  []string{self.Instance.Name}, ips: ips,
		kube: kube, policyFile: a.cfg.PolicyFile, policyConfigMap: a.cfg.PolicyConfigMap,
		initialPolicy: a.publishInitialPolicy, followPolicy: a.followPolicy(log), log: log,
		metrics: tel.metrics, health: tel.server, bootstrapTokens: true,
	}, joinservice.Config{
		Verifier:          records.Verifier,
		Instances:         records.Instances,
		MasterSecret:      secrets.MasterSecret,
		Salt:              secrets.Salt,
		KubernetesCA:      kubeCA,
		KubeletSigner:     signer,
		APIServerEndpoint: secrets.APIServerEndpoint,
		KubernetesVersion: secrets.KubernetesVersion,
		ControlPlaneFiles: joinservice.PKIFiles(dir),
		JoinCA:            joinCA,
		Logger:            log,
	})
}

// joinServer is where and how a join service serves, whether on a control-plane node or beside an
// external control plane.
type joinServer struct {
	listen string
	// names and ips go into the service's certificate.
	names []string
	ips   []net.IP
	kube  kubernetes.Interface
	// The policy comes from policyFile if set, else from the ConfigMap policyConfigMap in kube-system,
	// which initialPolicy, if set, may create first.
	policyFile, policyConfigMap string
	initialPolicy               func(context.Context, kubernetes.Interface) error
	// followPolicy, if set, runs beside the service with its policy store and the store's first Changed.
	followPolicy func(ctx context.Context, store *policy.Store, changed <-chan struct{})
	log          *slog.Logger
	// metrics and health, if set, are the process's metrics, which the service's then count in, and its
	// health server, which it makes ready once the service is.
	metrics *telemetry.Metrics
	health  *telemetry.Server
	// bootstrapTokens: the service's tickets carry kubeadm bootstrap tokens (the kubeadm join method).
	bootstrapTokens bool
}

// serveJoins runs a join service with cfg (its policy from s) until ctx ends.
func serveJoins(ctx context.Context, s joinServer, cfg joinservice.Config) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	store := policy.NewStore(&policy.Policy{})
	if s.metrics != nil {
		cfg.Metrics = s.metrics
		telemetry.CountKubernetesRequests(s.metrics.Calls(telemetry.APIKubernetes))
		loaded := watchPolicyLoads(ctx, store, s.metrics)
		if s.health != nil {
			api := telemetry.StartProbe(ctx, apiProbeInterval, apiProbeTimeout, apiVersion(s.kube), s.metrics.APIReachable)
			s.health.AddCheck("policy", loaded)
			s.health.AddCheck("kubernetes-api", api.Err)
		}
	}
	if s.followPolicy != nil {
		// The empty policy the store starts with is no one's: only what a watcher loads is followed.
		changed := store.Changed()
		go s.followPolicy(ctx, store, changed)
	}
	watchErr := make(chan error, 1)
	if s.policyFile != "" {
		go func() { watchErr <- policy.WatchFile(ctx, s.policyFile, 5*time.Second, store, s.log) }()
	} else {
		if s.initialPolicy != nil {
			if err := s.initialPolicy(ctx, s.kube); err != nil {
				s.log.Warn("publishing the initial join policy", "error", err)
			}
		}
		go func() {
			watchErr <- policy.WatchConfigMap(ctx, s.kube, joinservice.Namespace, s.policyConfigMap, store, s.log)
		}()
	}
	cfg.Policy = store
	records, err := joinservice.WatchNodeRecords(ctx, s.kube, s.bootstrapTokens)
	if err != nil {
		return fmt.Errorf("watching the nodes' records: %w", err)
	}
	if s.bootstrapTokens {
		cfg.Tokens = &joinservice.KubeTokens{Client: s.kube, Records: records}
	}
	disks := &joinservice.KubeDisks{Client: s.kube, Records: records}
	cfg.Disks = disks
	go collectDiskRecords(ctx, disks, cfg.Instances, s.log)
	svc, err := joinservice.New(cfg)
	if err != nil {
		return err
	}
	cert, err := serverCert(cfg.JoinCA, s.names, s.ips)
	if err != nil {
		return fmt.Errorf("join service certificate: %w", err)
	}
	lis, err := net.Listen("tcp", s.listen)
	if err != nil {
		return fmt.Errorf("join service: %w", err)
	}
	admitted := svc.Listen(lis, joinConnectionsPerCPU*runtime.GOMAXPROCS(0), rpc.DefaultPerAddress)
	if s.metrics != nil {
		s.metrics.WatchAdmission(admitted)
	}
	gs := grpc.NewServer(append(rpc.ServerOptions(cert), rpc.OneExchange())...)
	berthv1.RegisterJoinServiceServer(gs, svc)
	served := make(chan error, 1)
	go func() { served <- gs.Serve(admitted) }()
	s.log.Info("join service listening", "address", lis.Addr().String(), "method", cfg.Method.String())
	select {
	case <-ctx.Done():
		stopGracefully(gs, 10*time.Second)
		return nil
	case err := <-served:
		return fmt.Errorf("join service: %w", err)
	case err := <-watchErr:
		gs.Stop()
		return fmt.Errorf("join service: watching the join policy: %w", err)
	}
}

// localAPIServer is the API server of this node: its first address, at the port of kubeconfig's server.
func localAPIServer(kubeconfig string, addrs []netip.Addr) (string, error) {
	if len(addrs) == 0 {
		return "", errors.New("the instance record lists no address for this node")
	}
	kc, err := clientcmd.LoadFromFile(kubeconfig)
	if err != nil {
		return "", fmt.Errorf("reading %s: %w", kubeconfig, err)
	}
	ctx, ok := kc.Contexts[kc.CurrentContext]
	if !ok || kc.Clusters[ctx.Cluster] == nil {
		return "", fmt.Errorf("%s has no current context with a cluster", kubeconfig)
	}
	u, err := url.Parse(kc.Clusters[ctx.Cluster].Server)
	if err != nil {
		return "", fmt.Errorf("%s: server: %w", kubeconfig, err)
	}
	port := cmp.Or(u.Port(), "443")
	return "https://" + net.JoinHostPort(addrs[0].String(), port), nil
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

// apiCalls is metrics' counter of the requests to api; nil, counting nothing, without metrics.
func apiCalls(metrics *telemetry.Metrics) func(api string) apicalls.Counter {
	if metrics == nil {
		return nil
	}
	return func(api string) apicalls.Counter { return metrics.Calls(api) }
}

// publishInitialPolicy creates the policy ConfigMap from the init request's policy, unless it exists.
func (a *Agent) publishInitialPolicy(ctx context.Context, kube kubernetes.Interface) error {
	data, err := os.ReadFile(filepath.Join(a.cfg.Paths.State, InitialPolicyFile))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	cm := &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: a.cfg.PolicyConfigMap, Namespace: joinservice.Namespace,
			Labels: map[string]string{"app.kubernetes.io/managed-by": "berth"}},
		Data: map[string]string{policy.ConfigMapKey: string(data)},
	}
	_, err = kube.CoreV1().ConfigMaps(joinservice.Namespace).Create(ctx, cm, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		return nil
	}
	return err
}

// kubeletSigning is the Kubernetes CA (certificate file, and key file unless c configures a CFSSL) and,
// with a CFSSL, the signer of kubelet certificates; then the CA's key is not read, and need not be on
// this machine.
func kubeletSigning(certFile, keyFile string, c *CFSSLConfig, log *slog.Logger) (*pki.CA, joinservice.KubeletSigner, error) {
	certPEM, err := os.ReadFile(certFile)
	if err != nil {
		return nil, nil, fmt.Errorf("Kubernetes CA: %w", err)
	}
	if c == nil {
		key, err := os.ReadFile(keyFile)
		if err != nil {
			return nil, nil, fmt.Errorf("Kubernetes CA: %w (configure cfssl to sign kubelet certificates without it)", err)
		}
		ca, err := pki.ParseCA(certPEM, key)
		if err != nil {
			return nil, nil, fmt.Errorf("Kubernetes CA: %w", err)
		}
		return ca, nil, nil
	}
	cert, err := pki.ParseCertPEM(certPEM)
	if err != nil {
		return nil, nil, fmt.Errorf("Kubernetes CA %s: %w", certFile, err)
	}
	hexKey, err := os.ReadFile(c.AuthKeyFile)
	if err != nil {
		return nil, nil, fmt.Errorf("CFSSL auth key: %w", err)
	}
	key, err := cfssl.ParseAuthKey(string(hexKey))
	if err != nil {
		return nil, nil, fmt.Errorf("CFSSL auth key %s: %w", c.AuthKeyFile, err)
	}
	signer := &cfssl.Signer{URL: c.URL, Profile: c.Profile, AuthKey: key, Label: c.Label,
		Logger: log.With("component", "cfssl")}
	return &pki.CA{Cert: cert}, joinservice.CFSSLSigner{Signer: signer}, nil
}

// serverCert issues the join service's certificate, with the join CA in the chain so that nodes holding
// only the CA's pin can verify it.
func serverCert(ca *pki.CA, names []string, ips []net.IP) (tls.Certificate, error) {
	key, err := pki.NewKey()
	if err != nil {
		return tls.Certificate{}, err
	}
	now := time.Now()
	leaf, err := ca.IssueServer(key.Public(), names, ips, now, min(serverCertValidity, ca.Cert.NotAfter.Sub(now)))
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.Certificate{Certificate: [][]byte{leaf.Raw, ca.Cert.Raw}, PrivateKey: key, Leaf: leaf}, nil
}

// removeBootstrapAutoApproval removes kubeadm's auto-approval of bootstrap tokens' node CSRs, which a
// `kubeadm upgrade apply` makes again, retrying until the API server answers or ctx ends.
func removeBootstrapAutoApproval(ctx context.Context, kube kubernetes.Interface, log *slog.Logger) {
	err := backoff.Retry(ctx, backoff.Policy{Max: time.Minute}, nil, nil, func(ctx context.Context) error {
		removed, err := joinservice.RemoveBootstrapAutoApproval(ctx, kube)
		if removed {
			log.Warn("removed kubeadm's auto-approval of bootstrap tokens' node certificates: the join service alone gives nodes their identity",
				"cluster_role_binding", joinservice.BootstrapAutoApproveBinding)
		}
		return err
	}, nil)
	if err != nil && ctx.Err() == nil {
		log.Error("removing kubeadm's auto-approval of bootstrap tokens' node certificates", "error", err)
	}
}

// diskRecordSweep is how often a join service looks for the disk records of instances that are gone.
const diskRecordSweep = 10 * time.Minute

// collectDiskRecords removes, every diskRecordSweep until ctx ends, the disk records of instances that have
// been gone for joinservice.DefaultRetention. Every join service sweeps; removing a record twice is harmless.
func collectDiskRecords(ctx context.Context, disks *joinservice.KubeDisks, lookup joinservice.InstanceLookup, log *slog.Logger) {
	t := time.NewTicker(diskRecordSweep)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		removed, err := disks.Collect(ctx, lookup, joinservice.DefaultRetention, time.Now())
		if len(removed) > 0 {
			log.Info("removed the disk records of instances gone for longer than the retention",
				"disks", removed, "retention", joinservice.DefaultRetention.String())
		}
		if err != nil && ctx.Err() == nil {
			log.Warn("collecting disk records", "error", err)
		}
	}
}

// How the readiness check sees the Kubernetes API: a cheap request (/version) in the background, so that a
// load balancer's probes never reach the API server.
const (
	apiProbeInterval = 10 * time.Second
	apiProbeTimeout  = 5 * time.Second
)

// processTelemetry is the agent process's metrics and health server: one per process, started by the first
// server that runs (the init server, then the join service in the same boot), when agent.yaml sets
// metricsListen.
type processTelemetry struct {
	once    sync.Once
	metrics *telemetry.Metrics
	server  *telemetry.Server
	err     error
}

// startTelemetry starts the process's metrics and health server on metricsListen, once, serving until ctx
// ends; without metricsListen it returns nil metrics and server.
func (a *Agent) startTelemetry(ctx context.Context) (*processTelemetry, error) {
	t := &a.telemetry
	t.once.Do(func() {
		if a.cfg.MetricsListen == "" {
			return
		}
		lis, err := net.Listen("tcp", a.cfg.MetricsListen)
		if err != nil {
			t.err = fmt.Errorf("metrics listener: %w", err)
			return
		}
		log := a.log.With("component", "metrics")
		t.metrics = telemetry.New(telemetry.Labels{
			JoinCalls: joinservice.Calls, JoinRefusals: joinservice.RefusalReasons, JoinErrors: joinservice.ErrorKinds,
			InitResults: initserver.Results,
		})
		t.server = telemetry.NewServer(t.metrics, log)
		go func() {
			if err := t.server.Serve(ctx, lis); err != nil {
				log.Error("serving metrics", "error", err)
			}
		}()
		log.Info("metrics and health listening", "address", lis.Addr().String())
	})
	return t, t.err
}

// watchPolicyLoads records each policy the store's source loads in metrics, until ctx ends, and returns a
// readiness check that passes once one was loaded. It takes the store's Changed at once, before any source
// can set the store.
func watchPolicyLoads(ctx context.Context, store *policy.Store, metrics *telemetry.Metrics) telemetry.Check {
	var loaded atomic.Bool
	changed := store.Changed()
	go func() {
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
	}()
	return func() error {
		if !loaded.Load() {
			return errors.New("no join policy loaded yet")
		}
		return nil
	}
}
