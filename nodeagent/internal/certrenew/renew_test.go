package certrenew

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/yaml"

	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/nodeagent/internal/cplease"
	"github.com/berthlabs/berth/nodeagent/internal/kubecerts"
	"github.com/berthlabs/berth/test/kubetest"
)

// node is a control-plane node's files: kubeadm's certificates, of which the test sets the ends, and its
// static pod manifests.
type node struct {
	name        string
	certDir     string
	manifestDir string
	files       []kubecerts.File
}

func newNode(t *testing.T, name string) *node {
	t.Helper()
	dir := t.TempDir()
	n := &node{name: name, certDir: filepath.Join(dir, "pki"), manifestDir: filepath.Join(dir, "manifests")}
	for _, d := range []string{n.certDir, n.manifestDir} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	n.files = []kubecerts.File{
		{Name: "ca", Path: filepath.Join(n.certDir, "ca.crt"), CA: true},
		{Name: "apiserver", Path: filepath.Join(n.certDir, "apiserver.crt"), Kubeadm: true},
		{Name: "etcd-peer", Path: filepath.Join(n.certDir, "etcd-peer.crt"), Kubeadm: true},
		{Name: "scheduler.conf", Path: filepath.Join(dir, "scheduler.conf"), Kubeadm: true},
	}
	for _, c := range components {
		pod := corev1.Pod{TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Pod"},
			ObjectMeta: metav1.ObjectMeta{Name: c, Namespace: metav1.NamespaceSystem},
			Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: c, Image: "registry.k8s.io/" + c + ":v1.36.3"}}}}
		data, err := yaml.Marshal(pod)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(n.manifestDir, c+".yaml"), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return n
}

// setEnds writes each certificate named in ends with that end; the CA ends in ten years.
func (n *node) setEnds(t *testing.T, ends map[string]time.Time) {
	t.Helper()
	for _, f := range n.files {
		end, ok := ends[f.Name]
		if f.CA {
			end, ok = time.Now().AddDate(10, 0, 0), true
		}
		if !ok {
			continue
		}
		ca, err := pki.NewCA(f.Name, end.Add(-time.Hour), time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(f.Path, ca.CertPEM(), 0o600); err != nil {
			t.Fatal(err)
		}
	}
}

// TestDue: the renewal is due RenewBefore before the first of kubeadm's certificates ends; a CA's end does not
// count (kubeadm does not renew CAs), a missing file is skipped, and a node without any has nothing due.
func TestDue(t *testing.T) {
	n := newNode(t, "cp-0")
	r := New(Config{Files: n.files, RenewBefore: 24 * time.Hour})
	if _, _, err := r.Due(); err == nil {
		t.Error("due on a node without certificates")
	}
	end := time.Now().Add(90 * 24 * time.Hour).Truncate(time.Second)
	n.setEnds(t, map[string]time.Time{"apiserver": end.Add(time.Hour), "etcd-peer": end})
	at, first, err := r.Due()
	if err != nil || first != "etcd-peer" || !at.Equal(end.Add(-24*time.Hour)) {
		t.Errorf("due %v for %s (%v), want %v for etcd-peer", at, first, err, end.Add(-24*time.Hour))
	}
	if err := os.WriteFile(n.files[3].Path, []byte("{"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, err := r.Due(); err == nil || !strings.Contains(err.Error(), "scheduler.conf") {
		t.Errorf("an unreadable certificate: %v, want an error naming it", err)
	}
}

// kubeadmFake renews like `kubeadm certs renew all`: every certificate of its node gets a new end.
type kubeadmFake struct {
	t      *testing.T
	n      *node
	newEnd time.Time
	fail   error

	mu    sync.Mutex
	calls int
}

func (k *kubeadmFake) RenewCertificates(ctx context.Context, kubeconfig, certDir string, progress func(string)) error {
	k.mu.Lock()
	k.calls++
	k.mu.Unlock()
	if certDir != k.n.certDir || kubeconfig == "" {
		return fmt.Errorf("renewing %s with %q, want %s", certDir, kubeconfig, k.n.certDir)
	}
	if k.fail != nil {
		return k.fail
	}
	ends := map[string]time.Time{}
	for _, f := range k.n.files {
		ends[f.Name] = k.newEnd
	}
	k.n.setEnds(k.t, ends)
	return nil
}

// kubelet plays the node's kubelet until ctx ends: a manifest that changes becomes a new ready mirror pod.
func kubelet(ctx context.Context, t *testing.T, client kubernetes.Interface, n *node) {
	seen := map[string]string{}
	for ctx.Err() == nil {
		for _, c := range components {
			data, err := os.ReadFile(filepath.Join(n.manifestDir, c+".yaml"))
			if err != nil {
				t.Error(err)
				return
			}
			if seen[c] == string(data) {
				continue
			}
			var pod corev1.Pod
			if err := yaml.Unmarshal(data, &pod); err != nil {
				t.Errorf("the renewer wrote a manifest that does not parse: %v", err)
				return
			}
			pods := client.CoreV1().Pods(metav1.NamespaceSystem)
			// At once: no kubelet confirms a graceful deletion.
			_ = pods.Delete(ctx, c+"-"+n.name, *metav1.NewDeleteOptions(0))
			mirror := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: c + "-" + n.name, Annotations: pod.Annotations}, Spec: pod.Spec}
			mirror.Spec.NodeName = n.name
			created, err := pods.Create(ctx, mirror, metav1.CreateOptions{})
			if err == nil {
				created.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}
				_, err = pods.UpdateStatus(ctx, created, metav1.UpdateOptions{})
			}
			if err != nil {
				if ctx.Err() == nil {
					t.Logf("kubelet of %s: %v", n.name, err)
				}
				continue
			}
			seen[c] = string(data)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// TestRenewUnderLease runs two control-plane nodes' renewers against a real API server: both are due; one
// renews at a time under the Lease while the other waits; each restarts its own components (their manifests
// marked, their mirror pods ready again), and a node gives the Lease up after a failed renewal too.
func TestRenewUnderLease(t *testing.T) {
	api := kubetest.Start(t)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	// No controller manager makes kube-system's default service account, which pods need.
	if _, err := api.Client.CoreV1().ServiceAccounts(metav1.NamespaceSystem).Create(ctx,
		&corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	soon, later := time.Now().Add(time.Hour), time.Now().AddDate(1, 0, 0)
	var logs bytes.Buffer
	var logMu sync.Mutex
	logger := slog.New(slog.NewTextHandler(&lockedWriter{w: &logs, mu: &logMu}, &slog.HandlerOptions{Level: slog.LevelDebug}))
	renewers := map[string]*Renewer{}
	fakes := map[string]*kubeadmFake{}
	var kubelets sync.WaitGroup
	for _, name := range []string{"cp-0", "cp-1"} {
		n := newNode(t, name)
		n.setEnds(t, map[string]time.Time{"apiserver": soon, "etcd-peer": later, "scheduler.conf": later})
		kubelets.Go(func() { kubelet(ctx, t, api.Client, n) })
		fakes[name] = &kubeadmFake{t: t, n: n, newEnd: later}
		renewers[name] = New(Config{Node: name, Files: n.files, Kubeconfig: "admin.conf", CertDir: n.certDir, ManifestDir: n.manifestDir,
			Kubeadm: fakes[name], Client: func() (kubernetes.Interface, error) { return api.Client, nil },
			RenewBefore: 24 * time.Hour, Logger: logger.With("node", name)})
	}

	// Before the nodes' directories go.
	t.Cleanup(func() {
		cancel()
		kubelets.Wait()
	})

	// cp-1 holds the Lease, as if it were renewing: cp-0 waits.
	busy := &cplease.Lease{Client: api.Client, Holder: "cp-1", Duration: time.Minute}
	if taken, _, err := busy.TryAcquire(ctx); !taken || err != nil {
		t.Fatalf("cp-1 took the lease: %v, %v", taken, err)
	}
	if wait := renewers["cp-0"].step(ctx); wait != busyAfter || fakes["cp-0"].calls != 0 {
		t.Fatalf("cp-0 with the lease held: waits %v after %d renewals, want %v and none", wait, fakes["cp-0"].calls, busyAfter)
	}
	if err := busy.Release(ctx); err != nil {
		t.Fatal(err)
	}

	// Both renew, one after the other.
	var wg sync.WaitGroup
	waits := map[string]time.Duration{}
	var mu sync.Mutex
	for name, r := range renewers {
		wg.Go(func() {
			for {
				wait := r.step(ctx)
				if wait != busyAfter {
					mu.Lock()
					waits[name] = wait
					mu.Unlock()
					return
				}
				time.Sleep(100 * time.Millisecond)
			}
		})
	}
	wg.Wait()
	for name, r := range renewers {
		if fakes[name].calls != 1 {
			t.Errorf("%s renewed %d times, want once", name, fakes[name].calls)
		}
		if at, _, err := r.Due(); err != nil || !at.After(time.Now().AddDate(0, 11, 0)) {
			t.Errorf("%s is due again at %v (%v), want in about a year less a day", name, at, err)
		}
		if waits[name] != 0 {
			t.Errorf("%s waits %v after its renewal, want to look again at once", name, waits[name])
		}
		pod, err := api.Client.CoreV1().Pods(metav1.NamespaceSystem).Get(ctx, "kube-apiserver-"+name, metav1.GetOptions{})
		if err != nil || pod.Annotations[RenewedAnnotation] == "" {
			t.Errorf("%s's API server was not restarted by the renewal: %v, %v", name, pod.GetAnnotations(), err)
		}
	}
	logMu.Lock()
	if !strings.Contains(logs.String(), "another control-plane node is renewing") {
		t.Errorf("no node waited for the other:\n%s", logs.String())
	}
	logMu.Unlock()

	// A failed renewal gives the Lease up and says so through the observer.
	fakes["cp-0"].fail = errors.New("kubeadm: the CA key is gone")
	fakes["cp-0"].n.setEnds(t, map[string]time.Time{"apiserver": soon})
	obs := &outcomes{}
	renewers["cp-0"].cfg.Observer = obs
	if wait := renewers["cp-0"].step(ctx); wait != retryAfter || obs.failed != 1 {
		t.Errorf("after a failed renewal: waits %v, %d failures observed; want %v and one", wait, obs.failed, retryAfter)
	}
	l, err := api.Client.CoordinationV1().Leases(metav1.NamespaceSystem).Get(ctx, cplease.Name, metav1.GetOptions{})
	if err != nil || cplease.HolderOf(l) != "" {
		t.Errorf("lease after the failed renewal: held by %q (%v), want released", cplease.HolderOf(l), err)
	}
}

type outcomes struct{ ok, failed int }

func (o *outcomes) CertificatesRenewed(err error) {
	if err != nil {
		o.failed++
		return
	}
	o.ok++
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
