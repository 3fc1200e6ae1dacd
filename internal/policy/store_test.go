package policy

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/berthlabs/berth/internal/metadata"
)

// eventWait bounds how long a test waits for a watcher to react. It is a
// deadline for a broken watcher, not a performance expectation.
const eventWait = time.Minute

// recorder is a slog.Handler that passes every message to a channel (so tests
// wait for what a watcher did instead of sleeping) and to the test log.
type recorder struct {
	events chan string
	inner  slog.Handler
}

func newRecorder(t *testing.T) (*recorder, *slog.Logger) {
	r := &recorder{events: make(chan string, 64), inner: slog.NewTextHandler(t.Output(), nil)}
	return r, slog.New(r)
}

func (r *recorder) Enabled(context.Context, slog.Level) bool { return true }

func (r *recorder) Handle(ctx context.Context, rec slog.Record) error {
	r.events <- rec.Message
	return r.inner.Handle(ctx, rec)
}

func (r *recorder) WithAttrs(as []slog.Attr) slog.Handler {
	return &recorder{events: r.events, inner: r.inner.WithAttrs(as)}
}

func (r *recorder) WithGroup(name string) slog.Handler {
	return &recorder{events: r.events, inner: r.inner.WithGroup(name)}
}

func (r *recorder) expect(t *testing.T, want string) {
	t.Helper()
	select {
	case got := <-r.events:
		if got != want {
			t.Fatalf("watcher logged %q, want %q", got, want)
		}
	case <-time.After(eventWait):
		t.Fatalf("watcher did not log %q within %v", want, eventWait)
	}
}

func policyYAML(t *testing.T, name string, role metadata.Role) string {
	t.Helper()
	out, err := (&Policy{Images: []Image{{Name: name, Roles: []metadata.Role{role}, PCRs: map[int][]byte{4: pcr(name)}}}}).Marshal()
	if err != nil {
		t.Fatal(err)
	}
	return string(out)
}

func imageNames(p *Policy) []string {
	names := []string{}
	for _, img := range p.Images {
		names = append(names, img.Name)
	}
	return names
}

func expectImages(t *testing.T, s *Store, want ...string) {
	t.Helper()
	got := imageNames(s.Load())
	if len(got) != len(want) {
		t.Fatalf("store holds images %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("store holds images %v, want %v", got, want)
		}
	}
}

func TestStore(t *testing.T) {
	s := NewStore(nil)
	if p := s.Load(); p == nil || len(p.Images) != 0 {
		t.Fatalf("NewStore(nil).Load() = %v, want an empty policy", p)
	}
	if _, err := s.Load().Check(metadata.RoleWorker, nil, time.Now()); err == nil {
		t.Fatal("the empty policy let a node join")
	}
	p := &Policy{Images: []Image{{Name: "a"}}}
	s.Set(p)
	if s.Load() != p {
		t.Fatal("Load does not return what Set stored")
	}
	s.Set(nil)
	expectImages(t, s)
	if NewStore(p).Load() != p {
		t.Fatal("NewStore does not hold its initial policy")
	}
}

// writeFile replaces path in one step, as an operator's tooling (or a
// Kubernetes volume) would, so the watcher never reads half a file.
func writeFile(t *testing.T, path, content string) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func TestWatchFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "policy.yaml")
	writeFile(t, path, policyYAML(t, "first", metadata.RoleWorker))
	rec, logger := newRecorder(t)
	s := NewStore(nil)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- WatchFile(ctx, path, 5*time.Millisecond, s, logger) }()

	rec.expect(t, "join policy loaded")
	expectImages(t, s, "first")

	writeFile(t, path, policyYAML(t, "second", metadata.RoleControlPlane))
	rec.expect(t, "join policy loaded")
	expectImages(t, s, "second")

	writeFile(t, path, "images:\n- name: Bad\n")
	rec.expect(t, "join policy file refused, keeping the current policy")
	expectImages(t, s, "second")

	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	rec.expect(t, "cannot read join policy file, keeping the current policy")
	expectImages(t, s, "second")

	writeFile(t, path, policyYAML(t, "third", metadata.RoleWorker))
	rec.expect(t, "join policy loaded")
	expectImages(t, s, "third")

	cancel()
	if err := <-done; err != nil {
		t.Fatalf("WatchFile returned %v after its context ended, want nil", err)
	}
	select {
	case msg := <-rec.events:
		t.Fatalf("unexpected event %q: an unchanged file was handled again", msg)
	default:
	}
}

func TestWatchFileStartsWithBadFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "policy.yaml")
	writeFile(t, path, "images: [")
	rec, logger := newRecorder(t)
	initial := &Policy{Images: []Image{{Name: "initial"}}}
	s := NewStore(initial)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- WatchFile(ctx, path, time.Hour, s, logger) }()
	rec.expect(t, "join policy file refused, keeping the current policy")
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if s.Load() != initial {
		t.Fatal("a bad file replaced the initial policy")
	}
}

func TestWatchFileBadArguments(t *testing.T) {
	if err := WatchFile(t.Context(), "x", 0, NewStore(nil), nil); err == nil {
		t.Error("WatchFile accepted a zero interval")
	}
	if err := WatchFile(t.Context(), "x", time.Second, nil, nil); err == nil {
		t.Error("WatchFile accepted a nil store")
	}
}

func configMap(name string, data map[string]string) *corev1.ConfigMap {
	return &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "berth-system", Name: name}, Data: data}
}

func TestWatchConfigMap(t *testing.T) {
	const ns, name = "berth-system", "join-policy"
	client := fake.NewClientset()
	cms := client.CoreV1().ConfigMaps(ns)
	rec, logger := newRecorder(t)
	s := NewStore(nil)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- WatchConfigMap(ctx, client, ns, name, s, logger) }()
	rec.expect(t, "join policy ConfigMap does not exist yet, keeping the current policy")

	// create
	if _, err := cms.Create(ctx, configMap(name, map[string]string{ConfigMapKey: policyYAML(t, "first", metadata.RoleWorker)}), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	rec.expect(t, "join policy loaded")
	expectImages(t, s, "first")

	// update
	if _, err := cms.Update(ctx, configMap(name, map[string]string{ConfigMapKey: policyYAML(t, "second", metadata.RoleWorker)}), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	rec.expect(t, "join policy loaded")
	expectImages(t, s, "second")

	// a bad update keeps the old policy
	if _, err := cms.Update(ctx, configMap(name, map[string]string{ConfigMapKey: "images:\n- name: a\n  roles: [boss]\n"}), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	rec.expect(t, "join policy ConfigMap refused, keeping the current policy")
	expectImages(t, s, "second")

	// so does one without the key
	if _, err := cms.Update(ctx, configMap(name, map[string]string{"other.yaml": "x"}), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	rec.expect(t, "join policy ConfigMap lacks the policy key, keeping the current policy")
	expectImages(t, s, "second")

	// another ConfigMap in the namespace never sets the policy: the next event is ours
	if _, err := cms.Create(ctx, configMap("decoy", map[string]string{ConfigMapKey: policyYAML(t, "decoy", metadata.RoleWorker)}), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := cms.Update(ctx, configMap(name, map[string]string{ConfigMapKey: policyYAML(t, "third", metadata.RoleControlPlane)}), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	rec.expect(t, "join policy loaded")
	expectImages(t, s, "third")

	// delete leaves the empty policy
	if err := cms.Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	rec.expect(t, "join policy ConfigMap deleted: the policy is now empty and nothing may join")
	expectImages(t, s)

	cancel()
	if err := <-done; err != nil {
		t.Fatalf("WatchConfigMap returned %v after its context ended, want nil", err)
	}
}

func TestWatchConfigMapExistingAtStart(t *testing.T) {
	client := fake.NewClientset(configMap("join-policy", map[string]string{ConfigMapKey: policyYAML(t, "present", metadata.RoleWorker)}))
	rec, logger := newRecorder(t)
	s := NewStore(nil)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- WatchConfigMap(ctx, client, "berth-system", "join-policy", s, logger) }()
	rec.expect(t, "join policy loaded")
	expectImages(t, s, "present")
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

func TestWatchConfigMapBadArguments(t *testing.T) {
	client := fake.NewClientset()
	if err := WatchConfigMap(t.Context(), client, "", "x", NewStore(nil), nil); err == nil {
		t.Error("WatchConfigMap accepted an empty namespace")
	}
	if err := WatchConfigMap(t.Context(), nil, "ns", "x", NewStore(nil), nil); err == nil {
		t.Error("WatchConfigMap accepted a nil client")
	}
}

func TestStoreChanged(t *testing.T) {
	s := NewStore(nil)
	first := s.Changed()
	if again := s.Changed(); again != first {
		t.Fatal("two calls of Changed before a Set returned different channels")
	}
	select {
	case <-first:
		t.Fatal("Changed is closed before any Set")
	default:
	}
	want := &Policy{Images: []Image{{Name: "a"}}}
	s.Set(want)
	select {
	case <-first:
	default:
		t.Fatal("Set did not close the channel Changed returned")
	}
	if s.Load() != want {
		t.Error("the policy was not set when Changed fired")
	}
	next := s.Changed()
	select {
	case <-next:
		t.Fatal("the channel after a Set is already closed")
	default:
	}
}
