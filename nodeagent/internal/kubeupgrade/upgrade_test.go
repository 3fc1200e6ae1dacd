package kubeupgrade

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/berthlabs/berth/internal/clusterinfo"
	"github.com/berthlabs/berth/nodeagent/internal/cplease"
	"github.com/berthlabs/berth/test/kubetest"
)

const (
	from = "v1.36.3"
	to   = "v1.37.0"
)

// cluster is a control plane as the API server records it: kubeadm-config, the API servers' mirror pods and
// the Nodes, which the fake kubeadm below changes as the real one would.
type cluster struct {
	t    *testing.T
	kube kubernetes.Interface
}

func (c *cluster) setRelease(release string) error {
	cms := c.kube.CoreV1().ConfigMaps(metav1.NamespaceSystem)
	data := map[string]string{"ClusterConfiguration": "apiVersion: kubeadm.k8s.io/v1beta4\nkind: ClusterConfiguration\nkubernetesVersion: " + release + "\n"}
	cm, err := cms.Get(c.t.Context(), "kubeadm-config", metav1.GetOptions{})
	if err != nil {
		cm = &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "kubeadm-config", Namespace: metav1.NamespaceSystem}, Data: data}
		_, err = cms.Create(c.t.Context(), cm, metav1.CreateOptions{})
		return err
	}
	cm.Data = data
	_, err = cms.Update(c.t.Context(), cm, metav1.UpdateOptions{})
	return err
}

// setAPIServer gives node's kube-apiserver mirror pod the image of release, as the kubelet does when kubeadm
// rewrites the static pod. It returns its error: the fake kubeadm calls it from the upgraders' goroutines.
func (c *cluster) setAPIServer(node, release string) error {
	pods := c.kube.CoreV1().Pods(metav1.NamespaceSystem)
	image := "registry.k8s.io/kube-apiserver:" + release
	pod, err := pods.Get(c.t.Context(), "kube-apiserver-"+node, metav1.GetOptions{})
	if err == nil {
		pod.Spec.Containers[0].Image = image
		_, err = pods.Update(c.t.Context(), pod, metav1.UpdateOptions{})
		return err
	}
	pod = &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "kube-apiserver-" + node, Namespace: metav1.NamespaceSystem,
			Labels: map[string]string{"component": "kube-apiserver", "tier": "control-plane"}},
		Spec: corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "kube-apiserver", Image: image}}},
	}
	_, err = pods.Create(c.t.Context(), pod, metav1.CreateOptions{})
	return err
}

func (c *cluster) setKubelet(node, release string) {
	c.t.Helper()
	nodes := c.kube.CoreV1().Nodes()
	n, err := nodes.Get(c.t.Context(), node, metav1.GetOptions{})
	if err != nil {
		if n, err = nodes.Create(c.t.Context(), &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}}, metav1.CreateOptions{}); err != nil {
			c.t.Fatal(err)
		}
	}
	n.Status.NodeInfo.KubeletVersion = release
	if _, err := nodes.UpdateStatus(c.t.Context(), n, metav1.UpdateOptions{}); err != nil {
		c.t.Fatal(err)
	}
}

func (c *cluster) remove(node string) {
	c.t.Helper()
	// At once: a pod bound to a node otherwise waits for its kubelet, which there is none of here.
	if err := c.kube.CoreV1().Pods(metav1.NamespaceSystem).Delete(c.t.Context(), "kube-apiserver-"+node, *metav1.NewDeleteOptions(0)); err != nil {
		c.t.Fatal(err)
	}
	if err := c.kube.CoreV1().Nodes().Delete(c.t.Context(), node, metav1.DeleteOptions{}); err != nil {
		c.t.Fatal(err)
	}
}

// kubeadmFake is one node's kubeadm: it changes the cluster as the real one's step would, and counts.
type kubeadmFake struct {
	c          *cluster
	node, own  string
	mu         sync.Mutex
	calls      []string
	versions   int
	failAddons error
}

func (k *kubeadmFake) record(call string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.calls = append(k.calls, call)
}

func (k *kubeadmFake) Version(context.Context) (string, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.versions++
	return k.own, nil
}

func (k *kubeadmFake) UpgradeApply(_ context.Context, kubeconfig, release string, progress func(string)) error {
	k.record("apply " + release)
	progress("[upgrade] SUCCESS!")
	if err := k.c.setRelease(release); err != nil {
		return err
	}
	return k.c.setAPIServer(k.node, release)
}

func (k *kubeadmFake) UpgradeNode(_ context.Context, kubeconfig string, progress func(string)) error {
	k.record("node")
	return k.c.setAPIServer(k.node, k.own)
}

func (k *kubeadmFake) UpgradeAddons(_ context.Context, kubeconfig, release string, progress func(string)) error {
	k.record("addons " + release)
	if err := k.failAddons; err != nil {
		k.failAddons = nil
		return err
	}
	return nil
}

func (k *kubeadmFake) took() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	return append([]string(nil), k.calls...)
}

// TestUpgrade: a control plane of one old-image node and two new-image nodes that joined at the old release
// is told to upgrade. Only the new-image nodes act, one at a time under the Lease: the first applies, the
// other upgrades its own node; the addons wait until the roll has replaced every old node; a failed addon step
// is written into the record and taken again; the upgrade ends recorded done.
func TestUpgrade(t *testing.T) {
	api := kubetest.Start(t)
	ctx := t.Context()
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default", Namespace: metav1.NamespaceSystem}}
	if _, err := api.Client.CoreV1().ServiceAccounts(metav1.NamespaceSystem).Create(ctx, sa, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	c := &cluster{t: t, kube: api.Client}
	if err := c.setRelease(from); err != nil {
		t.Fatal(err)
	}
	if err := clusterinfo.Publish(ctx, api.Client, clusterinfo.Info{ID: strings.Repeat("ab", 16), Name: "lab"}); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"cp-0", "cp-1", "cp-2"} {
		if err := c.setAPIServer(n, from); err != nil {
			t.Fatal(err)
		}
	}
	for n, release := range map[string]string{"cp-0": from, "cp-1": to, "cp-2": to, "worker-0": from} {
		c.setKubelet(n, release)
	}

	var logs bytes.Buffer
	var logMu sync.Mutex
	logger := slog.New(slog.NewTextHandler(&lockedWriter{w: &logs, mu: &logMu}, nil))
	fakes := map[string]*kubeadmFake{}
	upgraders := map[string]*Upgrader{}
	upgradedRuns := 0
	for n, own := range map[string]string{"cp-0": from, "cp-1": to, "cp-2": to} {
		fakes[n] = &kubeadmFake{c: c, node: n, own: own}
		upgraders[n] = New(Config{Node: n, Kubeconfig: "admin.conf", Kubeadm: fakes[n],
			Client: func() (kubernetes.Interface, error) { return api.Client, nil },
			Upgraded: func(context.Context, kubernetes.Interface) error {
				logMu.Lock()
				defer logMu.Unlock()
				upgradedRuns++
				return nil
			},
			Logger: logger.With("node", n)})
	}

	// Nothing is instructed: nobody acts, or even runs kubeadm.
	for n, u := range upgraders {
		if wait := u.step(ctx); wait != lookEvery || len(fakes[n].took()) != 0 || fakes[n].versions != 0 {
			t.Fatalf("%s with no upgrade instructed: waits %v after %q and %d kubeadm versions", n, wait, fakes[n].took(), fakes[n].versions)
		}
	}
	if _, err := clusterinfo.InstructUpgrade(ctx, api.Client, to, time.Now()); err != nil {
		t.Fatal(err)
	}

	// A certificate renewal holds the Lease: the new-image nodes wait for it.
	renewal := &cplease.Lease{Client: api.Client, Holder: "cp-0", Duration: time.Minute}
	if taken, _, err := renewal.TryAcquire(ctx); !taken || err != nil {
		t.Fatalf("cp-0 took the lease: %v, %v", taken, err)
	}
	if wait := upgraders["cp-1"].step(ctx); wait != busyAfter || len(fakes["cp-1"].took()) != 0 {
		t.Fatalf("cp-1 with the lease held: waits %v after %q, want %v and nothing done", wait, fakes["cp-1"].took(), busyAfter)
	}
	if err := renewal.Release(ctx); err != nil {
		t.Fatal(err)
	}

	// All three look at once, each until it has nothing left to do before the roll.
	var wg sync.WaitGroup
	for _, u := range upgraders {
		wg.Go(func() {
			for i := 0; u.step(ctx) != lookEvery; i++ {
				if i == 100 {
					t.Errorf("%s still busy after %d steps", u.cfg.Node, i)
					return
				}
				time.Sleep(50 * time.Millisecond)
			}
		})
	}
	wg.Wait()
	if got := fakes["cp-0"].took(); len(got) != 0 {
		t.Errorf("the old-image node ran %q, want nothing", got)
	}
	steps := strings.Join(fakes["cp-1"].took(), ",") + "|" + strings.Join(fakes["cp-2"].took(), ",")
	if steps != "apply "+to+"|node" && steps != "node|apply "+to {
		t.Errorf("the new-image nodes ran %q, want one apply and one node upgrade", steps)
	}
	if upgradedRuns != 2 {
		t.Errorf("Upgraded ran %d times, want twice: after the apply and after the node upgrade", upgradedRuns)
	}
	rec, err := clusterinfo.ReadUpgrade(ctx, api.Client)
	if err != nil || rec.Phase != clusterinfo.PhaseApplied || (rec.Node != "cp-1" && rec.Node != "cp-2") {
		t.Errorf("record after the control plane's upgrade: %+v, %v; want applied by cp-1 or cp-2", rec, err)
	}

	// The roll replaces cp-0 and worker-0. The first addon step fails, and says so in the record.
	c.remove("cp-0")
	c.setKubelet("worker-0", to)
	fakes["cp-1"].failAddons = errors.New("kubeadm upgrade apply phase addon: coredns: timed out")
	if wait := upgraders["cp-1"].step(ctx); wait != retryAfter {
		t.Fatalf("cp-1 after a failed addon step waits %v, want %v", wait, retryAfter)
	}
	rec, err = clusterinfo.ReadUpgrade(ctx, api.Client)
	if err != nil || rec.Phase != clusterinfo.PhaseAddons || !strings.Contains(rec.Message, "coredns: timed out") {
		t.Errorf("record after the failed addon step: %+v, %v; want the addons phase with kubeadm's error", rec, err)
	}
	if wait := upgraders["cp-1"].step(ctx); wait != 0 {
		t.Fatalf("cp-1 after its addon step: waits %v", wait)
	}
	rec, err = clusterinfo.ReadUpgrade(ctx, api.Client)
	if err != nil || rec.Phase != clusterinfo.PhaseDone || rec.Node != "cp-1" || rec.Message != "" {
		t.Errorf("record at the end: %+v, %v; want done by cp-1", rec, err)
	}
	for n, u := range upgraders {
		before := len(fakes[n].took())
		if wait := u.step(ctx); wait != lookEvery || len(fakes[n].took()) != before {
			t.Errorf("%s after the upgrade: waits %v and ran %q", n, wait, fakes[n].took()[before:])
		}
	}
	if got := fakes["cp-1"].took(); got[len(got)-1] != "addons "+to {
		t.Errorf("cp-1 ran %q, want the addons last", got)
	}
	logMu.Lock()
	defer logMu.Unlock()
	for _, want := range []string{"another control-plane node holds the control-plane lease", "upgrade waiting", "waiting for the API servers of cp-0", "the upgrade is done"} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("no log line with %q:\n%s", want, logs.String())
		}
	}
}

type lockedWriter struct {
	w  *bytes.Buffer
	mu *sync.Mutex
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// TestFailedLookIsTakenAgainSoon: an API server that does not answer yet, as a control-plane node's own
// just after its boot, is looked at again at the next look, not after a failed step's wait.
func TestFailedLookIsTakenAgainSoon(t *testing.T) {
	unreachable, err := kubernetes.NewForConfig(&rest.Config{Host: "https://127.0.0.1:1", Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	for name, client := range map[string]func() (kubernetes.Interface, error){
		"no client":         func() (kubernetes.Interface, error) { return nil, errors.New("admin.conf: no such file") },
		"API server not up": func() (kubernetes.Interface, error) { return unreachable, nil },
	} {
		u := New(Config{Node: "cp-0", Kubeconfig: "admin.conf", Kubeadm: &kubeadmFake{node: "cp-0", own: to}, Client: client,
			Upgraded: func(context.Context, kubernetes.Interface) error { return nil }, Logger: slog.New(slog.DiscardHandler)})
		if wait := u.step(t.Context()); wait != lookEvery {
			t.Errorf("%s: the next look in %v, want %v", name, wait, lookEvery)
		}
	}
}
