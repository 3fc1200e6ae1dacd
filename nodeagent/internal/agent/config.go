// Package agent is berth-agent's work at every boot: it composes the state disk, the TPM, the metadata,
// the init server, the join client and the join service into one node's life. Package main only parses
// flags; everything a test needs to replace (TPM, kubeadm, Kubernetes client, mounting) comes in as Deps.
package agent

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/kubeadm"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/podnetwork"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/nodeagent/internal/certrenew"
	"github.com/berthlabs/berth/nodeagent/internal/configfile"
	"github.com/berthlabs/berth/nodeagent/internal/joinserver"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
	"github.com/berthlabs/berth/nodeagent/internal/platform"
	"github.com/berthlabs/berth/nodeagent/internal/platform/aws"
	"github.com/berthlabs/berth/nodeagent/internal/platform/baremetal"
	"github.com/berthlabs/berth/nodeagent/internal/platform/gcp"
	"github.com/berthlabs/berth/nodeagent/internal/platform/lab"
	"github.com/berthlabs/berth/nodeagent/internal/verifiedroot"
)

// DefaultInitPort is where a fresh control-plane node's init server listens; the Terraform provider dials it.
const DefaultInitPort = 7451

// DefaultConfigPath is where images put the agent's configuration.
const DefaultConfigPath = "/etc/berth/agent.yaml"

// Config is the agent's configuration file. Everything about the cluster itself comes from metadata; this
// file says only where things are on this machine.
type Config struct {
	// MetadataURL is the instance-metadata service.
	MetadataURL string `json:"metadataURL,omitempty"`
	// UserDataFile, on machines without a metadata service (bare metal booted by PXE), is the user-data
	// cloud-init wrote (berth_node_config's json, /etc/berth/user-data.json); the node is then a worker
	// named by its hostname.
	UserDataFile string `json:"userDataFile,omitempty"`
	// AWS makes the node an EC2 instance: it reads itself from IMDSv2 (its user-data is berth_node_config's
	// json), and the join service of a control-plane node looks nodes up through the EC2 API and trusts
	// their TPMs by the EK that EC2 reports for each instance. Exactly one of MetadataURL, UserDataFile and
	// AWS is set.
	AWS *aws.Config `json:"aws,omitempty"`
	// GCP makes the node a Compute Engine instance: it reads itself from the GCE metadata server (its
	// berth-node-config attribute is berth_node_config's json), and the join service of a control-plane node
	// looks nodes up through the Compute API, takes their role from their managed instance group, and trusts
	// their vTPMs by Google's EK certificate and the EK the Compute API reports for each instance. Exactly
	// one of MetadataURL, UserDataFile, AWS and GCP is set.
	GCP *gcp.Config `json:"gcp,omitempty"`
	// TPM is the TPM device (/dev/tpmrm0) or a swtpm socket ("unix:/path", "tcp:host:port").
	TPM string `json:"tpm,omitempty"`
	// StateDisk is the block device (or, in labs, the image file) of the encrypted state disk.
	StateDisk string `json:"stateDisk"`
	// StateMount is where the opened state volume is mounted; empty leaves it unmapped (labs without dm-crypt).
	StateMount string `json:"stateMount,omitempty"`
	// MapperName is the device-mapper name of the opened state volume.
	MapperName string          `json:"mapperName,omitempty"`
	Paths      nodestate.Paths `json:"paths"`
	// VerifiedRoot is the dm-verity device the root file system is mounted from: the agent reads all of it
	// before it attests, so that a block that does not verify stops the node before it asks for a secret.
	// verifiedroot.DefaultDevice unless set; "none" skips the read. An image without a verified root has no
	// such device, and nothing is read.
	VerifiedRoot string `json:"verifiedRoot,omitempty"`
	// StateDirs are bound from the state volume once it is mounted (statedisk.BindDirs): what is written
	// there is encrypted and survives a root file system that is read-only or in memory. With stateMount set,
	// it defaults to DefaultStateDirs; an empty list binds nothing.
	StateDirs []string `json:"stateDirs,omitempty"`
	// SourceAddress, if set, is the address outgoing connections are made from.
	SourceAddress string `json:"sourceAddress,omitempty"`
	// InitListen is the init server's listen address.
	InitListen string `json:"initListen,omitempty"`
	// JoinListenHost is the host part the join service listens on; the port comes from user-data.
	JoinListenHost string `json:"joinListenHost,omitempty"`
	// PCRs to quote; the join client's defaults when empty.
	PCRs []int `json:"pcrs,omitempty"`
	// Kubeadm is the kubeadm binary; IgnorePreflightErrors go to every kubeadm run.
	Kubeadm               string   `json:"kubeadm,omitempty"`
	IgnorePreflightErrors []string `json:"ignorePreflightErrors,omitempty"`
	// EKCABundle is a PEM file of the TPM vendors' EK CAs the join service trusts.
	EKCABundle string `json:"ekCABundle,omitempty"`
	// Kubeconfig is the join service's credentials for the API server.
	Kubeconfig string `json:"kubeconfig,omitempty"`
	// PolicyFile makes the join service read its policy from a file instead of the ConfigMap.
	PolicyFile string `json:"policyFile,omitempty"`
	// PolicyConfigMap is the join policy's ConfigMap in kube-system.
	PolicyConfigMap string `json:"policyConfigMap,omitempty"`
	// CFSSL, if set, makes the join service sign kubelet client certificates through a CFSSL remote signer,
	// so that the Kubernetes CA's key (ca.key) need not be on this machine.
	CFSSL *joinserver.CFSSLConfig `json:"cfssl,omitempty"`
	// SkipPhases are kubeadm init phases this image leaves out (e.g. addons whose images it does not carry).
	SkipPhases []string `json:"skipPhases,omitempty"`
	// ImageRepository is where kubeadm takes the control-plane images from (the image's own, preloaded).
	ImageRepository string `json:"imageRepository,omitempty"`
	// Kubelet says how this machine runs its kubelet.
	Kubelet KubeletConfig `json:"kubelet,omitempty"`
	// KubeProxy goes to the cluster's kube-proxy configuration when this node initializes it.
	KubeProxy kubeadm.KubeProxySettings `json:"kubeProxy,omitempty"`
	// PodNetwork says where this image's container runtime finds CNI plugins and which images run the pod
	// network that this node installs when it initializes a cluster (berth_cluster's pod_network);
	// upstream's images and /opt/cni/bin if unset.
	PodNetwork podnetwork.Settings `json:"podNetwork,omitempty"`
	// RetryMax caps the join client's backoff.
	RetryMax configfile.Duration `json:"retryMax,omitempty"`
	// LocalUnlock seals the disk key in this node's TPM, under the join policy's images for its role, so that
	// the node unlocks its disk at boot without a join service. Control-plane nodes seal unless it is false:
	// without it a cluster whose control plane is all down at once never comes back. Workers seal only when
	// it is true (edge nodes that must boot offline), since a worker that needs no join service to boot is
	// one that a cluster operator can no longer keep out by removing its instance record.
	LocalUnlock *bool `json:"localUnlock,omitempty"`
	// LocalUnlockRefresh is how often a sealing worker asks the join service for the current policy, to
	// seal again when it changed; DefaultLocalUnlockRefresh if zero. Control-plane nodes watch the policy.
	LocalUnlockRefresh configfile.Duration `json:"localUnlockRefresh,omitempty"`
	// CertificateRenewBefore is how long before the first of its kubeadm certificates ends a control-plane
	// node renews them (package certrenew); certrenew.DefaultRenewBefore if zero.
	CertificateRenewBefore configfile.Duration `json:"certificateRenewBefore,omitempty"`
	// GoneNodeGrace is how long a control-plane node's join service leaves the NotReady Node of an instance
	// deleted from the lab's metadata service (or an operator's inventory it serves) before it removes it;
	// DefaultGoneNodeGrace if zero. Refused on AWS and GCP: their APIs do not list a stopped instance either,
	// so a terminated machine cannot be told from a stopped one there.
	GoneNodeGrace configfile.Duration `json:"goneNodeGrace,omitempty"`
	// MetricsListen, if set, is where the join service and the init server serve their Prometheus metrics,
	// /healthz and /readyz, in plain HTTP (docs/metrics.md). Off unless set: the port answers anyone who
	// reaches it, so an operator opens it on the address a load balancer and a Prometheus can reach.
	MetricsListen string `json:"metricsListen,omitempty"`
}

// DefaultStateDirs are the directories bound from the state volume unless stateDirs says otherwise: kubeadm's
// (the cluster's CA keys on control-plane nodes), the kubelet's (its credentials) and etcd's data.
func (c *Config) DefaultStateDirs() []string {
	return []string{c.Paths.KubernetesDir, c.Paths.KubeletDir, "/var/lib/etcd"}
}

// DefaultGoneNodeGrace is how long the Node of a deleted instance stays: long enough for an operator who
// deleted the wrong record to put it back.
const DefaultGoneNodeGrace = 30 * time.Minute

// goneNodeGrace is how long the join service leaves the Nodes of deleted instances, 0 where it cannot tell a
// deleted instance from a stopped one.
func (c *Config) goneNodeGrace() time.Duration {
	if c.AWS != nil || c.GCP != nil {
		return 0
	}
	return cmp.Or(c.GoneNodeGrace.Duration, DefaultGoneNodeGrace)
}

// DefaultLocalUnlockRefresh is how often a sealing worker asks for the current policy.
const DefaultLocalUnlockRefresh = 10 * time.Minute

// sealsLocally says whether a node of role seals its disk key in its TPM.
func (c *Config) sealsLocally(role metadata.Role) bool {
	if c.LocalUnlock != nil {
		return *c.LocalUnlock
	}
	return role == metadata.RoleControlPlane
}

// KubeletConfig is the kubelet's side of the image.
type KubeletConfig struct {
	// Run makes the agent start the kubelet with kubeadm's flags, on machines without systemd.
	Run    bool   `json:"run,omitempty"`
	Binary string `json:"binary,omitempty"`
	// ExtraArgs are this node's own kubelet flags, without the leading dashes.
	ExtraArgs map[string]string `json:"extraArgs,omitempty"`
	// CloudProvider "external" leaves the node to the cloud's controller manager (--cloud-provider=external),
	// which the cluster must run: it removes a new node's taint node.cloudprovider.kubernetes.io/uninitialized
	// and deletes the Nodes of deleted instances. Empty runs without one. The node's provider ID
	// (--provider-id) comes from the platform wherever it has one.
	CloudProvider string `json:"cloudProvider,omitempty"`
	// CgroupDriver and AllowCgroupV1 go to the cluster's kubelet configuration when this node initializes it,
	// and to this node's own when it joins an external control plane (without kubeadm).
	CgroupDriver  string `json:"cgroupDriver,omitempty"`
	AllowCgroupV1 bool   `json:"allowCgroupV1,omitempty"`
}

// CloudProviderExternal is KubeletConfig.CloudProvider for a cluster that runs its cloud's controller manager.
const CloudProviderExternal = "external"

// kubeletFlagsOfTheAgent are the kubelet flags the agent sets itself, from the node's address and cloud.
var kubeletFlagsOfTheAgent = map[string]string{
	"node-ip": "the node's address", "cloud-provider": "kubelet.cloudProvider", "provider-id": "the platform",
	"hostname-override": "the node's name",
}

func (k KubeletConfig) check() []error {
	var errs []error
	if k.CloudProvider != "" && k.CloudProvider != CloudProviderExternal {
		errs = append(errs, fmt.Errorf("kubelet.cloudProvider: %q is not %q (a cloud controller manager runs in the cluster) or empty (none does)", k.CloudProvider, CloudProviderExternal))
	}
	for _, name := range slices.Sorted(maps.Keys(k.ExtraArgs)) {
		if from, ok := kubeletFlagsOfTheAgent[name]; ok {
			errs = append(errs, fmt.Errorf("kubelet.extraArgs: %s is set by the agent from %s; leave it out", name, from))
		}
	}
	return errs
}

// externalCloud says whether the kubelet leaves the node to a cloud controller manager.
func (k KubeletConfig) externalCloud() bool { return k.CloudProvider == CloudProviderExternal }

// LoadConfig reads a configuration file and fills in defaults. Its errors name the file and, one problem a
// line, every field that is wrong (configfile.Load).
func LoadConfig(path string) (*Config, error) {
	var c Config
	if err := configfile.Load(path, "agent configuration", &c, func() error {
		c.Defaults()
		return c.Validate()
	}); err != nil {
		return nil, err
	}
	return &c, nil
}

// Defaults fills in what a real node uses.
func (c *Config) Defaults() {
	if c.TPM == "" {
		c.TPM = attest.DefaultDevice
	}
	if c.MapperName == "" {
		c.MapperName = "berth-state"
	}
	if c.Paths == (nodestate.Paths{}) {
		c.Paths = nodestate.DefaultPaths
	}
	if c.InitListen == "" {
		c.InitListen = fmt.Sprintf(":%d", DefaultInitPort)
	}
	if c.Kubeadm == "" {
		c.Kubeadm = "kubeadm"
	}
	if c.EKCABundle == "" {
		c.EKCABundle = "/etc/berth/ek-ca.pem"
	}
	if c.PolicyConfigMap == "" {
		c.PolicyConfigMap = policy.DefaultConfigMap
	}
	if c.CertificateRenewBefore.Duration == 0 {
		c.CertificateRenewBefore.Duration = certrenew.DefaultRenewBefore
	}
	if c.LocalUnlockRefresh.Duration == 0 {
		c.LocalUnlockRefresh.Duration = DefaultLocalUnlockRefresh
	}
	if c.VerifiedRoot == "" {
		c.VerifiedRoot = verifiedroot.DefaultDevice
	}
	if c.StateMount != "" && c.StateDirs == nil {
		c.StateDirs = c.DefaultStateDirs()
	}
}

// Validate says what is missing or wrong, every problem at once.
func (c *Config) Validate() error {
	var errs []error
	sources := 0
	for _, set := range []bool{c.MetadataURL != "", c.UserDataFile != "", c.AWS != nil, c.GCP != nil} {
		if set {
			sources++
		}
	}
	if sources != 1 {
		errs = append(errs, errors.New("set exactly one of metadataURL (a metadata service), userDataFile (bare metal), aws (EC2) and gcp (Compute Engine)"))
	}
	if c.AWS != nil {
		errs = append(errs, c.AWS.Validate()...)
	}
	if c.GCP != nil {
		errs = append(errs, c.GCP.Validate()...)
	}
	errs = append(errs, platform.CheckEndpoints("", map[string]string{"metadataURL": c.MetadataURL})...)
	if c.MetricsListen != "" {
		if err := configfile.CheckHostPort("metricsListen", c.MetricsListen, "0.0.0.0:9452", true); err != nil {
			errs = append(errs, err)
		}
	}
	if err := configfile.CheckHostPort("initListen", c.InitListen, fmt.Sprintf(":%d", DefaultInitPort), true); err != nil {
		errs = append(errs, err)
	}
	if c.JoinListenHost != "" && !configfile.ValidHost(c.JoinListenHost) {
		errs = append(errs, fmt.Errorf("joinListenHost: %q is not an IP address or a host name (the port comes from user-data)", c.JoinListenHost))
	}
	if c.StateDisk == "" {
		errs = append(errs, errors.New("stateDisk is required"))
	}
	if c.Paths.State == "" || c.Paths.KubernetesDir == "" || c.Paths.KubeletDir == "" {
		errs = append(errs, errors.New("paths.state, paths.kubernetesDir and paths.kubeletDir must all be set"))
	}
	for _, f := range []struct{ name, path string }{
		{"stateDisk", c.StateDisk}, {"userDataFile", c.UserDataFile}, {"ekCABundle", c.EKCABundle},
		{"kubeconfig", c.Kubeconfig}, {"policyFile", c.PolicyFile}, {"paths.state", c.Paths.State},
		{"paths.kubernetesDir", c.Paths.KubernetesDir}, {"paths.kubeletDir", c.Paths.KubeletDir},
	} {
		if f.path != "" && !filepath.IsAbs(f.path) {
			errs = append(errs, fmt.Errorf("%s: %q is not an absolute path", f.name, f.path))
		}
	}
	if err := checkTPM(c.TPM); err != nil {
		errs = append(errs, err)
	}
	// Zero is "the default" for both; a negative duration would reach a timer or a backoff.
	for _, d := range []struct {
		name  string
		value time.Duration
	}{{"retryMax", c.RetryMax.Duration}, {"localUnlockRefresh", c.LocalUnlockRefresh.Duration},
		{"certificateRenewBefore", c.CertificateRenewBefore.Duration}, {"goneNodeGrace", c.GoneNodeGrace.Duration}} {
		if d.value < 0 {
			errs = append(errs, fmt.Errorf("%s: %v is negative: want a duration such as 30s, or leave it out for the default", d.name, d.value))
		}
	}
	if c.GoneNodeGrace.Duration != 0 && (c.AWS != nil || c.GCP != nil) {
		errs = append(errs, errors.New("goneNodeGrace: on AWS and GCP a stopped instance is not listed either, so the join service cannot tell it from a terminated one; leave it out"))
	}
	if c.StateMount != "" && !filepath.IsAbs(c.StateMount) {
		errs = append(errs, fmt.Errorf("stateMount: %q is not an absolute path", c.StateMount))
	}
	errs = append(errs, c.checkStateDirs()...)
	if c.VerifiedRoot != "none" && !filepath.IsAbs(c.VerifiedRoot) {
		errs = append(errs, fmt.Errorf("verifiedRoot: %q is not an absolute path or none", c.VerifiedRoot))
	}
	if c.CFSSL != nil && (c.CFSSL.URL == "" || c.CFSSL.Profile == "" || c.CFSSL.AuthKeyFile == "") {
		errs = append(errs, errors.New("cfssl needs url, profile and authKeyFile"))
	}
	if err := c.KubeProxy.Validate(); err != nil {
		errs = append(errs, err)
	}
	errs = append(errs, c.Kubelet.check()...)
	if c.SourceAddress != "" {
		if _, err := netip.ParseAddr(c.SourceAddress); err != nil {
			errs = append(errs, fmt.Errorf("sourceAddress: %q is not an IP address", c.SourceAddress))
		}
	}
	return errors.Join(append(errs, checkPCRs(c.PCRs)...)...)
}

// Platform is the environment the configuration names, the one place where the agent chooses it. Validate
// has checked that exactly one is named, and sourceAddress.
func (c *Config) Platform() platform.Platform {
	src, _ := netip.ParseAddr(c.SourceAddress)
	switch {
	case c.UserDataFile != "":
		return baremetal.New(c.UserDataFile, src)
	case c.AWS != nil:
		return aws.New(*c.AWS)
	case c.GCP != nil:
		return gcp.New(*c.GCP)
	default:
		return lab.New(c.MetadataURL, src, c.EKCABundle)
	}
}

// checkTPM refuses a TPM that attest.Open could not open by its form: a device path, or a software TPM's
// unix:<absolute path> or tcp:<host:port>.
func checkTPM(tpm string) error {
	switch {
	case strings.HasPrefix(tpm, "unix:"):
		if !filepath.IsAbs(strings.TrimPrefix(tpm, "unix:")) {
			return fmt.Errorf("tpm: %q is not unix:<absolute path of a socket>", tpm)
		}
	case strings.HasPrefix(tpm, "tcp:"):
		if host, port, err := net.SplitHostPort(strings.TrimPrefix(tpm, "tcp:")); err != nil || port == "" || (host != "" && !configfile.ValidHost(host)) {
			return fmt.Errorf("tpm: %q is not tcp:<host:port>", tpm)
		}
	case !filepath.IsAbs(tpm):
		return fmt.Errorf("tpm: %q is not a device path (such as /dev/tpmrm0), unix:<socket> or tcp:<host:port>", tpm)
	}
	return nil
}

// checkStateDirs refuses binds that would fail or hide something at every boot, after the disk was keyed.
func (c *Config) checkStateDirs() []error {
	if len(c.StateDirs) == 0 {
		return nil
	}
	if c.StateMount == "" {
		return []error{errors.New("stateDirs: binding directories from the state volume needs stateMount")}
	}
	var errs []error
	mount := filepath.Clean(c.StateMount)
	seen := make(map[string]bool, len(c.StateDirs))
	for _, dir := range c.StateDirs {
		switch {
		case !filepath.IsAbs(dir) || filepath.Clean(dir) != dir:
			errs = append(errs, fmt.Errorf("stateDirs: %q is not a clean absolute path", dir))
		case dir == "/":
			errs = append(errs, errors.New("stateDirs: / cannot be bound from the state volume"))
		case within(dir, mount):
			errs = append(errs, fmt.Errorf("stateDirs: %s is on the state volume already (stateMount %s)", dir, mount))
		case within(mount, dir):
			errs = append(errs, fmt.Errorf("stateDirs: binding %s would hide the state volume mounted at %s", dir, mount))
		case seen[dir]:
			errs = append(errs, fmt.Errorf("stateDirs: %s is listed twice", dir))
		}
		seen[dir] = true
	}
	// A bind below another would be hidden by it or hide it, depending on the order.
	for _, a := range c.StateDirs {
		for _, b := range c.StateDirs {
			if a != b && within(a, b) {
				errs = append(errs, fmt.Errorf("stateDirs: %s is below %s: list only the upper one", a, b))
			}
		}
	}
	return errs
}

// within says whether path is dir or below it; both are clean.
func within(path, dir string) bool {
	rel, err := filepath.Rel(dir, path)
	return err == nil && rel != ".." && !strings.HasPrefix(rel, "../")
}

// maxPCR is the highest PCR index of a TPM 2.0 (PC Client Platform Firmware Profile: 24 PCRs per bank).
const maxPCR = 23

// checkPCRs refuses what a TPM would only refuse at the first quote, long after boot started.
func checkPCRs(pcrs []int) []error {
	var errs []error
	seen := make(map[int]bool, len(pcrs))
	for _, pcr := range pcrs {
		switch {
		case pcr < 0 || pcr > maxPCR:
			errs = append(errs, fmt.Errorf("pcrs: %d is not a PCR index (0 to %d)", pcr, maxPCR))
		case seen[pcr]:
			errs = append(errs, fmt.Errorf("pcrs: %d is listed twice", pcr))
		}
		seen[pcr] = true
	}
	return errs
}
