// Package joinlab stands up the join side of a Berth cluster on loopback for tests: the cluster fixture's
// secrets, CAs and metadata service (test/clustertest), a join service speaking gRPC over TLS 1.3 with a certificate from the join CA, and nodes that each
// have their own swtpm (EK certificate from a test CA), their own LUKS2 state-disk image and their own
// loopback address (127.0.0.2, 127.0.0.3, …), so that the service tells them apart by address as it would in
// a cloud. The Kubernetes API is client-go's fake clientset here; the real API server is the cluster lab's.
package joinlab

import (
	"context"
	"crypto/tls"
	"errors"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/clusterinfo"
	"github.com/berthlabs/berth/internal/luks"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/internal/repotest"
	"github.com/berthlabs/berth/internal/rpc"
	"github.com/berthlabs/berth/nodeagent/internal/joinservice"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
	"github.com/berthlabs/berth/nodeagent/internal/statedisk"
	"github.com/berthlabs/berth/test/clustertest"
	"github.com/berthlabs/berth/test/swtpm/swtpmtest"
)

// Lab is one cluster's join side.
type Lab struct {
	*clustertest.Cluster
	t        testing.TB
	Policy   *policy.Store
	Kube     *fake.Clientset
	JoinAddr string // host:port of the join service
	Logs     *clustertest.SafeBuffer
	Service  *joinservice.Server

	mu   sync.Mutex
	next int
}

// Option changes the lab's join service.
type Option func(*joinservice.Config)

// WithKubeletSigner makes the join service sign kubelet certificates with s instead of the lab's CA key.
func WithKubeletSigner(s joinservice.KubeletSigner) Option {
	return func(c *joinservice.Config) { c.KubeletSigner = s }
}

// WithKubernetesCA gives the join service another cluster CA, such as the one a remote signer holds.
func WithKubernetesCA(ca *pki.CA) Option {
	return func(c *joinservice.Config) { c.KubernetesCA = ca }
}

// WithoutKubeadm makes the join service issue tickets for an external control plane: the kubelet method,
// with these kubelet settings, and no bootstrap tokens.
func WithoutKubeadm(settings *berthv1.KubeletSettings) Option {
	return func(c *joinservice.Config) {
		c.Method, c.Kubelet, c.Tokens, c.APIServers = berthv1.JoinMethod_JOIN_METHOD_KUBELET, settings, nil, nil
	}
}

// New starts the metadata service and the join service. The service's own control-plane instance, "cp-0",
// has 127.0.0.1.
func New(t testing.TB, opts ...Option) *Lab {
	t.Helper()
	// Every node's state disk is a real LUKS2 image; a user's PATH may lack /usr/sbin, where Debian puts it.
	repotest.NeedsTools(t, "cryptsetup")
	joinLis, err := net.Listen("tcp", net.JoinHostPort(clustertest.ServiceAddr.String(), "0"))
	if err != nil {
		t.Fatal(err)
	}
	l := &Lab{t: t, Kube: fake.NewClientset(), Logs: &clustertest.SafeBuffer{}, next: 2,
		JoinAddr: joinLis.Addr().String()}
	l.Cluster = clustertest.New(t, clustertest.Options{Name: "lab", JoinPort: uint16(joinLis.Addr().(*net.TCPAddr).Port)})
	l.Policy = policy.NewStore(clustertest.ZeroPolicy("swtpm-zero", metadata.RoleControlPlane, metadata.RoleWorker))

	cfg := joinservice.Config{
		Verifier:          attest.NewVerifier(attest.NewCertChain(l.EKCA.Roots(), l.EKCA.Intermediates(), nil)),
		Policy:            l.Policy,
		Instances:         &metadata.Client{BaseURL: l.MetaURL},
		Tokens:            &joinservice.KubeTokens{Client: l.Kube},
		Disks:             &joinservice.KubeDisks{Client: l.Kube},
		MasterSecret:      l.Master,
		Salt:              l.Salt,
		KubernetesCA:      l.KubeCA,
		APIServerEndpoint: "127.0.0.1:6443",
		KubernetesVersion: repotest.KubernetesVersion,
		// As on a control-plane node: the API servers' releases from their pods, none until a test makes some.
		APIServers:    &joinservice.KubeAPIServers{Client: l.Kube},
		UpgradeTarget: joinservice.KubeUpgradeTarget{Client: l.Kube},
		ControlPlaneFiles: func() ([]*berthv1.File, error) {
			return []*berthv1.File{{Path: "ca.key", Content: []byte("lab CA key"), Mode: 0o600}}, nil
		},
		JoinCA:  l.JoinCA,
		Timeout: 20 * time.Second,
		// Longer than the lab's join clients back off (500 ms), so that a test sees them honour it.
		HeldBackRetry: time.Second,
		Logger:        slog.New(slog.NewTextHandler(l.Logs, nil)),
	}
	for _, o := range opts {
		o(&cfg)
	}
	l.Service, err = joinservice.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	cert := l.ServerCert(l.JoinCA)
	// The production listener and its limits (admission by instance record, one exchange per connection),
	// with room for the two connections some attacks hold at once, while the server may not yet have seen
	// the previous test's close.
	srv := grpc.NewServer(append(rpc.ServerOptions(cert), rpc.OneExchange())...)
	berthv1.RegisterJoinServiceServer(srv, l.Service)
	go srv.Serve(l.Service.Listen(joinLis, 64, 4))
	t.Cleanup(srv.Stop)
	return l
}

// ServerCert issues a join-service certificate for 127.0.0.1 from ca, chain included.
func (l *Lab) ServerCert(ca *pki.CA) tls.Certificate {
	key, err := pki.NewKey()
	if err != nil {
		l.t.Fatal(err)
	}
	leaf, err := ca.IssueServer(key.Public(), nil, []net.IP{net.IPv4(127, 0, 0, 1)}, time.Now(), time.Hour)
	if err != nil {
		l.t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{leaf.Raw, ca.Cert.Raw}, PrivateKey: key, Leaf: leaf}
}

// Node is one lab machine.
type Node struct {
	Name   string
	Role   metadata.Role
	Addr   netip.Addr
	TPM    *swtpmtest.TPM
	Prover *attest.Prover
	Volume *luks.Volume
	Disk   *statedisk.Disk
	Paths  nodestate.Paths
}

// AddNode makes a machine with the next loopback address and records its instance.
func (l *Lab) AddNode(name string, role metadata.Role) *Node {
	l.t.Helper()
	return l.addNode(name, role, true)
}

// AddUnlistedNode makes a machine that has no instance record: a stranger to the cluster.
func (l *Lab) AddUnlistedNode(name string) *Node {
	l.t.Helper()
	return l.addNode(name, metadata.RoleWorker, false)
}

func (l *Lab) addNode(name string, role metadata.Role, listed bool) *Node {
	l.mu.Lock()
	addr := netip.AddrFrom4([4]byte{127, 0, 0, byte(l.next)})
	l.next++
	l.mu.Unlock()
	if listed {
		l.AddInstances(metadata.Instance{Name: name, Role: role, Addresses: []netip.Addr{addr}})
	}

	n := &Node{Name: name, Role: role, Addr: addr, TPM: l.EKCA.NewTPM(l.t)}
	tpm, err := attest.OpenTPM(n.TPM.Device())
	if err != nil {
		l.t.Fatal(err)
	}
	if n.Prover, err = attest.NewProver(tpm); err != nil {
		l.t.Fatal(err)
	}
	l.t.Cleanup(func() { n.Prover.Close() })
	dir := l.t.TempDir()
	img := filepath.Join(dir, "state.img")
	if err := CreateSparse(img, 32<<20); err != nil {
		l.t.Fatal(err)
	}
	n.Volume = luks.New(img, slog.New(slog.DiscardHandler))
	n.Disk = statedisk.New(n.Volume, slog.New(slog.DiscardHandler))
	n.Paths = nodestate.Paths{State: filepath.Join(dir, "state"), KubernetesDir: filepath.Join(dir, "etc-kubernetes"),
		KubeletDir: filepath.Join(dir, "var-lib-kubelet")}
	return n
}

// Metadata is the node's metadata client, dialing from the node's own address.
func (l *Lab) Metadata(n *Node) *metadata.Client {
	return l.Cluster.Metadata(n.Addr)
}

// CreateSparse makes an empty sparse file of size bytes.
func CreateSparse(path string, size int64) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	return errors.Join(f.Truncate(size), f.Close())
}

// Kubeadm records the joins and inits it is asked to run; the real kubeadm runs in the cluster lab.
type Kubeadm struct {
	// KubernetesDir receives the admin kubeconfig an init writes.
	KubernetesDir string
	mu            sync.Mutex
	Joins         []string // contents of the configuration files
	Inits         int
	Resets        int
}

// Init writes an admin kubeconfig as kubeadm init would.
func (k *Kubeadm) Init(ctx context.Context, configPath string, progress func(string)) error {
	if k.KubernetesDir == "" {
		return errors.New("kubeadm init is not expected here")
	}
	progress("[init] Using Kubernetes version: " + repotest.KubernetesVersion)
	k.mu.Lock()
	k.Inits++
	k.mu.Unlock()
	return nodestate.WriteFile(filepath.Join(k.KubernetesDir, "admin.conf"), []byte("apiVersion: v1\nkind: Config\n"), 0o600)
}

// RecordCluster accepts the cluster record an init publishes; the real record is written in the cluster lab.
func (k *Kubeadm) RecordCluster(context.Context, clusterinfo.Info) error { return nil }

// InstallPodNetwork accepts the pod network an init installs; the real one runs in the cluster lab.
func (k *Kubeadm) InstallPodNetwork(context.Context, string, string) error { return nil }

// Join records the configuration it was given.
func (k *Kubeadm) Join(ctx context.Context, configPath string, progress func(string)) error {
	data, err := os.ReadFile(configPath)
	if err != nil {
		return err
	}
	progress("[preflight] Running pre-flight checks")
	k.mu.Lock()
	k.Joins = append(k.Joins, string(data))
	k.mu.Unlock()
	return nil
}

// Reset counts the resets of interrupted joins.
func (k *Kubeadm) Reset(ctx context.Context, progress func(string)) error {
	progress("[reset] Deleted contents of the etcd data directory")
	k.mu.Lock()
	k.Resets++
	k.mu.Unlock()
	return nil
}
