// Package nodestate is what a node remembers about its membership, and the lock that decides whether the
// init server or the join client makes it a member.
package nodestate

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"
)

// Owners of the node lock.
const (
	OwnerInit = "init"
	OwnerJoin = "join"
)

// Lock is taken once per boot by whichever of the init server and the join client gets there first; the
// other stops. It is never released: a node becomes a member of one cluster in one way.
type Lock struct {
	mu    sync.Mutex
	owner string
}

// TryLock takes the lock for owner; false if anyone, owner included, holds it already.
func (l *Lock) TryLock(owner string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.owner != "" {
		return false
	}
	l.owner = owner
	return true
}

// Owner is who holds the lock, "" if nobody does.
func (l *Lock) Owner() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.owner
}

// Paths are where a node keeps its files. State lives on the encrypted state disk.
type Paths struct {
	State         string `json:"state"`         // berth's own state, e.g. /var/lib/berth (on the state disk)
	KubernetesDir string `json:"kubernetesDir"` // /etc/kubernetes
	KubeletDir    string `json:"kubeletDir"`    // /var/lib/kubelet
}

// DefaultPaths are the paths on a real node.
var DefaultPaths = Paths{State: "/var/lib/berth", KubernetesDir: "/etc/kubernetes", KubeletDir: "/var/lib/kubelet"}

// PKIDir is kubeadm's certificates directory.
func (p Paths) PKIDir() string { return filepath.Join(p.KubernetesDir, "pki") }

// State is the node's membership record.
type State struct {
	ClusterID string    `json:"clusterID"`
	NodeName  string    `json:"nodeName"`
	Role      string    `json:"role"`
	Via       string    `json:"via"` // OwnerInit or OwnerJoin
	Since     time.Time `json:"since"`
	// KubeletRenewal is set when the node's kubelet cannot rotate its client certificate through the API
	// server (it joined without kubeadm): the agent renews it through the join service.
	KubeletRenewal bool `json:"kubeletRenewal,omitempty"`
}

const stateFile = "node.json"

// ErrNoState means the node never became a member.
var ErrNoState = errors.New("node has not joined a cluster")

// Read loads the membership record from dir.
func Read(dir string) (*State, error) {
	data, err := os.ReadFile(filepath.Join(dir, stateFile))
	if errors.Is(err, os.ErrNotExist) {
		return nil, ErrNoState
	}
	if err != nil {
		return nil, fmt.Errorf("reading node state: %w", err)
	}
	var s State
	if err := json.Unmarshal(data, &s); err != nil {
		return nil, fmt.Errorf("parsing node state %s: %w", filepath.Join(dir, stateFile), err)
	}
	return &s, nil
}

// Write stores the membership record in dir.
func Write(dir string, s *State) error {
	data, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return err
	}
	return WriteFile(filepath.Join(dir, stateFile), data, 0o600)
}

// WriteFile writes atomically and durably (temporary file, fsync, rename, fsync of the directory), creating
// parent directories, so that a crash leaves either the old content or the new, never a torn file, and a
// power loss after it returns keeps the new: without the directory's fsync, a machine switched off seconds
// after a join came back with its disk keyed and its membership record gone (seen in the measured-boot test).
func WriteFile(path string, data []byte, mode os.FileMode) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	tmp := f.Name()
	defer os.Remove(tmp)
	_, err = f.Write(data)
	if err == nil {
		err = f.Chmod(mode)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err == nil {
		err = syncDir(filepath.Dir(path))
	}
	if err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	return nil
}

// syncDir makes the entries of dir, a rename into it among them, durable.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	err = d.Sync()
	if cerr := d.Close(); err == nil {
		err = cerr
	}
	return err
}

// ClusterSecrets is what a control-plane node keeps to serve the join service. It lives only on the
// encrypted state disk, readable by root only.
type ClusterSecrets struct {
	MasterSecret      []byte `json:"masterSecret"`
	Salt              []byte `json:"salt"`
	JoinCACert        []byte `json:"joinCACert"` // PEM
	JoinCAKey         []byte `json:"joinCAKey"`  // PEM PKCS#8
	APIServerEndpoint string `json:"apiServerEndpoint"`
	KubernetesVersion string `json:"kubernetesVersion"`
}

const secretsFile = "cluster-secrets.json"

// WriteSecrets stores s in dir.
func WriteSecrets(dir string, s *ClusterSecrets) error {
	data, err := json.Marshal(s)
	if err != nil {
		return err
	}
	return WriteFile(filepath.Join(dir, secretsFile), data, 0o600)
}

// ReadSecrets loads what WriteSecrets stored; ErrNoState if nothing was.
func ReadSecrets(dir string) (*ClusterSecrets, error) {
	data, err := os.ReadFile(filepath.Join(dir, secretsFile))
	if errors.Is(err, os.ErrNotExist) {
		return nil, ErrNoState
	}
	if err != nil {
		return nil, fmt.Errorf("reading cluster secrets: %w", err)
	}
	var s ClusterSecrets
	if err := json.Unmarshal(data, &s); err != nil {
		return nil, fmt.Errorf("parsing cluster secrets: %w", err)
	}
	return &s, nil
}
