// Package lab runs a real Berth cluster on one machine: every node is a network namespace with its own
// address on a lab bridge, a private mount namespace, its own swtpm with an EK certificate, its own LUKS2
// state-disk image, containerd and the real berth-agent in boot mode. The first control-plane node is
// initialized through the attested init client, exactly as the Terraform provider does it; every other node
// joins by itself. Kubernetes runs from binaries built from its Go modules and images built locally from
// them, so nothing is pulled from anywhere.
//
// The lab needs root. Everything it makes carries the prefix "berthlab" (bridge, namespaces, veths,
// cgroups) and lives under its directory, so Down finds and removes all of it.
package lab

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/initclient"
	"github.com/berthlabs/berth/internal/initsecret"
	"github.com/berthlabs/berth/internal/keys"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/internal/swtpm"
)

// QuotedPCRs are the PCRs the lab's nodes quote and its policy pins; a fresh swtpm has them all zero.
var QuotedPCRs = []int{0, 4, 7, 9, 11}

// Ports of the lab's services.
const (
	metadataPort = 7400
	joinPort     = 7450
	initPort     = 7451
)

// KubernetesVersion is what the lab runs.
const KubernetesVersion = "v1.36.3"

// Config is a lab to bring up.
type Config struct {
	Dir         string // the lab's directory (node disks, logs, secrets); removed by Down
	KubeBin     string // directory with kubeadm, kubelet, kubectl, kube-apiserver, … and etcd
	AgentBinary string // berth-agent
	LabBinary   string // this lab's own command, which serves the metadata
	Nodes       []NodeSpec
	Progress    io.Writer
}

// NodeSpec names a node and its role.
type NodeSpec struct {
	Name string
	Role metadata.Role
}

// DefaultNodes is `make lab`: one control-plane node and two workers.
var DefaultNodes = []NodeSpec{
	{"cp-0", metadata.RoleControlPlane}, {"worker-0", metadata.RoleWorker}, {"worker-1", metadata.RoleWorker},
}

// Lab is a running lab.
type Lab struct {
	cfg      Config
	subnet   netip.Prefix
	hostAddr netip.Addr
	metaAddr string
	ekCA     *swtpm.CA
	images   imageSet
	Nodes    []*Node
	// Kubeconfig is the admin kubeconfig the init returned, rewritten for the host.
	Kubeconfig string
	KubeCA     *pki.CA
	JoinCA     *pki.CA
	Timings    map[string]time.Duration
	start      time.Time
}

func (l *Lab) path(p string) string { return filepath.Join(l.cfg.Dir, p) }

func (l *Lab) progress(format string, args ...any) {
	if l.cfg.Progress != nil {
		fmt.Fprintf(l.cfg.Progress, "[%6.1fs] %s\n", time.Since(l.start).Seconds(), fmt.Sprintf(format, args...))
	}
}

// podSubnet is the node's share of the cluster's pod network.
func (l *Lab) podSubnet(n *Node) netip.Prefix {
	i := slices.Index(l.Nodes, n)
	return netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 244, byte(i + 1), 0}), 24)
}

// Node is the lab node called name.
func (l *Lab) Node(name string) *Node {
	for _, n := range l.Nodes {
		if n.Name == name {
			return n
		}
	}
	return nil
}

// ensureHostDir makes a mount point the lab needs on the host and remembers it, so Down removes it again.
func (l *Lab) ensureHostDir(dir string) error {
	if _, err := os.Stat(dir); err == nil {
		return nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	f, err := os.OpenFile(l.path("host-dirs"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	defer f.Close()
	_, err = fmt.Fprintln(f, dir)
	return err
}

// Up brings the lab up: host network, images, nodes; then it initializes the first control-plane node and
// waits until every node is Ready.
func Up(ctx context.Context, cfg Config) (*Lab, error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("the lab needs root: it makes network and mount namespaces, cgroups and LUKS images")
	}
	if len(cfg.Nodes) == 0 || cfg.Nodes[0].Role != metadata.RoleControlPlane {
		return nil, errors.New("the first lab node must be a control-plane node: it is the one initialized")
	}
	l := &Lab{cfg: cfg, start: time.Now(), Timings: map[string]time.Duration{},
		subnet: netip.MustParsePrefix("10.250.0.0/24"), hostAddr: netip.MustParseAddr("10.250.0.1")}
	l.metaAddr = net.JoinHostPort(l.hostAddr.String(), fmt.Sprint(metadataPort))
	if _, err := os.Stat(cfg.Dir); err == nil {
		return nil, fmt.Errorf("%s exists: a lab is up already, or was not taken down (make lab-down)", cfg.Dir)
	}
	if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
		return nil, err
	}
	if err := l.up(ctx); err != nil {
		return l, err
	}
	return l, nil
}

func (l *Lab) up(ctx context.Context) error {
	l.progress("host: bridge %s with %s", bridgeName, l.hostAddr)
	if err := makeCgroup("host"); err != nil {
		return fmt.Errorf("cgroups: %w", err)
	}
	if err := setupBridge(ctx, netip.PrefixFrom(l.hostAddr, l.subnet.Bits()).String()); err != nil {
		return err
	}
	l.progress("images: pause, etcd, kube-apiserver, kube-controller-manager, kube-scheduler, test workload")
	var err error
	if l.images, err = buildImages(ctx, l.cfg.KubeBin, l.path("images")); err != nil {
		return fmt.Errorf("images: %w", err)
	}
	l.progress("cluster secrets, CAs and EK CA (as terraform's berth_secrets makes them)")
	if l.ekCA, err = swtpm.NewCA(l.path("ek-ca")); err != nil {
		return err
	}
	bundle, err := l.ekCA.BundlePEM()
	if err != nil {
		return err
	}
	if err := os.WriteFile(l.path("ek-ca.pem"), bundle, 0o644); err != nil {
		return err
	}
	secrets, err := newSecrets()
	if err != nil {
		return err
	}
	l.KubeCA, l.JoinCA = secrets.kubeCA, secrets.joinCA

	for i, spec := range l.cfg.Nodes {
		addr := netip.AddrFrom4([4]byte{10, 250, 0, byte(10 + i)})
		l.Nodes = append(l.Nodes, &Node{Name: spec.Name, Role: spec.Role, Addr: addr, Dir: l.path("nodes/" + spec.Name), lab: l})
	}
	if err := l.startMetadata(secrets.initHash); err != nil {
		return err
	}
	hosts := "127.0.0.1 localhost\n" + l.hostAddr.String() + " berthlab-host\n"
	for _, n := range l.Nodes {
		hosts += n.Addr.String() + " " + n.Name + "\n"
	}
	if err := os.WriteFile(l.path("hosts"), []byte(hosts), 0o644); err != nil {
		return err
	}
	for _, n := range l.Nodes {
		l.progress("%s: namespaces, mounts, swtpm, LUKS2 state image", n.Name)
		if err := n.create(ctx); err != nil {
			return fmt.Errorf("node %s: %w", n.Name, err)
		}
		if err := n.powerOn(ctx); err != nil {
			return fmt.Errorf("node %s: %w", n.Name, err)
		}
		l.progress("%s: berth-agent boot", n.Name)
	}

	cp := l.Nodes[0]
	l.progress("%s: attesting and sending the init request", cp.Name)
	initStart := time.Now()
	result, err := l.initCluster(ctx, cp, secrets)
	if err != nil {
		return l.nodeFailure(cp, "init", err)
	}
	l.Timings["init"] = time.Since(initStart)
	l.progress("%s: cluster %s initialized in %.1fs", cp.Name, result.ClusterId, l.Timings["init"].Seconds())
	l.Kubeconfig = l.path("admin.conf")
	if err := os.WriteFile(l.Kubeconfig, result.Kubeconfig, 0o600); err != nil {
		return err
	}
	return l.WaitReady(ctx, l.Nodes)
}

// powerOn starts a node as a machine that is switched on: a fresh mount namespace over its persistent
// directories, empty /run, then swtpm, containerd and berth-agent.
func (n *Node) powerOn(ctx context.Context) error {
	for _, d := range []string{"fs/run/containerd", "fs/run/netns"} {
		if err := os.RemoveAll(n.path(d)); err != nil {
			return err
		}
	}
	if err := n.mountNamespace(ctx); err != nil {
		return err
	}
	images := []string{n.lab.images.pauseTar, n.lab.images.workloadTar}
	if n.Role == metadata.RoleControlPlane {
		images = append(images, n.lab.images.controlPlane...)
	}
	if err := n.startDaemons(ctx, images); err != nil {
		return err
	}
	return n.boot()
}

// PowerOff stops everything the node runs, its mount namespace included, as a power loss would; its
// disks (directories, state image, TPM state) stay.
func (n *Node) PowerOff() {
	n.stop(10 * time.Second)
	syscall.Kill(n.holder, syscall.SIGKILL)
}

// Reboot powers the node off and on again.
func (n *Node) Reboot(ctx context.Context) error {
	n.PowerOff()
	return n.powerOn(ctx)
}

type labSecrets struct {
	master, salt   []byte
	initSecret     string
	initHash       string
	kubeCA, joinCA *pki.CA
}

func newSecrets() (*labSecrets, error) {
	s := &labSecrets{}
	var err error
	if s.master, err = keys.NewSecret(); err != nil {
		return nil, err
	}
	if s.salt, err = keys.NewSecret(); err != nil {
		return nil, err
	}
	if s.initSecret, err = initsecret.NewSecret(); err != nil {
		return nil, err
	}
	if s.initHash, err = initsecret.Hash([]byte(s.initSecret)); err != nil {
		return nil, err
	}
	now := time.Now()
	if s.kubeCA, err = pki.NewCA("kubernetes", now, 10*365*24*time.Hour); err != nil {
		return nil, err
	}
	if s.joinCA, err = pki.NewCA("berth-join-ca", now, 10*365*24*time.Hour); err != nil {
		return nil, err
	}
	return s, nil
}

// startMetadata runs the lab's instance-metadata service as a daemon on the host side of the bridge.
func (l *Lab) startMetadata(initHash string) error {
	doc := metadata.Document{UserData: metadata.UserData{
		ClusterName: "berthlab", JoinPort: joinPort, JoinCAPin: pki.SPKIPin(l.JoinCA.Cert), InitSecretHash: initHash,
	}}
	for _, n := range l.Nodes {
		doc.Instances = append(doc.Instances, metadata.Instance{Name: n.Name, Role: n.Role, Addresses: []netip.Addr{n.Addr}})
	}
	if err := writeJSON(l.path("metadata.json"), doc); err != nil {
		return err
	}
	out, err := os.Create(l.path("metadata.log"))
	if err != nil {
		return err
	}
	defer out.Close()
	// The lab's own daemons live in /berthlab/host, so that Down finds them too.
	script, err := cgroupScript("host")
	if err != nil {
		return err
	}
	cmd := exec.Command("sh", "-c", script, "sh", l.cfg.LabBinary, "metadata", "--document", l.path("metadata.json"), "--listen", l.metaAddr)
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("metadata service: %w", err)
	}
	go cmd.Wait()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		c, err := net.Dial("tcp", l.metaAddr)
		if err == nil {
			return c.Close()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("metadata service did not listen on %s (see %s)", l.metaAddr, l.path("metadata.log"))
		}
	}
}

// initCluster does what terraform's berth_cluster does: attest the node against the image's measurements,
// then send it the init request.
func (l *Lab) initCluster(ctx context.Context, cp *Node, s *labSecrets) (*berthv1.InitResult, error) {
	roots, inters, err := l.ekCA.Pools()
	if err != nil {
		return nil, err
	}
	expected := map[int][]byte{}
	pcrs := map[int][]byte{}
	for _, i := range QuotedPCRs {
		expected[i] = make([]byte, 32)
		pcrs[i] = make([]byte, 32)
	}
	pol, err := (&policy.Policy{Images: []policy.Image{{Name: "lab-swtpm", PCRs: pcrs,
		Roles: []metadata.Role{metadata.RoleControlPlane, metadata.RoleWorker}}}}).Marshal()
	if err != nil {
		return nil, err
	}
	kubeKey, err := s.kubeCA.KeyPEM()
	if err != nil {
		return nil, err
	}
	joinKey, err := s.joinCA.KeyPEM()
	if err != nil {
		return nil, err
	}
	return initclient.Init(ctx, initclient.Config{
		Endpoint:     net.JoinHostPort(cp.Addr.String(), fmt.Sprint(initPort)),
		Verifier:     attest.NewVerifier(roots, inters, nil),
		ExpectedPCRs: expected,
		Progress:     func(line string) { l.progress("%s: kubeadm: %s", cp.Name, line) },
		Timeout:      10 * time.Minute,
		Request: &berthv1.InitRequest{
			InitSecret: []byte(s.initSecret), MasterSecret: s.master, Salt: s.salt,
			KubernetesCaCertificate: s.kubeCA.CertPEM(), KubernetesCaKey: kubeKey,
			JoinCaCertificate: s.joinCA.CertPEM(), JoinCaKey: joinKey,
			ClusterName: "berthlab", KubernetesVersion: KubernetesVersion, JoinPolicy: pol,
			ControlPlaneEndpoint: net.JoinHostPort(cp.Addr.String(), "6443"),
		},
	})
}

// nodeFailure says which node failed at which step, with the tail of its logs.
func (l *Lab) nodeFailure(n *Node, step string, err error) error {
	var b strings.Builder
	fmt.Fprintf(&b, "node %s, step %s: %v", n.Name, step, err)
	for _, log := range []string{"logs/agent.log", "fs/var/lib/berth/kubelet.log", "logs/containerd.log"} {
		if tail := tailFile(n.path(log), 25); tail != "" {
			fmt.Fprintf(&b, "\n--- %s: last lines of %s ---\n%s", n.Name, n.path(log), tail)
		}
	}
	return errors.New(b.String())
}

func tailFile(path string, lines int) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	all := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	return strings.Join(all[max(0, len(all)-lines):], "\n")
}

// KubeletClientCert is the certificate the node's kubelet authenticates with.
func (n *Node) KubeletClientCert() (*x509.Certificate, error) {
	data, err := os.ReadFile(n.path("fs/var/lib/kubelet/pki/kubelet-client-current.pem"))
	if err != nil {
		return nil, err
	}
	return pki.ParseCertPEM(firstPEM(data))
}
