package agent

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/berthlabs/berth/internal/backoff"
	"github.com/berthlabs/berth/internal/cloud/apicalls"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/nodeagent/internal/initserver"
	"github.com/berthlabs/berth/nodeagent/internal/joinserver"
	"github.com/berthlabs/berth/nodeagent/internal/joinservice"
	"github.com/berthlabs/berth/nodeagent/internal/kubecerts"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
	"github.com/berthlabs/berth/nodeagent/internal/platform"
	"github.com/berthlabs/berth/nodeagent/internal/telemetry"
)

// InitialPolicyFile is where the init server leaves the policy of the init request, for the join service
// to publish as its ConfigMap when none exists yet.
const InitialPolicyFile = "join-policy.yaml"

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
	// The platform first: one that cannot tell who a node is (bare metal) says so, rather than the missing
	// secrets of a node that was never a control plane.
	records, err := a.platform.Records(ctx, self, platform.Env{Calls: apiCalls(tel.metrics), Logger: log})
	if err != nil {
		return fmt.Errorf("join service: %w", err)
	}
	secrets, err := nodestate.ReadSecrets(a.cfg.Paths.State)
	if err != nil {
		return fmt.Errorf("join service: %w", err)
	}
	dir := a.cfg.Paths.PKIDir()
	kubeCA, signer, err := joinserver.KubeletSigning(filepath.Join(dir, "ca.crt"), filepath.Join(dir, "ca.key"), a.cfg.CFSSL, a.log)
	if err != nil {
		return fmt.Errorf("join service: %w", err)
	}
	joinCA, err := pki.ParseCA(secrets.JoinCACert, secrets.JoinCAKey)
	if err != nil {
		return fmt.Errorf("join service: join CA: %w", err)
	}
	kubeconfig, server := a.cfg.Kubeconfig, ""
	if kubeconfig == "" {
		// kubeadm's admin.conf names the cluster's endpoint, which may be another control-plane node. The
		// join service asks this node's own API server instead, so that it serves whenever this node's
		// control plane does: after a power cut, the first control-plane node up gives the others their
		// rejoin tickets.
		if server, err = localAPIServer(a.adminConf(), self.Instance.Addresses); err != nil {
			return fmt.Errorf("join service: %w", err)
		}
		if kubeconfig, err = a.writeAdminCopy(); err != nil {
			return fmt.Errorf("join service: %w", err)
		}
	}
	kube, err := a.deps.KubeClient(kubeconfig, server)
	if err != nil {
		return fmt.Errorf("join service: %w", err)
	}
	var running sync.WaitGroup
	defer running.Wait()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	running.Go(func() { removeBootstrapAutoApproval(ctx, kube, log) })
	ips := make([]net.IP, len(self.Instance.Addresses))
	for i, addr := range self.Instance.Addresses {
		ips[i] = addr.AsSlice()
	}
	return joinserver.Serve(ctx, joinserver.Options{
		Listen: net.JoinHostPort(a.cfg.JoinListenHost, strconv.Itoa(int(self.UserData.JoinPort))),
		Names:  []string{self.Instance.Name}, IPs: ips,
		Kube: kube, PolicyFile: a.cfg.PolicyFile, PolicyConfigMap: a.cfg.PolicyConfigMap,
		InitialPolicy: a.publishInitialPolicy, FollowPolicy: a.followPolicy(), Log: log,
		Metrics: tel.metrics, Health: tel.server, BootstrapTokens: true, GoneNodeGrace: a.cfg.goneNodeGrace(),
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

// processTelemetry is the agent process's metrics and health server: one per process, started when its boot
// starts and serving the init server and the join service of the same process, when agent.yaml sets
// metricsListen.
type processTelemetry struct {
	once    sync.Once
	metrics *telemetry.Metrics
	server  *telemetry.Server
	err     error
}

// newMetrics are the agent process's metrics, with the fixed label values of every server it may run.
func (a *Agent) newMetrics(log *slog.Logger) *telemetry.Metrics {
	labels := joinserver.TelemetryLabels(a.deps.Build)
	labels.InitResults, labels.BootSteps = initserver.Results, bootSteps()
	labels.Unlocks, labels.LocalUnlockFallbacks = unlockVias, localUnlockFallbacks
	m := telemetry.New(labels)
	m.WatchCertificates(kubecerts.Files(a.cfg.Paths), log)
	return m
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
		t.metrics = a.newMetrics(log)
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
