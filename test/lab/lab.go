// Package lab runs a real Berth cluster on one machine: every node is a network namespace with its own
// address on a lab bridge, a private mount namespace, its own swtpm with an EK certificate, its own LUKS2
// state-disk image, containerd and the real berth-agent in boot mode. Kubernetes runs from binaries built
// from its Go modules and images built locally from them, so nothing is pulled from anywhere.
//
// A lab is a host (StartHost: bridge, images, EK CA, image manifest, metadata service) and machines added
// and removed by separate processes (AddNode, RemoveNode), as Terraform creates nodes one resource at a
// time; all its state lives in its directory. Up does it all in one process and also initializes the first
// control-plane node through the attested init client, exactly as the Terraform provider does.
//
// An AWS lab (Config.AWS) makes every node an EC2 instance instead: a TPM without EK certificate, an IMDS of
// its own (AWS's ec2-metadata-mock) inside its network namespace, and an EC2 endpoint that knows it (see
// AWSConfig).
//
// The lab needs root. Everything it makes carries the prefix "berthlab" (bridge, namespaces, veths,
// cgroups) and lives under its directory, so Down finds and removes all of it.
package lab

import (
	"context"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"k8s.io/client-go/tools/clientcmd"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/cloud/aws/ec2instances/ec2test"
	"github.com/berthlabs/berth/internal/cloud/gcp/computeinstances/computetest"
	"github.com/berthlabs/berth/internal/cloud/gcp/shieldedvm/shieldedvmtest"
	"github.com/berthlabs/berth/internal/clustersecrets"
	"github.com/berthlabs/berth/internal/initclient"
	"github.com/berthlabs/berth/internal/initsecret"
	"github.com/berthlabs/berth/internal/keys"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/podnetwork"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/test/swtpm"
)

// QuotedPCRs are the PCRs the lab's nodes quote and its policy pins; a fresh swtpm has them all zero, and
// the lab's firmware extends PCR 11 (see PredictedPCRs).
var QuotedPCRs = []int{0, 4, 7, 9, 11}

// Ports of the lab's services.
const (
	metadataPort = 7400
	joinPort     = 7450
	initPort     = 7451
)

// The lab's network: the host's side of the bridge, and where its metadata service listens.
var (
	labSubnet = netip.MustParsePrefix("10.250.0.0/24")
	hostAddr  = netip.MustParseAddr("10.250.0.1")
	metaAddr  = net.JoinHostPort(hostAddr.String(), strconv.Itoa(metadataPort))
)

// Files of the lab's directory that other processes read.
const (
	hostFile     = "lab.json"
	manifestFile = "berth-image.json"
	ekCAFile     = "ek-ca.pem"
	documentFile = "metadata.json"
	lockFile     = "lab.lock"
)

// HostConfig is the lab's host: what all its nodes share.
type HostConfig struct {
	Dir     string // the lab's directory (node disks, logs, manifest, metadata); removed by Down
	KubeBin string // directory with kubeadm, kubelet, kubectl, kube-apiserver, … and etcd
	// UpgradeKubeBins hold the binaries of the releases the cluster upgrades to, in order: the manifest lists
	// UpgradeImage(i) of the i-th, whose machines run them.
	UpgradeKubeBins []string
	AgentBinary     string // berth-agent
	LabBinary       string // this lab's own command, which serves the metadata
	// AWS, if set, makes every node an EC2 instance (see AWSConfig), GCP a Compute Engine instance (see
	// GCPConfig); with neither, nodes read the lab's own metadata service.
	AWS *AWSConfig
	GCP *GCPConfig
	// ImageDir holds the nodes' container images, each Kubernetes release's in a directory of its own: the
	// first lab of a release that names it makes them there from KubeBin's binaries, and every later one
	// loads them from there (a test process that brings up many labs makes them once). Empty: the lab's own
	// directory.
	ImageDir string
	Progress io.Writer
	// CertificateValidity, if set, is how long kubeadm's control-plane certificates last (berth_cluster's
	// certificate_validity), and CertificateRenewBefore how long before their end the nodes renew them
	// (agent.yaml's certificateRenewBefore): a lab whose certificates end while it runs.
	CertificateValidity, CertificateRenewBefore time.Duration
	// GoneNodeGrace, if set, is how long the join services leave the Node of an instance removed from the
	// lab (agent.yaml's goneNodeGrace).
	GoneNodeGrace time.Duration
}

// Config is a whole lab for Up: its host, its nodes, and the init of the first.
type Config struct {
	HostConfig
	Nodes []NodeSpec
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

// Lab is a lab's host and the nodes this process knows of. Its state lives in its directory, so that
// separate processes can add and remove nodes (see AddNode) and Open can pick it up again.
type Lab struct {
	cfg    HostConfig
	ekCA   *swtpm.CA
	images imageSet
	// upgradeImages are those of UpgradeKubeBins.
	upgradeImages []imageSet
	Nodes         []*Node
	// Progress, if set, receives a line for each step.
	Progress io.Writer
	// Kubeconfig is the admin kubeconfig: the one the init returned, rewritten for the host, after Up.
	Kubeconfig string
	// KubeCA and JoinCA are the cluster's CAs, made by Up.
	KubeCA  *pki.CA
	JoinCA  *pki.CA
	Timings map[string]time.Duration
	// EC2 is an AWS lab's EC2 endpoint, in the process that started the host; Close stops it.
	EC2 *ec2test.Server
	// Compute is a GCP lab's Compute endpoint, and vtpmCA the CA of its nodes' vTPMs, in the process that
	// started the host; Close stops the endpoint.
	Compute *computetest.Server
	vtpmCA  *shieldedvmtest.CA
	start   time.Time
	// secrets and userData are the cluster's, in the process that ran Up.
	secrets  *labSecrets
	userData metadata.UserData
}

// hostState is lab.json: what a later process needs to add nodes to the host.
type hostState struct {
	KubeBin     string   `json:"kubeBin"`
	AgentBinary string   `json:"agentBinary"`
	LabBinary   string   `json:"labBinary"`
	ImageDir    string   `json:"imageDir"`
	Images      imageSet `json:"images"`
	// UpgradeKubeBins and UpgradeImages are HostConfig.UpgradeKubeBins and their images.
	UpgradeKubeBins []string   `json:"upgradeKubeBins,omitempty"`
	UpgradeImages   []imageSet `json:"upgradeImages,omitempty"`
	AWS             *AWSConfig `json:"aws,omitempty"`
	GCP             *GCPConfig `json:"gcp,omitempty"`
}

func (l *Lab) path(p string) string { return filepath.Join(l.cfg.Dir, p) }

// KubernetesVersion is the release the lab runs: its kubeadm's, which its images and manifest follow.
func (l *Lab) KubernetesVersion() string { return l.images.Kubernetes }

// CoreDNSImage is the name kubeadm of the lab's release gives CoreDNS's image.
func (l *Lab) CoreDNSImage() string { return l.images.image(coreDNSRepository) }

// CoreDNSImage is the name kubeadm of the node's release gives CoreDNS's image: the lab's, or that of the
// release its image carries.
func (n *Node) CoreDNSImage() string { return n.images.image(coreDNSRepository) }

// ManifestPath is the lab's berth-image.json, for Terraform's berth_image data source.
func (l *Lab) ManifestPath() string { return l.path(manifestFile) }

// EKCAPath is the bundle of the EK CA (root and intermediate) that signed every node's EK certificate.
func (l *Lab) EKCAPath() string { return l.path(ekCAFile) }

func (l *Lab) progress(format string, args ...any) {
	if l.Progress != nil {
		fmt.Fprintf(l.Progress, "[%6.1fs] %s\n", time.Since(l.start).Seconds(), fmt.Sprintf(format, args...))
	}
}

// Node is the lab node called name, if this process knows it.
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

// StartHost sets up what every node of a lab shares: cgroups, the bridge, the images, the EK CA, the image
// manifest and the metadata service (with no instances yet). It refuses a directory that exists. On error
// the returned Lab, if any, is what was made so far; Down removes it.
func StartHost(ctx context.Context, cfg HostConfig) (*Lab, error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("the lab needs root: it makes network and mount namespaces, cgroups and LUKS images")
	}
	for _, p := range []*string{&cfg.Dir, &cfg.KubeBin, &cfg.AgentBinary, &cfg.LabBinary} {
		if *p == "" {
			return nil, errors.New("the lab's directory, Kubernetes binaries, berth-agent and berth-lab must all be given")
		}
		// Later processes (node up, the nodes' own) may run from another directory.
		abs, err := filepath.Abs(*p)
		if err != nil {
			return nil, err
		}
		*p = abs
	}
	cfg.UpgradeKubeBins = slices.Clone(cfg.UpgradeKubeBins)
	for i, p := range cfg.UpgradeKubeBins {
		var err error
		if cfg.UpgradeKubeBins[i], err = filepath.Abs(p); err != nil {
			return nil, err
		}
	}
	if cfg.ImageDir != "" {
		var err error
		if cfg.ImageDir, err = filepath.Abs(cfg.ImageDir); err != nil {
			return nil, err
		}
	}
	if cfg.AWS != nil {
		if cfg.AWS.IMDSMock == "" {
			return nil, errors.New("an AWS lab needs the ec2-metadata-mock binary (scripts/build-imds-mock.sh)")
		}
		aws := *cfg.AWS
		var err error
		if aws.IMDSMock, err = filepath.Abs(aws.IMDSMock); err != nil {
			return nil, err
		}
		cfg.AWS = &aws
	}
	if cfg.AWS != nil && cfg.GCP != nil {
		return nil, errors.New("a lab is on AWS or on GCP, not both")
	}
	if _, err := os.Stat(cfg.Dir); err == nil {
		return nil, fmt.Errorf("%s exists: a lab is up already, or was not taken down (make lab-down)", cfg.Dir)
	}
	if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
		return nil, err
	}
	l := &Lab{cfg: cfg, Progress: cfg.Progress, start: time.Now(), Timings: map[string]time.Duration{}}
	return l, l.startHost(ctx)
}

func (l *Lab) startHost(ctx context.Context) error {
	l.progress("host: bridge %s with %s", bridgeName, hostAddr)
	if err := makeCgroup("host"); err != nil {
		return fmt.Errorf("cgroups: %w", err)
	}
	if err := setupBridge(ctx, netip.PrefixFrom(hostAddr, labSubnet.Bits()).String()); err != nil {
		return err
	}
	if l.cfg.AWS != nil {
		if err := l.startEC2(); err != nil {
			return err
		}
	}
	if l.cfg.GCP != nil {
		if err := l.startCompute(); err != nil {
			return err
		}
	}
	// Made once here, so that nodes added at the same time never race on them. /lib/modules is no node
	// mount, but kube-proxy's pods mount it from their node, and this host's kernel has no modules.
	for _, target := range append(slices.Clone(nodeMounts), "/lib/modules") {
		if err := l.ensureHostDir(target); err != nil {
			return err
		}
	}
	if l.cfg.ImageDir == "" {
		l.cfg.ImageDir = l.path("images")
	}
	l.progress("images in %s: pause, etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kube-proxy, CoreDNS, Flannel, test workloads", l.cfg.ImageDir)
	var err error
	if l.images, err = imagesIn(ctx, l.cfg.KubeBin, l.cfg.ImageDir); err != nil {
		return fmt.Errorf("images: %w", err)
	}
	var upgrades []string
	prev := l.images.Kubernetes
	for _, bin := range l.cfg.UpgradeKubeBins {
		set, err := imagesIn(ctx, bin, l.cfg.ImageDir)
		if err != nil {
			return fmt.Errorf("images of an upgrade's release: %w", err)
		}
		if set.Kubernetes == prev {
			return fmt.Errorf("the upgrade's binaries in %s are of %s, the release before them: nothing to upgrade to", bin, prev)
		}
		l.upgradeImages = append(l.upgradeImages, set)
		upgrades = append(upgrades, set.Kubernetes)
		prev = set.Kubernetes
	}
	l.progress("EK CA (the TPM vendor) and image manifest %s (%s)", l.ManifestPath(), strings.Join(l.imageNames(), ", "))
	if l.ekCA, err = swtpm.NewCA(l.path("ek-ca")); err != nil {
		return err
	}
	bundle, err := l.ekCA.BundlePEM()
	if err != nil {
		return err
	}
	if err := os.WriteFile(l.EKCAPath(), bundle, 0o644); err != nil {
		return err
	}
	if err := writeJSON(l.ManifestPath(), imageManifest(l.KubernetesVersion(), upgrades)); err != nil {
		return err
	}
	doc := &metadata.Document{Instances: []metadata.Instance{}}
	if err := writeJSON(l.path(documentFile), doc); err != nil {
		return err
	}
	if err := l.writeHosts(doc); err != nil {
		return err
	}
	if err := l.startMetadata(); err != nil {
		return err
	}
	return writeJSON(l.path(hostFile), hostState{KubeBin: l.cfg.KubeBin, UpgradeKubeBins: l.cfg.UpgradeKubeBins,
		AgentBinary: l.cfg.AgentBinary, LabBinary: l.cfg.LabBinary, ImageDir: l.cfg.ImageDir, Images: l.images,
		UpgradeImages: l.upgradeImages, AWS: l.cfg.AWS, GCP: l.cfg.GCP})
}

// Open picks up the lab host StartHost made in dir, with the nodes its metadata lists.
func Open(dir string) (*Lab, error) {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return nil, err
	}
	data, err := os.ReadFile(filepath.Join(dir, hostFile))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("no lab host in %s (berth-lab host makes one)", dir)
	}
	if err != nil {
		return nil, err
	}
	var st hostState
	if err := json.Unmarshal(data, &st); err != nil {
		return nil, fmt.Errorf("reading %s: %w", filepath.Join(dir, hostFile), err)
	}
	ca, err := swtpm.OpenCA(filepath.Join(dir, "ek-ca"))
	if err != nil {
		return nil, err
	}
	l := &Lab{cfg: HostConfig{Dir: dir, KubeBin: st.KubeBin, UpgradeKubeBins: st.UpgradeKubeBins, AgentBinary: st.AgentBinary,
		LabBinary: st.LabBinary, ImageDir: st.ImageDir, AWS: st.AWS, GCP: st.GCP},
		ekCA: ca, images: st.Images, upgradeImages: st.UpgradeImages, start: time.Now(), Timings: map[string]time.Duration{}}
	doc, err := readDocument(l.path(documentFile))
	if err != nil {
		return nil, err
	}
	for _, inst := range doc.Instances {
		n := l.newNode(Machine{Name: inst.Name, Role: inst.Role, Addr: inst.Addresses[0], Image: inst.ImageID})
		if err := n.load(); err != nil {
			return nil, fmt.Errorf("node %s: %w", n.Name, err)
		}
		l.Nodes = append(l.Nodes, n)
	}
	return l, nil
}

// Up brings a whole lab up in this process: the host, the nodes, the attested init of the first node (which
// must be a control-plane node), and waits until every node is Ready.
func Up(ctx context.Context, cfg Config) (*Lab, error) {
	if err := checkSpecs(cfg.Nodes); err != nil {
		return nil, err
	}
	l, err := StartHost(ctx, cfg.HostConfig)
	if err != nil {
		return l, err
	}
	return l, l.InitCluster(ctx, cfg.Nodes)
}

// ClusterName is the name of the lab's cluster.
const ClusterName = "berthlab"

// InitCluster does on a host StartHost started what Up does after it: it makes the cluster's secrets, adds
// the nodes of specs (the first a control-plane node), initializes the first through the attested init
// client and waits until every node is Ready.
func (l *Lab) InitCluster(ctx context.Context, specs []NodeSpec) error {
	if err := checkSpecs(specs); err != nil {
		return err
	}
	l.progress("cluster secrets and CAs (as terraform's berth_secrets makes them)")
	secrets, err := newSecrets()
	if err != nil {
		return err
	}
	l.KubeCA, l.JoinCA, l.secrets = secrets.kubeCA, secrets.joinCA, secrets
	userData := metadata.UserData{ClusterName: ClusterName, JoinPort: joinPort, JoinCAPin: pki.SPKIPin(l.JoinCA.Cert),
		InitSecretHash: secrets.initHash}
	if l.cfg.AWS != nil || l.cfg.GCP != nil {
		// An instance cannot list the others: its user-data names the join service, on the first node.
		userData.JoinEndpoints = []string{net.JoinHostPort(nodeAddr(0).String(), strconv.Itoa(joinPort))}
	}
	l.userData = userData
	for _, spec := range specs {
		if _, err := l.AddNode(ctx, l.machine(spec)); err != nil {
			return err
		}
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
	kubeconfig := result.Kubeconfig
	if l.cfg.CertificateValidity != 0 {
		// The init's admin.conf ends with kubeadm's other certificates; the lab's own lasts as a user's would.
		if kubeconfig, err = adminKubeconfig(result.Kubeconfig, l.KubeCA, 24*time.Hour); err != nil {
			return err
		}
	}
	if err := os.WriteFile(l.Kubeconfig, kubeconfig, 0o600); err != nil {
		return err
	}
	if cp.runsCloudControllerManager() {
		if err := cp.startCloudControllerManager(); err != nil {
			return err
		}
	}
	ctx, cancel := context.WithTimeout(ctx, 4*time.Minute)
	defer cancel()
	return l.WaitReady(ctx, l.Nodes)
}

// adminKubeconfig is kubeconfig with its user's certificate and key replaced by ones ca issues for validity,
// in kubeadm's group of cluster admins.
func adminKubeconfig(kubeconfig []byte, ca *pki.CA, validity time.Duration) ([]byte, error) {
	cfg, err := clientcmd.Load(kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("the init's kubeconfig: %w", err)
	}
	key, err := pki.NewKey()
	if err != nil {
		return nil, err
	}
	cert, err := ca.IssueClient(pki.ClientTemplate{CommonName: "berthlab-admin", Organization: []string{"kubeadm:cluster-admins"}},
		key.Public(), time.Now(), validity)
	if err != nil {
		return nil, err
	}
	keyPEM, err := pki.EncodeKeyPEM(key)
	if err != nil {
		return nil, err
	}
	for _, user := range cfg.AuthInfos {
		user.ClientCertificateData, user.ClientKeyData = pki.EncodeCertPEM(cert), keyPEM
	}
	return clientcmd.Write(*cfg)
}

func checkSpecs(specs []NodeSpec) error {
	if len(specs) == 0 || specs[0].Role != metadata.RoleControlPlane {
		return errors.New("the first lab node must be a control-plane node: it is the one initialized")
	}
	return nil
}

// machine is the next machine of a lab Up made: the next address, the first image, the cluster's user-data.
func (l *Lab) machine(spec NodeSpec) Machine {
	return Machine{Name: spec.Name, Role: spec.Role, Addr: nodeAddr(len(l.Nodes)), Image: ImageNames[0], UserData: l.userData}
}

// nodeAddr is the address of the i-th node a lab Up made.
func nodeAddr(i int) netip.Addr {
	return netip.AddrFrom4([4]byte{10, 250, 0, byte(10 + i)})
}

// Grow adds nodes to a lab Up made, one at a time, each Ready before the next starts: kubeadm joins
// control-plane nodes one by one, since etcd adds one member at a time.
func (l *Lab) Grow(ctx context.Context, specs ...NodeSpec) error {
	for _, spec := range specs {
		if _, err := l.grow(ctx, spec); err != nil {
			return err
		}
	}
	return nil
}

// grow adds one node to a lab Up made and waits until it is Ready.
func (l *Lab) grow(ctx context.Context, spec NodeSpec) (*Node, error) {
	n, err := l.AddNode(ctx, l.machine(spec))
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, 4*time.Minute)
	defer cancel()
	return n, l.WaitReady(ctx, []*Node{n})
}

type labSecrets struct {
	// root is the root key everything else derives from, as berth_secrets takes it.
	root           []byte
	master, salt   []byte
	initSecret     string
	initHash       string
	kubeCA, joinCA *pki.CA
}

func newSecrets() (*labSecrets, error) {
	root, err := keys.NewSecret()
	if err != nil {
		return nil, err
	}
	derived, err := clustersecrets.Derive(root)
	if err != nil {
		return nil, err
	}
	s := &labSecrets{root: root, master: derived.MasterSecret, salt: derived.Salt, initSecret: derived.InitSecret}
	if s.initHash, err = initsecret.Hash([]byte(s.initSecret)); err != nil {
		return nil, err
	}
	if s.kubeCA, s.joinCA, err = derived.NewCAs(time.Now(), 10*365*24*time.Hour); err != nil {
		return nil, err
	}
	return s, nil
}

// RootKey is the cluster's root key in base64, as an operator keeps it; only the process that ran Up knows it.
func (l *Lab) RootKey() (string, error) {
	if l.secrets == nil {
		return "", errors.New("the cluster's secrets are known only to the process that brought the lab up")
	}
	return base64.StdEncoding.EncodeToString(l.secrets.root), nil
}

// startMetadata runs the lab's instance-metadata service as a daemon on the host side of the bridge; it
// serves whatever metadata.json holds at each request.
func (l *Lab) startMetadata() error {
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
	cmd := exec.Command("sh", "-c", script, "sh", l.cfg.LabBinary, "metadata", "--document", l.path(documentFile), "--listen", metaAddr)
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("metadata service: %w", err)
	}
	go cmd.Wait()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		c, err := net.Dial("tcp", metaAddr)
		if err == nil {
			return c.Close()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("metadata service did not listen on %s (see %s)", metaAddr, l.path("metadata.log"))
		}
	}
}

// initCluster does what terraform's berth_cluster does: attest the node against the image's measurements,
// then send it the init request.
func (l *Lab) initCluster(ctx context.Context, cp *Node, s *labSecrets) (*berthv1.InitResult, error) {
	var (
		trust      attest.EKTrust
		instanceID string
	)
	if cp.ec2 != nil {
		// As berth_cluster's aws block: the TPM is trusted by the EK EC2 reports for the node's instance.
		cloud, err := l.cloudEKTrust()
		if err != nil {
			return nil, err
		}
		trust, instanceID = cloud, cp.ec2.ID
	} else if cp.gce != nil {
		// As berth_cluster's gcp block: the TPM is trusted by its EK certificate naming the node's instance.
		vtpm, err := l.vtpmTrust()
		if err != nil {
			return nil, err
		}
		trust, instanceID = vtpm, cp.gce.path()
	} else {
		roots, inters, err := l.ekCA.Pools()
		if err != nil {
			return nil, err
		}
		trust = attest.NewCertChain(roots, inters, nil)
	}
	// The image's measurements come from the manifest's prediction, as terraform's berth_cluster takes them
	// from berth_image: a node whose PCR 11 differs fails the init here.
	image := ImageNames[0]
	expected := PredictedPCRs(image)
	pol, err := (&policy.Policy{Images: []policy.Image{LabImage(image)}}).Marshal()
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
		Verifier:     attest.NewVerifier(trust),
		InstanceID:   instanceID,
		ExpectedPCRs: expected,
		Progress:     func(line string) { l.progress("%s: kubeadm: %s", cp.Name, line) },
		Timeout:      10 * time.Minute,
		Request: &berthv1.InitRequest{
			InitSecret: []byte(s.initSecret), MasterSecret: s.master, Salt: s.salt,
			KubernetesCaCertificate: s.kubeCA.CertPEM(), KubernetesCaKey: kubeKey,
			JoinCaCertificate: s.joinCA.CertPEM(), JoinCaKey: joinKey,
			ClusterName: ClusterName, KubernetesVersion: l.KubernetesVersion(), JoinPolicy: pol,
			ControlPlaneEndpoint: net.JoinHostPort(cp.Addr.String(), "6443"), PodNetwork: podnetwork.Flannel,
			CertificateValiditySeconds: int64(l.cfg.CertificateValidity / time.Second),
		},
	})
}

// nodeFailure says which node failed at which step, with the tail of its logs.
func (l *Lab) nodeFailure(n *Node, step string, err error) error {
	var b strings.Builder
	fmt.Fprintf(&b, "node %s, step %s: %v", n.Name, step, err)
	for _, log := range []string{"logs/agent.log", "fs/var/lib/berth/kubelet.log", "logs/containerd.log", "logs/swtpm.log"} {
		if tail := tailFile(n.path(log), 25); tail != "" {
			fmt.Fprintf(&b, "\n--- %s: last lines of %s ---\n%s", n.Name, n.path(log), tail)
		}
	}
	// A node that waits for a ticket waits for the others' join services: their side says why it got none.
	for _, o := range l.Nodes {
		if o == n || o.Role != metadata.RoleControlPlane {
			continue
		}
		state := "running"
		if !o.agentRunning() {
			state = "NOT running"
		}
		fmt.Fprintf(&b, "\n--- %s (berth-agent %s): last lines of %s ---\n%s", o.Name, state, o.path("logs/agent.log"),
			tailFile(o.path("logs/agent.log"), 15))
	}
	return errors.New(b.String())
}

func tailFile(path string, lines int) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	return tail(string(data), lines)
}

// tail is the last lines of s.
func tail(s string, lines int) string {
	all := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(all[max(0, len(all)-lines):], "\n")
}

// DiskKey is the key derived for the node's state disk, as the join service derives it; only the process
// that ran Up knows the cluster's secrets.
func (l *Lab) DiskKey(ctx context.Context, n *Node) ([]byte, error) {
	if l.secrets == nil {
		return nil, errors.New("the cluster's secrets are known only to the process that brought the lab up")
	}
	id, err := n.Disk().UUID(ctx)
	if err != nil {
		return nil, err
	}
	label, err := keys.DiskLabel(id)
	if err != nil {
		return nil, err
	}
	return keys.Derive(l.secrets.master, l.secrets.salt, label, 32)
}

// PowerCycle cuts every node's power at once (processes, mounts and network namespaces' contents gone;
// disks and TPM state kept) and then switches them on in the given order, without waiting between them.
func (l *Lab) PowerCycle(ctx context.Context, order []*Node) error {
	for _, n := range l.Nodes {
		n.PowerOff()
	}
	l.progress("power cut on every node; switching on in the order %s", nodeNames(order))
	for _, n := range order {
		if err := n.powerOn(ctx); err != nil {
			return l.nodeFailure(n, "power on", err)
		}
	}
	return nil
}

func nodeNames(nodes []*Node) string {
	names := make([]string, len(nodes))
	for i, n := range nodes {
		names[i] = n.Name
	}
	return strings.Join(names, ", ")
}

// KubeletClientCert is the certificate the node's kubelet authenticates with.
func (n *Node) KubeletClientCert() (*x509.Certificate, error) {
	path, err := n.kubeletCertPath()
	if err != nil {
		return nil, err
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	return pki.ParseCertPEM(firstPEM(data))
}

// kubeletCertPath is the host's path of the file with the kubelet's client certificate and key.
func (n *Node) kubeletCertPath() (string, error) {
	path := n.path("fs/var/lib/kubelet/pki/kubelet-client-current.pem")
	// The kubelet makes it a link to the file of its newest certificate, by a path inside the node.
	target, err := os.Readlink(path)
	switch {
	case err == nil && filepath.IsAbs(target):
		return n.path(filepath.Join("fs", target)), nil
	case err == nil, errors.Is(err, syscall.EINVAL):
		return path, nil
	}
	return "", err
}
