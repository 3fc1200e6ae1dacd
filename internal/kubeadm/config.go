// Package kubeadm renders kubeadm's configuration files and runs kubeadm.
//
// The documents are built from kubeadm's own v1beta4 Go types rather than
// from text templates, so a field that kubeadm renames or drops breaks the
// build instead of silently producing a file kubeadm ignores. Inputs are
// checked here, before a node reaches kubeadm, so that a bad value fails with
// an error that names the field; the bootstrap token is never repeated in an
// error.
package kubeadm

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/version"
	kubeproxyv1alpha1 "k8s.io/kube-proxy/config/v1alpha1"
	kubeletv1beta1 "k8s.io/kubelet/config/v1beta1"
	bootstraptokenv1 "k8s.io/kubernetes/cmd/kubeadm/app/apis/bootstraptoken/v1"
	"k8s.io/kubernetes/cmd/kubeadm/app/apis/kubeadm/v1beta4"
	"sigs.k8s.io/yaml"

	"github.com/berthlabs/berth/internal/clustername"
)

// Defaults applied when a parameter is left empty.
const (
	DefaultBindPort        int32 = 6443
	DefaultPodSubnet             = "10.244.0.0/16"
	DefaultServiceSubnet         = v1beta4.DefaultServicesSubnet
	DefaultCertificatesDir       = v1beta4.DefaultCertificatesDir
	DefaultCRISocket             = "unix:///run/containerd/containerd.sock"
)

// initTokenTTL bounds the bootstrap token that kubeadm init always creates:
// kubeadm replaces an empty token list with a 24-hour token, and Berth hands
// out its own short-lived tokens with each join ticket, so the one kubeadm
// makes only has to outlive init itself.
const initTokenTTL = time.Minute

// These kubelet flags are derived from typed fields (the node address, Cloud); accepting them in
// KubeletExtraArgs as well would let two sources disagree.
const (
	kubeletNodeIPArg        = "node-ip"
	kubeletCloudProviderArg = "cloud-provider"
	kubeletProviderIDArg    = "provider-id"
)

// Cloud is what a node's kubelet is told about the cloud it runs in.
type Cloud struct {
	// External makes the kubelet leave the node to a cloud controller manager (--cloud-provider=external):
	// the node starts tainted node.cloudprovider.kubernetes.io/uninitialized, and no pod without a
	// toleration is scheduled on it until the controller manager has filled in its addresses and zone.
	External bool
	// ProviderID is the node's spec.providerID (--provider-id), by which the cloud controller manager
	// finds its instance; empty leaves it for the controller manager to find.
	ProviderID string
}

// args are c's kubelet flags.
func (c Cloud) args() ([]v1beta4.Arg, error) {
	var args []v1beta4.Arg
	if c.External {
		args = append(args, v1beta4.Arg{Name: kubeletCloudProviderArg, Value: "external"})
	}
	if c.ProviderID != "" {
		if !providerIDPattern.MatchString(c.ProviderID) {
			return nil, fmt.Errorf("provider ID %q is not <provider>://<path> of printable characters without spaces, quotes or backslashes", c.ProviderID)
		}
		args = append(args, v1beta4.Arg{Name: kubeletProviderIDArg, Value: c.ProviderID})
	}
	return args, nil
}

var (
	tokenPattern   = regexp.MustCompile(`\A[a-z0-9]{6}\.[a-z0-9]{16}\z`)
	caHashPattern  = regexp.MustCompile(`\Asha256:[0-9a-f]{64}\z`)
	argNamePattern = regexp.MustCompile(`\A[a-z0-9][a-z0-9-]*\z`)
	phasePattern   = regexp.MustCompile(`\A[a-z0-9][a-z0-9-]*(/[a-z0-9][a-z0-9-]*)*\z`)
	// providerIDPattern is a provider ID as the cloud controller managers write them, with nothing that
	// would split, quote or escape a flag (no space, quote or backslash).
	providerIDPattern = regexp.MustCompile(`\A[a-z][a-z0-9]*://[!#-&(-\[\]-~]{1,512}\z`)
	imageRepoPattern  = regexp.MustCompile(`\A[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*(?::[0-9]+)?(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*\z`)
)

// InitParams describes the first control-plane node of a cluster.
type InitParams struct {
	NodeName         string
	AdvertiseAddress netip.Addr
	// BindPort defaults to DefaultBindPort.
	BindPort int32
	// ControlPlaneEndpoint is an optional host:port, typically a load balancer.
	ControlPlaneEndpoint string
	// KubernetesVersion is required (e.g. "v1.36.3"): without it kubeadm asks
	// the internet which release is stable.
	KubernetesVersion string
	// ClusterName is optional; kubeadm defaults it to "kubernetes".
	ClusterName string
	// PodSubnet and ServiceSubnet take one CIDR or an IPv4,IPv6 pair.
	PodSubnet, ServiceSubnet string
	CertificatesDir          string
	// ImageRepository is optional; kubeadm defaults it to registry.k8s.io.
	ImageRepository  string
	CRISocket        string
	SkipPhases       []string
	KubeletExtraArgs map[string]string
	Cloud            Cloud
	// Kubelet is the cluster-wide kubelet configuration kubeadm uploads for every node; zero leaves
	// kubeadm's defaults.
	Kubelet KubeletSettings
	// KubeProxy is the cluster-wide kube-proxy configuration kubeadm installs kube-proxy with; zero leaves
	// kubeadm's defaults.
	KubeProxy KubeProxySettings
	// CertificateValidity is how long kubeadm's control-plane certificates last (certificateValidityPeriod),
	// at init and at every later renewal; zero keeps kubeadm's year.
	CertificateValidity time.Duration
}

// MinCertificateValidity is the shortest CertificateValidity: a renewal, which restarts the control plane,
// takes about a minute, and kubeadm backdates each certificate by 5 minutes.
const MinCertificateValidity = 3 * time.Minute

// KubeProxySettings are the kube-proxy fields that depend on the machines rather than the cluster.
type KubeProxySettings struct {
	// ConntrackMaxPerCore is kube-proxy's conntrack.maxPerCore. 0 leaves the kernel's connection-tracking
	// table size alone: machines that share a kernel (containers, the lab's nodes) cannot set it, and
	// kube-proxy exits when it fails to. nil keeps kube-proxy's default.
	ConntrackMaxPerCore *int32 `json:"conntrackMaxPerCore,omitempty"`
}

// Validate says what is wrong with s.
func (s KubeProxySettings) Validate() error {
	if n := s.ConntrackMaxPerCore; n != nil && *n < 0 {
		return fmt.Errorf("kube-proxy conntrackMaxPerCore %d: want 0 (leave the kernel's table size) or more", *n)
	}
	return nil
}

// KubeletSettings are the kubelet fields that depend on the image rather than the node.
type KubeletSettings struct {
	// CgroupDriver is "systemd" or "cgroupfs"; kubeadm's default is systemd.
	CgroupDriver string `json:"cgroupDriver,omitempty"`
	// AllowCgroupV1 lets the kubelet start on a cgroup v1 host, which it refuses by default since 1.35.
	AllowCgroupV1 bool `json:"allowCgroupV1,omitempty"`
}

// ControlPlaneJoin makes a joining node a control-plane node.
type ControlPlaneJoin struct {
	AdvertiseAddress netip.Addr
	// BindPort defaults to DefaultBindPort.
	BindPort int32
}

// JoinParams describes a node joining an existing cluster.
type JoinParams struct {
	NodeName string
	NodeIP   netip.Addr
	// APIServerEndpoint is host:port of the API server used for discovery.
	APIServerEndpoint string
	// Token is a bootstrap token, "abcdef.0123456789abcdef".
	Token string
	// CACertHashes pin the cluster CA ("sha256:<hex>"); at least one is
	// required, kubeadm would otherwise trust whatever CA it is shown.
	CACertHashes []string
	// ControlPlane is nil for worker nodes.
	ControlPlane     *ControlPlaneJoin
	CRISocket        string
	SkipPhases       []string
	KubeletExtraArgs map[string]string
	Cloud            Cloud
}

// InitConfig renders the InitConfiguration and ClusterConfiguration
// (kubeadm.k8s.io/v1beta4) for `kubeadm init --config` as one multi-document
// YAML file.
func InitConfig(p InitParams) ([]byte, error) {
	if err := validateNodeName(p.NodeName); err != nil {
		return nil, err
	}
	addr, err := nodeAddress("advertise address", p.AdvertiseAddress, allowLoopback)
	if err != nil {
		return nil, err
	}
	port, err := bindPort(p.BindPort)
	if err != nil {
		return nil, err
	}
	if p.ControlPlaneEndpoint != "" {
		if err := ValidateEndpoint(p.ControlPlaneEndpoint); err != nil {
			return nil, fmt.Errorf("control-plane endpoint: %w", err)
		}
	}
	if p.KubernetesVersion == "" {
		return nil, errors.New("kubernetes version is required")
	}
	if _, err := version.ParseSemantic(p.KubernetesVersion); err != nil {
		return nil, fmt.Errorf("kubernetes version %q is not a semantic version such as v1.36.3", p.KubernetesVersion)
	}
	if p.ClusterName != "" {
		if err := clustername.Validate(p.ClusterName); err != nil {
			return nil, err
		}
	}
	podSubnet, err := subnet("pod subnet", p.PodSubnet, DefaultPodSubnet)
	if err != nil {
		return nil, err
	}
	serviceSubnet, err := subnet("service subnet", p.ServiceSubnet, DefaultServiceSubnet)
	if err != nil {
		return nil, err
	}
	certDir := cmp.Or(p.CertificatesDir, DefaultCertificatesDir)
	if !filepath.IsAbs(certDir) || filepath.Clean(certDir) != certDir {
		return nil, fmt.Errorf("certificates dir %q must be a clean absolute path", certDir)
	}
	if p.ImageRepository != "" && !imageRepoPattern.MatchString(p.ImageRepository) {
		return nil, fmt.Errorf("image repository %q is not of the form registry[:port][/path]", p.ImageRepository)
	}
	nodeReg, err := nodeRegistration(p.NodeName, p.CRISocket, addr, p.Cloud, p.KubeletExtraArgs)
	if err != nil {
		return nil, err
	}
	if err := validateSkipPhases(p.SkipPhases); err != nil {
		return nil, err
	}

	initCfg := v1beta4.InitConfiguration{
		TypeMeta: typeMeta("InitConfiguration"),
		BootstrapTokens: []bootstraptokenv1.BootstrapToken{{
			Description: "made by kubeadm init; Berth issues join tokens itself",
			TTL:         &metav1.Duration{Duration: initTokenTTL},
		}},
		NodeRegistration: nodeReg,
		LocalAPIEndpoint: v1beta4.APIEndpoint{AdvertiseAddress: addr.String(), BindPort: port},
		SkipPhases:       slices.Clone(p.SkipPhases),
	}
	clusterCfg := v1beta4.ClusterConfiguration{
		TypeMeta: typeMeta("ClusterConfiguration"),
		Networking: v1beta4.Networking{
			PodSubnet:     podSubnet,
			ServiceSubnet: serviceSubnet,
		},
		KubernetesVersion:    p.KubernetesVersion,
		ControlPlaneEndpoint: p.ControlPlaneEndpoint,
		CertificatesDir:      certDir,
		ImageRepository:      p.ImageRepository,
		ClusterName:          p.ClusterName,
	}
	if v := p.CertificateValidity; v != 0 {
		if v < MinCertificateValidity {
			return nil, fmt.Errorf("certificate validity %v is shorter than %v", v, MinCertificateValidity)
		}
		clusterCfg.CertificateValidityPeriod = &metav1.Duration{Duration: v}
	}
	docs := []any{initCfg, clusterCfg}
	kubelet, err := kubeletDocument(p.Kubelet)
	if err != nil {
		return nil, err
	}
	if kubelet != nil {
		docs = append(docs, kubelet)
	}
	if err := p.KubeProxy.Validate(); err != nil {
		return nil, err
	}
	if n := p.KubeProxy.ConntrackMaxPerCore; n != nil {
		// Written as a map: the typed configuration has no omitempty and would set every field to zero.
		docs = append(docs, map[string]any{
			"apiVersion": kubeproxyv1alpha1.SchemeGroupVersion.String(), "kind": "KubeProxyConfiguration",
			"conntrack": map[string]any{"maxPerCore": *n},
		})
	}
	return marshalDocuments(docs...)
}

// kubeletDocument is the KubeletConfiguration document of s, nil for zero settings.
func kubeletDocument(s KubeletSettings) (map[string]any, error) {
	if s == (KubeletSettings{}) {
		return nil, nil
	}
	if d := s.CgroupDriver; d != "" && d != "systemd" && d != "cgroupfs" {
		return nil, fmt.Errorf("kubelet cgroup driver %q: want systemd or cgroupfs", d)
	}
	kubeletCfg := kubeletv1beta1.KubeletConfiguration{
		TypeMeta:     metav1.TypeMeta{APIVersion: kubeletv1beta1.SchemeGroupVersion.String(), Kind: "KubeletConfiguration"},
		CgroupDriver: s.CgroupDriver,
	}
	if s.AllowCgroupV1 {
		fail := false
		kubeletCfg.FailCgroupV1 = &fail
	}
	return setFields(kubeletCfg, kubeletv1beta1.KubeletConfiguration{TypeMeta: kubeletCfg.TypeMeta})
}

// setFields is doc with only the top-level fields that differ from empty, plus apiVersion and kind. The
// kubelet's types have many fields without omitempty; written out as zeros ("syncFrequency: 0s") they read
// as settings although the kubelet takes them as unset.
func setFields(doc, empty any) (map[string]any, error) {
	var set, zero map[string]any
	for _, c := range []struct {
		v   any
		out *map[string]any
	}{{doc, &set}, {empty, &zero}} {
		b, err := json.Marshal(c.v)
		if err != nil {
			return nil, err
		}
		if err := json.Unmarshal(b, c.out); err != nil {
			return nil, err
		}
	}
	for k, v := range set {
		if k != "apiVersion" && k != "kind" && reflect.DeepEqual(v, zero[k]) {
			delete(set, k)
		}
	}
	return set, nil
}

// JoinConfig renders the JoinConfiguration (kubeadm.k8s.io/v1beta4) for
// `kubeadm join --config`, with discovery by bootstrap token and CA pin.
func JoinConfig(p JoinParams) ([]byte, error) {
	if err := validateNodeName(p.NodeName); err != nil {
		return nil, err
	}
	nodeIP, err := nodeAddress("node IP", p.NodeIP, allowLoopback)
	if err != nil {
		return nil, err
	}
	if err := ValidateEndpoint(p.APIServerEndpoint); err != nil {
		return nil, fmt.Errorf("API server endpoint: %w", err)
	}
	if !tokenPattern.MatchString(p.Token) {
		return nil, errors.New("bootstrap token is not of the form [a-z0-9]{6}.[a-z0-9]{16}")
	}
	if len(p.CACertHashes) == 0 {
		return nil, errors.New("at least one CA certificate hash is required")
	}
	for i, h := range p.CACertHashes {
		if !caHashPattern.MatchString(h) {
			return nil, fmt.Errorf("CA certificate hash %d (%q) is not \"sha256:\" followed by 64 lowercase hex digits", i, h)
		}
	}
	nodeReg, err := nodeRegistration(p.NodeName, p.CRISocket, nodeIP, p.Cloud, p.KubeletExtraArgs)
	if err != nil {
		return nil, err
	}
	// The agent writes kubelet.conf from its ticket before kubeadm join runs, so that the kubelet starts with
	// the certificate the join service issued instead of bootstrapping its own: kubeadm's check that the file
	// is absent would refuse every join.
	nodeReg.IgnorePreflightErrors = []string{kubeletConfPreflightCheck}
	if err := validateSkipPhases(p.SkipPhases); err != nil {
		return nil, err
	}

	cfg := v1beta4.JoinConfiguration{
		TypeMeta:         typeMeta("JoinConfiguration"),
		NodeRegistration: nodeReg,
		Discovery: v1beta4.Discovery{
			BootstrapToken: &v1beta4.BootstrapTokenDiscovery{
				Token:             p.Token,
				APIServerEndpoint: p.APIServerEndpoint,
				CACertHashes:      slices.Clone(p.CACertHashes),
			},
		},
		SkipPhases: slices.Clone(p.SkipPhases),
	}
	if cp := p.ControlPlane; cp != nil {
		addr, err := nodeAddress("control-plane advertise address", cp.AdvertiseAddress, allowLoopback)
		if err != nil {
			return nil, err
		}
		port, err := bindPort(cp.BindPort)
		if err != nil {
			return nil, err
		}
		cfg.ControlPlane = &v1beta4.JoinControlPlane{
			LocalAPIEndpoint: v1beta4.APIEndpoint{AdvertiseAddress: addr.String(), BindPort: port},
		}
	}
	return marshalDocuments(cfg)
}

// kubeletConfPreflightCheck is kubeadm's check that /etc/kubernetes/kubelet.conf does not exist yet.
const kubeletConfPreflightCheck = "FileAvailable--etc-kubernetes-kubelet.conf"

func typeMeta(kind string) metav1.TypeMeta {
	return metav1.TypeMeta{APIVersion: v1beta4.SchemeGroupVersion.String(), Kind: kind}
}

func marshalDocuments(docs ...any) ([]byte, error) {
	var out bytes.Buffer
	for i, doc := range docs {
		b, err := yaml.Marshal(doc)
		if err != nil {
			return nil, fmt.Errorf("encoding kubeadm configuration document %d: %w", i, err)
		}
		if i > 0 {
			out.WriteString("---\n")
		}
		out.Write(b)
	}
	return out.Bytes(), nil
}

func nodeRegistration(name, criSocket string, nodeIP netip.Addr, cloud Cloud, extra map[string]string) (v1beta4.NodeRegistrationOptions, error) {
	socket := cmp.Or(criSocket, DefaultCRISocket)
	path, ok := strings.CutPrefix(socket, "unix://")
	if !ok || !filepath.IsAbs(path) {
		return v1beta4.NodeRegistrationOptions{}, fmt.Errorf("CRI socket %q is not a unix:///absolute/path URL", socket)
	}
	args, err := kubeletArgs(nodeIP, cloud, extra)
	if err != nil {
		return v1beta4.NodeRegistrationOptions{}, err
	}
	return v1beta4.NodeRegistrationOptions{
		Name:             name,
		CRISocket:        socket,
		KubeletExtraArgs: args,
	}, nil
}

// kubeletArgs returns the extra kubelet flags sorted by name, so that equal
// parameters always render the same bytes.
func kubeletArgs(nodeIP netip.Addr, cloud Cloud, extra map[string]string) ([]v1beta4.Arg, error) {
	args, err := cloud.args()
	if err != nil {
		return nil, err
	}
	args = append(args, v1beta4.Arg{Name: kubeletNodeIPArg, Value: nodeIP.String()})
	for name, value := range extra {
		switch name {
		case kubeletNodeIPArg:
			return nil, fmt.Errorf("kubelet extra arg %q is set from the node address; do not pass it", name)
		case kubeletCloudProviderArg, kubeletProviderIDArg:
			return nil, fmt.Errorf("kubelet extra arg %q is set from the node's cloud (agent.yaml's kubelet.cloudProvider); do not pass it", name)
		}
		if !argNamePattern.MatchString(name) {
			return nil, fmt.Errorf("kubelet extra arg name %q is not a flag name without dashes, such as \"node-labels\"", name)
		}
		// kubeadm joins the flags with spaces into one environment variable
		// that systemd splits again, so whitespace in a value would smuggle
		// in further kubelet flags.
		if strings.IndexFunc(value, func(r rune) bool { return unicode.IsSpace(r) || unicode.IsControl(r) }) >= 0 {
			return nil, fmt.Errorf("kubelet extra arg %q has whitespace or control characters in its value", name)
		}
		args = append(args, v1beta4.Arg{Name: name, Value: value})
	}
	slices.SortFunc(args, func(a, b v1beta4.Arg) int { return strings.Compare(a.Name, b.Name) })
	return args, nil
}

func validateNodeName(name string) error {
	if name == "" {
		return errors.New("node name is required")
	}
	if errs := validation.IsDNS1123Subdomain(name); len(errs) > 0 {
		return fmt.Errorf("node name %q is not a DNS-1123 subdomain: %s", name, strings.Join(errs, "; "))
	}
	return nil
}

// allowLoopback lets configurations name loopback addresses: the protocol's tests run several nodes on one
// host's 127.0.0.0/8 without root. Real nodes never have one: their instance records hold routable addresses.
const allowLoopback = true

// nodeAddress accepts only addresses other nodes can reach: kubeadm would
// replace a loopback or unspecified address with one it guesses from the
// host's interfaces.
func nodeAddress(what string, a netip.Addr, loopbackOK bool) (netip.Addr, error) {
	if !a.IsValid() {
		return netip.Addr{}, fmt.Errorf("%s is required", what)
	}
	a = a.Unmap()
	if loopbackOK && a.IsLoopback() {
		return a, nil
	}
	if a.Zone() != "" || !a.IsGlobalUnicast() {
		return netip.Addr{}, fmt.Errorf("%s %s is not a global unicast address", what, a)
	}
	return a, nil
}

func bindPort(p int32) (int32, error) {
	if p == 0 {
		return DefaultBindPort, nil
	}
	if p < 0 || p > 65535 {
		return 0, fmt.Errorf("bind port %d is out of range 1-65535", p)
	}
	return p, nil
}

// ValidateEndpoint accepts host:port with a port of 1 to 65535 and a host that is an IP address or a DNS
// name, the API server endpoints kubeadm and a kubeconfig take.
func ValidateEndpoint(endpoint string) error {
	host, port, err := net.SplitHostPort(endpoint)
	if err != nil {
		return fmt.Errorf("%q is not host:port: %w", endpoint, err)
	}
	if n, err := strconv.ParseUint(port, 10, 16); err != nil || n == 0 {
		return fmt.Errorf("%q has no valid port", endpoint)
	}
	if _, err := netip.ParseAddr(host); err == nil {
		return nil
	}
	if errs := validation.IsDNS1123Subdomain(host); len(errs) > 0 {
		return fmt.Errorf("host in %q is neither an IP address nor a DNS name: %s", endpoint, strings.Join(errs, "; "))
	}
	return nil
}

// subnet accepts one CIDR, or two of different families for dual-stack, the
// forms kubeadm accepts in its networking fields.
func subnet(what, value, def string) (string, error) {
	value = cmp.Or(value, def)
	parts := strings.Split(value, ",")
	if len(parts) > 2 {
		return "", fmt.Errorf("%s %q has more than two CIDRs", what, value)
	}
	var families []bool
	for _, part := range parts {
		prefix, err := netip.ParsePrefix(part)
		if err != nil {
			return "", fmt.Errorf("%s %q: %w", what, value, err)
		}
		if prefix.Masked() != prefix {
			return "", fmt.Errorf("%s %q: %s has host bits set, use %s", what, value, prefix, prefix.Masked())
		}
		families = append(families, prefix.Addr().Is4())
	}
	if len(families) == 2 && families[0] == families[1] {
		return "", fmt.Errorf("%s %q: a dual-stack pair needs one IPv4 and one IPv6 CIDR", what, value)
	}
	return value, nil
}

func validateSkipPhases(phases []string) error {
	for _, phase := range phases {
		if !phasePattern.MatchString(phase) {
			return fmt.Errorf("skip phase %q is not a kubeadm phase name such as \"addon/kube-proxy\"", phase)
		}
	}
	return nil
}
