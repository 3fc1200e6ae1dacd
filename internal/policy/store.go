package policy

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
)

// ConfigMapKey is the data key of the join policy in its ConfigMap.
const ConfigMapKey = "policy.yaml"

// DefaultConfigMap is the name of the join policy's ConfigMap in kube-system unless the agents' configuration
// names another (policyConfigMap).
const DefaultConfigMap = "berth-join-policy"

// Store holds the current policy for concurrent readers while a source
// (a file, a ConfigMap) replaces it.
type Store struct {
	current atomic.Pointer[Policy]
	mu      sync.Mutex
	changed chan struct{}
}

// NewStore returns a store holding initial; nil means the empty policy.
func NewStore(initial *Policy) *Store {
	s := &Store{}
	s.Set(initial)
	return s
}

// Load returns the current policy, never nil. Callers must not modify it.
func (s *Store) Load() *Policy {
	return s.current.Load()
}

// Set replaces the current policy; nil means the empty policy (nothing joins).
func (s *Store) Set(p *Policy) {
	if p == nil {
		p = &Policy{}
	}
	s.current.Store(p)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.changed != nil {
		close(s.changed)
		s.changed = nil
	}
}

// Changed returns a channel that is closed by the next Set, for those who act on a new policy (a node that
// seals its disk key to it). Take it before the source that sets the store starts, so that its first policy
// is not missed.
func (s *Store) Changed() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.changed == nil {
		s.changed = make(chan struct{})
	}
	return s.changed
}

// WatchFile reads the policy at path now and then every interval, and sets
// s whenever the content changed and parses. A file that cannot be read or
// parsed is logged once and the current policy is kept. WatchFile returns nil
// when ctx ends, or an error at once for invalid arguments.
func WatchFile(ctx context.Context, path string, interval time.Duration, s *Store, logger *slog.Logger) error {
	if interval <= 0 {
		return fmt.Errorf("watching join policy file: interval %v is not positive", interval)
	}
	if s == nil {
		return errors.New("watching join policy file: no store")
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	w := &fileWatcher{path: path, store: s, logger: logger.With("source", "file", "path", path)}
	w.poll()
	ticker := time.NewTicker(interval)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-ticker.C:
			w.poll()
		}
	}
}

type fileWatcher struct {
	path   string
	store  *Store
	logger *slog.Logger
	// last identifies what the previous poll saw (content digest or read
	// error), so that an unchanged file, good or bad, is neither re-parsed nor
	// logged again.
	last string
}

func (w *fileWatcher) poll() {
	data, err := readBounded(w.path)
	if err != nil {
		state := "error:" + err.Error()
		if state != w.last {
			w.last = state
			w.logger.Error("cannot read join policy file, keeping the current policy", "error", err)
		}
		return
	}
	state := fmt.Sprintf("sha256:%x", sha256.Sum256(data))
	if state == w.last {
		return
	}
	w.last = state
	p, err := Parse(data)
	if err != nil {
		w.logger.Error("join policy file refused, keeping the current policy", "error", err)
		return
	}
	w.store.Set(p)
	w.logger.Info("join policy loaded", "images", len(p.Images), "pcrs", p.PCRIndexes())
}

// readBounded reads at most one byte more than a policy may have, so that a
// huge file costs no memory and Parse still refuses it by size.
func readBounded(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, MaxSize+1))
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", path, err)
	}
	return data, nil
}

// WatchConfigMap follows the ConfigMap namespace/name with an informer and
// sets s from its data key ConfigMapKey whenever it is added or changed. A
// policy that does not parse (or a missing key) is logged and the current
// policy kept; a deleted ConfigMap leaves the empty policy, so nothing joins
// until it is back. WatchConfigMap returns nil when ctx ends, or an error at
// once for invalid arguments.
func WatchConfigMap(ctx context.Context, client kubernetes.Interface, namespace, name string, s *Store, logger *slog.Logger) error {
	if client == nil || s == nil {
		return errors.New("watching join policy ConfigMap: no client or no store")
	}
	if namespace == "" || name == "" {
		return errors.New("watching join policy ConfigMap: namespace and name are required")
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	w := &configMapWatcher{
		namespace: namespace,
		name:      name,
		store:     s,
		logger:    logger.With("source", "configmap", "namespace", namespace, "name", name),
	}

	factory := informers.NewSharedInformerFactoryWithOptions(client, 0,
		informers.WithNamespace(namespace),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("metadata.name", name).String()
		}))
	informer := factory.Core().V1().ConfigMaps().Informer()
	if _, err := informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { w.apply(obj, nil) },
		UpdateFunc: func(oldObj, newObj any) { w.apply(newObj, oldObj) },
		DeleteFunc: w.deleted,
	}); err != nil {
		return fmt.Errorf("watching join policy ConfigMap: %w", err)
	}
	factory.Start(ctx.Done())
	defer factory.Shutdown()

	if cache.WaitForCacheSync(ctx.Done(), informer.HasSynced) {
		if _, exists, err := informer.GetStore().GetByKey(namespace + "/" + name); err == nil && !exists {
			w.logger.Warn("join policy ConfigMap does not exist yet, keeping the current policy")
		}
	}
	<-ctx.Done()
	return nil
}

type configMapWatcher struct {
	namespace, name string
	store           *Store
	logger          *slog.Logger
}

// ours filters events: a fake or older API server may not apply the field
// selector, and only this one ConfigMap may set the policy.
func (w *configMapWatcher) ours(obj any) (*corev1.ConfigMap, bool) {
	cm, ok := obj.(*corev1.ConfigMap)
	return cm, ok && cm.Namespace == w.namespace && cm.Name == w.name
}

func (w *configMapWatcher) apply(obj, oldObj any) {
	cm, ok := w.ours(obj)
	if !ok {
		return
	}
	data, hasKey := cm.Data[ConfigMapKey]
	if old, ok := w.ours(oldObj); ok {
		if oldData, oldHasKey := old.Data[ConfigMapKey]; oldHasKey == hasKey && oldData == data {
			return
		}
	}
	logger := w.logger.With("resourceVersion", cm.ResourceVersion)
	if !hasKey {
		logger.Error("join policy ConfigMap lacks the policy key, keeping the current policy", "key", ConfigMapKey)
		return
	}
	p, err := Parse([]byte(data))
	if err != nil {
		logger.Error("join policy ConfigMap refused, keeping the current policy", "error", err)
		return
	}
	w.store.Set(p)
	logger.Info("join policy loaded", "images", len(p.Images), "pcrs", p.PCRIndexes())
}

func (w *configMapWatcher) deleted(obj any) {
	if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
	}
	if _, ok := w.ours(obj); !ok {
		return
	}
	w.store.Set(nil)
	w.logger.Warn("join policy ConfigMap deleted: the policy is now empty and nothing may join")
}
