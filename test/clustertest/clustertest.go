// Package clustertest is the in-process cluster fixture the join tests share (the join lab, join storms,
// the agent's boot test): a cluster's secrets and CAs, the EK CA its swtpms are manufactured under, and the
// lab's metadata service on loopback with the cluster's user-data and instance records. What serves joins
// (an in-process join service, a join-service process, a kube-apiserver) is each harness's own; what a
// cluster is made of is here once.
package clustertest

import (
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/keys"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/test/swtpm/swtpmtest"
)

// QuotedPCRs are the PCRs the fixture's policies pin. A fresh swtpm starts with them all zero.
var QuotedPCRs = []int{0, 4, 7, 9, 11}

// ServiceAddr is where the cluster's own control-plane instance, "cp-0", and its join service are unless
// Options say otherwise.
var ServiceAddr = netip.MustParseAddr("127.0.0.1")

// Options says what differs between clusters.
type Options struct {
	// Name is the cluster's name in the user-data.
	Name string
	// JoinPort is where the join service listens, on ServiceAddr.
	JoinPort uint16
	// KubernetesCA is the cluster CA, such as a kube-apiserver's; nil makes one.
	KubernetesCA *pki.CA
	// ControlPlaneAddr is cp-0's address; zero means ServiceAddr.
	ControlPlaneAddr netip.Addr
	// InitSecretHash goes into the user-data, for clusters that a test initializes.
	InitSecretHash string
}

// Cluster is one cluster's secrets, CAs and metadata.
type Cluster struct {
	t            testing.TB
	EKCA         *swtpmtest.CA
	JoinCA       *pki.CA
	KubeCA       *pki.CA
	Master, Salt []byte
	Meta         *metadata.Server
	MetaURL      string

	mu  sync.Mutex
	doc metadata.Document
}

// New makes the cluster's secrets and CAs and serves its metadata until the test ends; its only instance
// is the control-plane node "cp-0".
func New(t testing.TB, o Options) *Cluster {
	t.Helper()
	c := &Cluster{t: t, EKCA: swtpmtest.NewCA(t), KubeCA: o.KubernetesCA}
	cpAddr := o.ControlPlaneAddr
	if !cpAddr.IsValid() {
		cpAddr = ServiceAddr
	}
	var err error
	now := time.Now()
	if c.JoinCA, err = pki.NewCA("berth-join-ca", now, 10*365*24*time.Hour); err != nil {
		t.Fatal(err)
	}
	if c.KubeCA == nil {
		if c.KubeCA, err = pki.NewCA("kubernetes", now, 10*365*24*time.Hour); err != nil {
			t.Fatal(err)
		}
	}
	if c.Master, err = keys.NewSecret(); err != nil {
		t.Fatal(err)
	}
	if c.Salt, err = keys.NewSecret(); err != nil {
		t.Fatal(err)
	}
	c.doc = metadata.Document{
		UserData: metadata.UserData{ClusterName: o.Name, JoinPort: o.JoinPort, JoinCAPin: pki.SPKIPin(c.JoinCA.Cert),
			InitSecretHash: o.InitSecretHash},
		Instances: []metadata.Instance{{Name: "cp-0", Role: metadata.RoleControlPlane, Addresses: []netip.Addr{cpAddr}}},
	}
	c.Meta = metadata.NewServer(c.document(), slog.New(slog.DiscardHandler))
	c.MetaURL = "http://" + ServeMetadata(t, c.Meta)
	return c
}

func (c *Cluster) document() *metadata.Document {
	d := c.doc
	d.Instances = slices.Clone(c.doc.Instances)
	return &d
}

// AddInstances records instances, as a cloud would when it launches machines.
func (c *Cluster) AddInstances(instances ...metadata.Instance) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.doc.Instances = append(c.doc.Instances, instances...)
	c.Meta.Replace(c.document())
}

// Metadata is the metadata client of a node at addr.
func (c *Cluster) Metadata(addr netip.Addr) *metadata.Client {
	return &metadata.Client{BaseURL: c.MetaURL, LocalAddr: addr}
}

// DiskKey is the key the cluster derives for a disk.
func (c *Cluster) DiskKey(uuid string) []byte {
	label, err := keys.DiskLabel(uuid)
	if err != nil {
		c.t.Fatal(err)
	}
	k, err := keys.Derive(c.Master, c.Salt, label, 32)
	if err != nil {
		c.t.Fatal(err)
	}
	return k
}

// ServeMetadata serves meta on a loopback port until the test ends and returns its host:port.
func ServeMetadata(t testing.TB, meta *metadata.Server) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: meta, ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(lis)
	t.Cleanup(func() { srv.Close() })
	return lis.Addr().String()
}

// ZeroPolicy allows the measurements of a fresh swtpm for roles.
func ZeroPolicy(name string, roles ...metadata.Role) *policy.Policy {
	pcrs := map[int][]byte{}
	for _, i := range QuotedPCRs {
		pcrs[i] = make([]byte, 32)
	}
	return &policy.Policy{Images: []policy.Image{{Name: name, Roles: roles, PCRs: pcrs}}}
}

// SafeBuffer is a log sink tests can read while servers write to it.
type SafeBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *SafeBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *SafeBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Logf is the test's view of what a component logged, for failure messages.
func (s *SafeBuffer) Logf(format string, args ...any) string {
	return fmt.Sprintf(format, args...) + "\n--- join service log ---\n" + s.String()
}
