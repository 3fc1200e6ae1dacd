package agent

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/clusterinfo"
	"github.com/berthlabs/berth/internal/initclient"
	"github.com/berthlabs/berth/internal/initsecret"
	"github.com/berthlabs/berth/internal/luks"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/repotest"
	"github.com/berthlabs/berth/nodeagent/internal/configfile"
	"github.com/berthlabs/berth/nodeagent/internal/joinservice"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
	"github.com/berthlabs/berth/nodeagent/test/joinlab"
	"github.com/berthlabs/berth/test/clustertest"
)

// kubeadmRecorder stands in for kubeadm: init writes an admin kubeconfig, join and reset are recorded, and
// the first failJoins joins fail.
type kubeadmRecorder struct {
	paths     nodestate.Paths
	failJoins int
	mu        sync.Mutex
	calls     []string
}

func (k *kubeadmRecorder) Init(ctx context.Context, configPath string, progress func(string)) error {
	progress("[init] Using Kubernetes version: v1.36.3")
	k.record("init")
	return os.WriteFile(filepath.Join(k.paths.KubernetesDir, "admin.conf"), []byte(`apiVersion: v1
kind: Config
clusters: [{name: boot, cluster: {server: "https://127.0.0.2:6443"}}]
users: [{name: admin, user: {}}]
contexts: [{name: admin@boot, context: {cluster: boot, user: admin}}]
current-context: admin@boot
`), 0o600)
}

func (k *kubeadmRecorder) Join(ctx context.Context, configPath string, progress func(string)) error {
	k.record("join")
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.failJoins > 0 {
		k.failJoins--
		return errors.New("kubeadm join: the machine lost power")
	}
	return nil
}

func (k *kubeadmRecorder) RenewCertificates(ctx context.Context, kubeconfig, certDir string, progress func(string)) error {
	k.record("renew")
	return nil
}

func (k *kubeadmRecorder) Version(context.Context) (string, error) { return "v1.36.3", nil }

func (k *kubeadmRecorder) UpgradeApply(ctx context.Context, kubeconfig, release string, progress func(string)) error {
	k.record("upgrade apply " + release)
	return nil
}

func (k *kubeadmRecorder) UpgradeNode(ctx context.Context, kubeconfig string, progress func(string)) error {
	k.record("upgrade node")
	return nil
}

func (k *kubeadmRecorder) UpgradeAddons(ctx context.Context, kubeconfig, release string, progress func(string)) error {
	k.record("upgrade addons " + release)
	return nil
}

func (k *kubeadmRecorder) Reset(ctx context.Context, progress func(string)) error {
	k.record("reset")
	return nil
}

func (k *kubeadmRecorder) record(s string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.calls = append(k.calls, s)
}

func freePort(t *testing.T, host string) int {
	t.Helper()
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

type labNode struct {
	agent   *Agent
	cfg     *Config
	kubeadm *kubeadmRecorder
	logs    *clustertest.SafeBuffer
}

// TestBootInitThenJoin runs berth-agent's boot for real on two machines: a control-plane node that the init
// client initializes and that then serves joins from its stored secrets, and a worker that joins through it,
// reboots and rejoins.
func TestBootInitThenJoin(t *testing.T) {
	kube := fake.NewClientset()
	initSecret, err := initsecret.NewSecret()
	if err != nil {
		t.Fatal(err)
	}
	hash, err := initsecret.Hash([]byte(initSecret))
	if err != nil {
		t.Fatal(err)
	}
	cpAddr, workerAddr, brokenAddr := netip.MustParseAddr("127.0.0.2"), netip.MustParseAddr("127.0.0.3"), netip.MustParseAddr("127.0.0.4")
	joinPort, initPort := freePort(t, cpAddr.String()), freePort(t, cpAddr.String())
	c := clustertest.New(t, clustertest.Options{Name: "boot", JoinPort: uint16(joinPort), ControlPlaneAddr: cpAddr, InitSecretHash: hash})
	c.AddInstances(metadata.Instance{Name: "worker-0", Role: metadata.RoleWorker, Addresses: []netip.Addr{workerAddr}},
		metadata.Instance{Name: "worker-1", Role: metadata.RoleWorker, Addresses: []netip.Addr{brokenAddr}})
	ekCA, joinCA, kubeCA := c.EKCA, c.JoinCA, c.KubeCA
	bundle := filepath.Join(t.TempDir(), "ek-ca.pem")
	if err := os.WriteFile(bundle, ekCA.BundlePEM(), 0o644); err != nil {
		t.Fatal(err)
	}

	newNode := func(addr netip.Addr) *labNode {
		dir := t.TempDir()
		tpm := ekCA.NewTPM(t)
		img := filepath.Join(dir, "state.img")
		if err := joinlab.CreateSparse(img, 32<<20); err != nil {
			t.Fatal(err)
		}
		cfg := &Config{
			MetadataURL: c.MetaURL, TPM: tpm.Device(), StateDisk: img,
			Paths: nodestate.Paths{State: filepath.Join(dir, "state"), KubernetesDir: filepath.Join(dir, "etc-kubernetes"),
				KubeletDir: filepath.Join(dir, "var-lib-kubelet")},
			SourceAddress: addr.String(), InitListen: net.JoinHostPort(addr.String(), strconv.Itoa(initPort)),
			JoinListenHost: addr.String(), EKCABundle: bundle, PCRs: clustertest.QuotedPCRs,
			RetryMax: configfile.Duration{Duration: 200 * time.Millisecond},
		}
		cfg.Defaults()
		n := &labNode{cfg: cfg, kubeadm: &kubeadmRecorder{paths: cfg.Paths}, logs: &clustertest.SafeBuffer{}}
		deps := RealDeps(cfg, slog.New(slog.NewTextHandler(n.logs, nil)))
		deps.Kubeadm = n.kubeadm
		deps.KubeClient = func(string, string) (kubernetes.Interface, error) { return kube, nil }
		var err error
		if n.agent, err = New(cfg, deps); err != nil {
			t.Fatal(err)
		}
		return n
	}
	cp, worker, broken := newNode(cpAddr), newNode(workerAddr), newNode(brokenAddr)
	broken.kubeadm.failJoins = 1
	// The control-plane node counts its unlocks and seals, and shows its certificates' expiry.
	cp.cfg.MetricsListen = net.JoinHostPort(cpAddr.String(), strconv.Itoa(freePort(t, cpAddr.String())))

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cpCtx, stopCP := context.WithCancel(ctx)
	cpDone := make(chan error, 1)
	go func() { cpDone <- cp.agent.Boot(cpCtx) }()
	stopped := false
	stop := func() error {
		if stopped {
			return nil
		}
		stopped = true
		stopCP()
		return <-cpDone
	}
	t.Cleanup(func() { stop() })

	master, salt := c.Master, c.Salt
	kubeKey, err := kubeCA.KeyPEM()
	if err != nil {
		t.Fatal(err)
	}
	joinKey, err := joinCA.KeyPEM()
	if err != nil {
		t.Fatal(err)
	}
	policyYAML, err := clustertest.ZeroPolicy("swtpm-zero", metadata.RoleControlPlane, metadata.RoleWorker).Marshal()
	if err != nil {
		t.Fatal(err)
	}
	expected := map[int][]byte{}
	for _, i := range clustertest.QuotedPCRs {
		expected[i] = make([]byte, 32)
	}
	var progress []string
	result, err := initclient.Init(ctx, initclient.Config{
		Endpoint:     cp.cfg.InitListen,
		Verifier:     attest.NewVerifier(attest.NewCertChain(ekCA.Roots(), ekCA.Intermediates(), nil)),
		ExpectedPCRs: expected,
		Progress:     func(line string) { progress = append(progress, line) },
		Request: &berthv1.InitRequest{
			InitSecret: []byte(initSecret), MasterSecret: master, Salt: salt,
			KubernetesCaCertificate: kubeCA.CertPEM(), KubernetesCaKey: kubeKey,
			JoinCaCertificate: joinCA.CertPEM(), JoinCaKey: joinKey,
			ClusterName: "boot", KubernetesVersion: repotest.KubernetesVersion, JoinPolicy: policyYAML,
		},
	})
	if err != nil {
		t.Fatal(cp.logs.Logf("init: %v", err))
	}
	if len(result.Kubeconfig) == 0 || len(progress) == 0 {
		t.Fatalf("init result %v, progress %q", result, progress)
	}
	if info, err := clusterinfo.Read(ctx, kube); err != nil || info.ID != result.ClusterId || info.Name != "boot" ||
		info.Init.JoinCACertificate != string(joinCA.CertPEM()) || info.Init.KubernetesVersion != repotest.KubernetesVersion ||
		info.Init.APIServerEndpoint != result.ApiServerEndpoint {
		t.Errorf("cluster record after init: %+v (%v), want cluster %s named boot with its init settings", info, err, result.ClusterId)
	}

	// A worker serves metrics too: its boot, step by step, and its build.
	worker.cfg.MetricsListen = net.JoinHostPort(workerAddr.String(), strconv.Itoa(freePort(t, workerAddr.String())))
	if err := worker.agent.Boot(ctx); err != nil {
		t.Fatal(cp.logs.Logf("worker boot: %v\n--- worker log ---\n%s", err, worker.logs.String()))
	}
	checkBootMetrics(t, "http://"+worker.cfg.MetricsListen+"/metrics")
	st, err := nodestate.Read(worker.cfg.Paths.State)
	if err != nil || st.ClusterID != result.ClusterId || st.Via != nodestate.OwnerJoin {
		t.Fatalf("worker state %+v (%v), cluster %s", st, err, result.ClusterId)
	}
	if s := worker.agent.Status(ctx); s.Disk != "keyed" || s.Member == nil {
		t.Errorf("worker status after join: %+v", s)
	}

	// A reboot: the same disk, keyed, so the agent must take the rejoin path and unlock it.
	if err := worker.agent.Boot(ctx); err != nil {
		t.Fatal(cp.logs.Logf("worker reboot: %v\n--- worker log ---\n%s", err, worker.logs.String()))
	}
	// A worker that does not seal opens its disk with a rejoin ticket; the TPM is not asked, so nothing fell back.
	checkSamples(t, worker.agent, map[string]float64{
		`berth_state_disk_unlock_duration_seconds{via="new_disk"}`: 1, `berth_state_disk_unlock_duration_seconds{via="rejoin_ticket"}`: 1,
		`berth_state_disk_unlock_duration_seconds{via="tpm"}`: 0, `berth_local_unlock_fallbacks_total{reason="nothing_sealed"}`: 0,
		`berth_seals_total{result="ok"}`: 0,
	})
	if got := worker.kubeadm.calls; len(got) != 1 || got[0] != "join" {
		t.Errorf("worker ran kubeadm %v, want one join (a reboot must not join again)", got)
	}
	if got := cp.kubeadm.calls; len(got) != 1 || got[0] != "init" {
		t.Errorf("control-plane node ran kubeadm %v, want one init", got)
	}

	// A node whose kubeadm join fails after its disk was keyed boots again, finds the disk keyed but no
	// membership, resets kubeadm and joins again with the same disk.
	if err := broken.agent.Boot(ctx); err == nil {
		t.Fatal("the first boot of worker-1 succeeded although its kubeadm join failed")
	}
	if s := broken.agent.Status(ctx); s.Disk != "keyed" || s.Member != nil {
		t.Fatalf("worker-1 after the failed join: %+v", s)
	}
	if err := broken.agent.Boot(ctx); err != nil {
		t.Fatal(cp.logs.Logf("worker-1 recovery boot: %v\n--- worker-1 log ---\n%s", err, broken.logs.String()))
	}
	if got := strings.Join(broken.kubeadm.calls, ","); got != "join,reset,join" {
		t.Errorf("worker-1 ran kubeadm %s, want join,reset,join", got)
	}
	if st, err := nodestate.Read(broken.cfg.Paths.State); err != nil || st.ClusterID != result.ClusterId {
		t.Errorf("worker-1 state after recovery: %+v, %v", st, err)
	}

	// The node that ran kubeadm init owns its disk in the registry, as every joined node does, so that other
	// control-plane nodes can give it rejoin tickets.
	cpDisk, err := luks.New(cp.cfg.StateDisk, nil).UUID(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if owner, err := (&joinservice.KubeDisks{Client: kube}).Owner(ctx, cpDisk); err != nil || len(owner) != 64 {
		t.Errorf("disk owner of the init node's disk %s: %q, %v; want its EK fingerprint", cpDisk, owner, err)
	}

	t0 := time.Now()
	if err := stop(); err != nil && !errors.Is(err, context.Canceled) {
		t.Fatalf("control-plane agent: %v", err)
	}
	t.Logf("control-plane agent stopped in %v", time.Since(t0))

	// The lone control-plane node boots again with no join service anywhere: it unlocks its disk from its
	// TPM, sealed to the init request's policy, serves joins again, and the worker rejoins through it.
	cpCtx, stopCP = context.WithCancel(ctx)
	defer stopCP()
	stopped = false
	go func() { cpDone <- cp.agent.Boot(cpCtx) }()
	if err := worker.agent.Boot(ctx); err != nil {
		t.Fatal(cp.logs.Logf("worker boot after the control plane's reboot: %v\n--- worker log ---\n%s", err, worker.logs.String()))
	}
	for _, want := range []string{"disk key sealed to the join policy", "state disk unlocked from the TPM"} {
		if !strings.Contains(cp.logs.String(), want) {
			t.Errorf("the control-plane node's log lacks %q", want)
		}
	}
	if got := cp.kubeadm.calls; len(got) != 1 {
		t.Errorf("control-plane node ran kubeadm %v over two boots, want one init", got)
	}
	// Its process counted both boots' unlocks (the first keyed a new disk, the second unsealed it) and the
	// seals after the init and at each policy load; the cluster's CA, written at the init, shows its expiry.
	checkSamples(t, cp.agent, map[string]float64{
		`berth_state_disk_unlock_duration_seconds{via="new_disk"}`: 1, `berth_state_disk_unlock_duration_seconds{via="tpm"}`: 1,
		`berth_state_disk_unlock_duration_seconds{via="rejoin_ticket"}`: 0, `berth_seals_total{result="error"}`: 0,
		`berth_certificate_expiry_timestamp_seconds{certificate="ca"}`: float64(kubeCA.Cert.NotAfter.Unix()),
	})
	if seals := sample(t, cp.agent, `berth_seals_total{result="ok"}`); seals < 2 {
		t.Errorf("the control-plane node sealed %v times, want at least after its init and at its join service's policy load", seals)
	}
	if err := stop(); err != nil && !errors.Is(err, context.Canceled) {
		t.Fatalf("control-plane agent after reboot: %v", err)
	}
}

// sample is the value of the agent process's series name{label="value"} (a histogram's count), or -1 when
// there is no such series. It reads the registry, which outlives a boot's metrics server in a test that
// boots one agent twice.
func sample(t *testing.T, a *Agent, series string) float64 {
	t.Helper()
	families, err := a.telemetry.metrics.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		for _, m := range f.GetMetric() {
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, l.GetName()+`="`+l.GetValue()+`"`)
			}
			if f.GetName()+"{"+strings.Join(labels, ",")+"}" != series {
				continue
			}
			switch {
			case m.Histogram != nil:
				return float64(m.Histogram.GetSampleCount())
			case m.Counter != nil:
				return m.Counter.GetValue()
			}
			return m.Gauge.GetValue()
		}
	}
	return -1
}

func checkSamples(t *testing.T, a *Agent, want map[string]float64) {
	t.Helper()
	for series, v := range want {
		if got := sample(t, a, series); got != v {
			t.Errorf("%s = %v, want %v", series, got, v)
		}
	}
}

// checkBootMetrics reads a finished boot's metrics at url: every step took its time once, none is in
// progress, the boot has its finish time, and the build is named.
func checkBootMetrics(t *testing.T, url string) {
	t.Helper()
	_, text := fetch(t, url)
	for _, step := range bootSteps() {
		for _, line := range []string{`berth_boot_step{step="` + step + `"} 0`, `berth_boot_step_duration_seconds_count{step="` + step + `"} 1`} {
			if !strings.Contains(text, line+"\n") {
				t.Errorf("the worker's metrics lack %q", line)
			}
		}
	}
	if !strings.Contains(text, "berth_build_info{") || strings.Contains(text, "berth_boot_finished_timestamp_seconds 0\n") ||
		!strings.Contains(text, "berth_boot_finished_timestamp_seconds ") {
		t.Errorf("the worker's metrics lack the build or the boot's finish:\n%s", text)
	}
}
