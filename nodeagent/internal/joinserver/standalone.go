package joinserver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"

	"k8s.io/client-go/kubernetes"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/clustersecrets"
	"github.com/berthlabs/berth/internal/kubeadm"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/nodeagent/internal/configfile"
	"github.com/berthlabs/berth/nodeagent/internal/joinservice"
	"github.com/berthlabs/berth/nodeagent/internal/platform"
	"github.com/berthlabs/berth/nodeagent/internal/telemetry"
)

// DefaultServiceConfigPath is where a join service beside an external control plane reads its configuration.
const DefaultServiceConfigPath = "/etc/berth/join-service.yaml"

// ServiceConfig configures a join service that runs outside the cluster, beside a control plane kubeadm did
// not make (berth-agent joinservice --service-config, as a systemd service). It joins workers only, with the
// kubelet method: nodes get a kubelet client certificate signed through CFSSL (or the CA key, if given
// here), the API server's endpoint and CA, and no bootstrap token.
type ServiceConfig struct {
	// Listen is host:port to listen on, such as 10.0.0.5:7450.
	Listen string `json:"listen"`
	// ServerAddresses and ServerNames are what the service's certificate names (it is issued by the join CA
	// at each start); nodes dial the user-data's joinEndpoints. Default: the listen host, if it is an IP.
	ServerAddresses []string `json:"serverAddresses,omitempty"`
	ServerNames     []string `json:"serverNames,omitempty"`

	// InventoryFile lists the machines that may join (name, role worker, addresses), the service's record
	// of who a connecting address is; MetadataURL names a metadata service with those records instead.
	// Exactly one is set.
	InventoryFile string `json:"inventoryFile,omitempty"`
	MetadataURL   string `json:"metadataURL,omitempty"`

	// APIServerEndpoint is host:port of the API server as nodes reach it.
	APIServerEndpoint string `json:"apiServerEndpoint"`
	// Kubeconfig holds the service's own credentials at the API server: it keeps its record of which TPM
	// owns each state disk in kube-system ConfigMaps, and reads the policy ConfigMap if PolicyFile is not set.
	Kubeconfig string `json:"kubeconfig"`
	// KubernetesCA is the cluster CA's certificate (PEM): nodes trust the API server by it, and kubelet
	// certificates must be signed by it.
	KubernetesCA string `json:"kubernetesCA"`
	// CFSSL signs kubelet client certificates; KubernetesCAKey, a PEM key file, signs them here instead.
	// Exactly one is set.
	CFSSL           *CFSSLConfig `json:"cfssl,omitempty"`
	KubernetesCAKey string       `json:"kubernetesCAKey,omitempty"`

	// RootKeyFile holds the cluster's root key (base64, the one berth_secrets was made with): the master
	// secret, salt and join CA key derive from it. Readable by the service's user only.
	RootKeyFile string `json:"rootKeyFile"`
	// JoinCACertificate is berth_secrets' join_ca_certificate (PEM); nodes pin it (join_ca_pin).
	JoinCACertificate string `json:"joinCACertificate"`
	// EKCABundle is a PEM file of the TPM vendors' EK CAs.
	EKCABundle string `json:"ekCABundle"`
	// PolicyFile is the join policy (berth_join_policy's document); without it the service reads the
	// ConfigMap PolicyConfigMap in kube-system (default berth-join-policy).
	PolicyFile      string `json:"policyFile,omitempty"`
	PolicyConfigMap string `json:"policyConfigMap,omitempty"`

	// ClusterDNS and ClusterDomain go to every node's kubelet configuration.
	ClusterDNS    []string `json:"clusterDNS,omitempty"`
	ClusterDomain string   `json:"clusterDomain,omitempty"`
	// KubernetesVersion is told to nodes with their ticket, for their logs; optional.
	KubernetesVersion string `json:"kubernetesVersion,omitempty"`
	// Timeout bounds one node's whole exchange; default 30s.
	Timeout configfile.Duration `json:"timeout,omitempty"`
	// MetricsListen, if set, is where the service serves its Prometheus metrics, /healthz and /readyz, in
	// plain HTTP (docs/metrics.md).
	MetricsListen string `json:"metricsListen,omitempty"`
}

// LoadServiceConfig reads a join service configuration file and checks it.
func LoadServiceConfig(path string) (*ServiceConfig, error) {
	var c ServiceConfig
	if err := configfile.Load(path, "join service configuration", &c, func() error {
		if c.PolicyConfigMap == "" {
			c.PolicyConfigMap = "berth-join-policy"
		}
		return errors.Join(c.Validate(), c.checkFiles())
	}); err != nil {
		return nil, err
	}
	return &c, nil
}

// checkFiles says which of the files the configuration names cannot be read, all at once: the service
// would otherwise stop at the first when it starts, one restart per file.
func (c *ServiceConfig) checkFiles() error {
	files := []struct{ name, path string }{
		{"kubeconfig", c.Kubeconfig}, {"kubernetesCA", c.KubernetesCA}, {"kubernetesCAKey", c.KubernetesCAKey},
		{"rootKeyFile", c.RootKeyFile}, {"joinCACertificate", c.JoinCACertificate}, {"ekCABundle", c.EKCABundle},
		{"policyFile", c.PolicyFile}, {"inventoryFile", c.InventoryFile},
	}
	if c.CFSSL != nil {
		files = append(files, struct{ name, path string }{"cfssl.authKeyFile", c.CFSSL.AuthKeyFile})
	}
	var errs []error
	for _, f := range files {
		if f.path == "" {
			continue
		}
		file, err := os.Open(f.path)
		if err == nil {
			var fi os.FileInfo
			if fi, err = file.Stat(); err == nil && !fi.Mode().IsRegular() {
				err = fmt.Errorf("%s is not a regular file", f.path)
			}
			file.Close()
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", f.name, err))
		}
	}
	return errors.Join(errs...)
}

// Validate says everything that is missing or wrong at once.
func (c *ServiceConfig) Validate() error {
	var errs []error
	required := func(name, v string) {
		if v == "" {
			errs = append(errs, fmt.Errorf("%s is required", name))
		}
	}
	required("listen", c.Listen)
	required("apiServerEndpoint", c.APIServerEndpoint)
	required("kubeconfig", c.Kubeconfig)
	required("kubernetesCA", c.KubernetesCA)
	required("rootKeyFile", c.RootKeyFile)
	required("joinCACertificate", c.JoinCACertificate)
	required("ekCABundle", c.EKCABundle)
	if c.Listen != "" {
		if _, err := netip.ParseAddrPort(c.Listen); err != nil {
			errs = append(errs, fmt.Errorf("listen %q is not ip:port: %w", c.Listen, err))
		}
	}
	if c.APIServerEndpoint != "" {
		if err := configfile.CheckHostPort("apiServerEndpoint", c.APIServerEndpoint, "10.0.0.10:6443", false); err != nil {
			errs = append(errs, err)
		}
	}
	for _, a := range c.ServerAddresses {
		if _, err := netip.ParseAddr(a); err != nil {
			errs = append(errs, fmt.Errorf("serverAddresses: %q is not an IP address", a))
		}
	}
	// The certificate would be issued with any of them, and nodes would fail to verify it.
	for _, n := range c.ServerNames {
		if _, err := netip.ParseAddr(n); err == nil || !configfile.ValidHost(n) {
			errs = append(errs, fmt.Errorf("serverNames: %q is not a DNS name (addresses go in serverAddresses)", n))
		}
	}
	if c.ClusterDomain != "" && !configfile.ValidHost(c.ClusterDomain) {
		errs = append(errs, fmt.Errorf("clusterDomain: %q is not a DNS name such as cluster.local", c.ClusterDomain))
	}
	if c.MetricsListen != "" {
		if err := configfile.CheckHostPort("metricsListen", c.MetricsListen, "0.0.0.0:9452", true); err != nil {
			errs = append(errs, err)
		}
	}
	if c.KubernetesVersion != "" && !kubeadm.IsRelease(c.KubernetesVersion) {
		errs = append(errs, fmt.Errorf("kubernetesVersion: %q is not a release such as v1.36.3", c.KubernetesVersion))
	}
	if c.CFSSL != nil && c.CFSSL.URL != "" {
		errs = append(errs, platform.CheckEndpoints("cfssl", map[string]string{"url": c.CFSSL.URL})...)
	}
	if (c.InventoryFile == "") == (c.MetadataURL == "") {
		errs = append(errs, errors.New("set exactly one of inventoryFile and metadataURL"))
	}
	errs = append(errs, platform.CheckEndpoints("", map[string]string{"metadataURL": c.MetadataURL})...)
	if c.Timeout.Duration < 0 {
		errs = append(errs, fmt.Errorf("timeout: %v is negative: want a duration such as 30s, or leave it out for the default", c.Timeout.Duration))
	}
	if (c.CFSSL == nil) == (c.KubernetesCAKey == "") {
		errs = append(errs, errors.New("set exactly one of cfssl and kubernetesCAKey: kubelet certificates are signed by one of them"))
	}
	if c.CFSSL != nil && (c.CFSSL.URL == "" || c.CFSSL.Profile == "" || c.CFSSL.AuthKeyFile == "") {
		errs = append(errs, errors.New("cfssl needs url, profile and authKeyFile"))
	}
	for _, s := range c.ClusterDNS {
		if _, err := netip.ParseAddr(s); err != nil {
			errs = append(errs, fmt.Errorf("clusterDNS: %q is not an IP address", s))
		}
	}
	return errors.Join(errs...)
}

// certificateIPs are the addresses the service's certificate names: serverAddresses, or the listen address.
func (c *ServiceConfig) certificateIPs() ([]net.IP, error) {
	var ips []net.IP
	for _, s := range c.ServerAddresses {
		a, err := netip.ParseAddr(s)
		if err != nil {
			return nil, fmt.Errorf("serverAddresses: %w", err)
		}
		ips = append(ips, a.AsSlice())
	}
	if len(ips) > 0 || len(c.ServerNames) > 0 {
		return ips, nil
	}
	ap, err := netip.ParseAddrPort(c.Listen)
	if err != nil {
		return nil, fmt.Errorf("listen: %w", err)
	}
	if ap.Addr().IsUnspecified() {
		return nil, fmt.Errorf("listen %s names no address for the certificate: set serverAddresses or serverNames", c.Listen)
	}
	return []net.IP{ap.Addr().AsSlice()}, nil
}

// TelemetryLabels are the fixed label values of a join service's metrics, from an agent of build.
func TelemetryLabels(build telemetry.Build) telemetry.Labels {
	return telemetry.Labels{JoinCalls: joinservice.Calls, JoinRefusals: joinservice.RefusalReasons,
		JoinErrors: joinservice.ErrorKinds, Build: build}
}

// ServeStandalone runs the join service of cfg until ctx ends, with the metrics of build. Everything it reads
// is checked before it listens, so a service that starts serves.
func ServeStandalone(ctx context.Context, cfg *ServiceConfig, kubeClient func(kubeconfig string) (kubernetes.Interface, error), logger *slog.Logger, build telemetry.Build) error {
	log := logger.With("component", "join-service")
	rootText, err := os.ReadFile(cfg.RootKeyFile)
	if err != nil {
		return fmt.Errorf("join service: root key: %w", err)
	}
	root, err := clustersecrets.ParseRootKey(string(rootText))
	if err != nil {
		return fmt.Errorf("join service: root key %s: %w", cfg.RootKeyFile, err)
	}
	secrets, err := clustersecrets.Derive(root)
	if err != nil {
		return fmt.Errorf("join service: %w", err)
	}
	joinCertPEM, err := os.ReadFile(cfg.JoinCACertificate)
	if err != nil {
		return fmt.Errorf("join service: join CA: %w", err)
	}
	joinCA, err := secrets.JoinCA(joinCertPEM)
	if err != nil {
		return fmt.Errorf("join service: %s and %s: %w", cfg.JoinCACertificate, cfg.RootKeyFile, err)
	}
	kubeCA, signer, err := KubeletSigning(cfg.KubernetesCA, cfg.KubernetesCAKey, cfg.CFSSL, logger)
	if err != nil {
		return fmt.Errorf("join service: %w", err)
	}
	verifier, err := platform.EKVerifier(cfg.EKCABundle)
	if err != nil {
		return fmt.Errorf("join service: %w", err)
	}
	var instances joinservice.InstanceLookup = &metadata.Client{BaseURL: cfg.MetadataURL}
	if cfg.InventoryFile != "" {
		inv := &metadata.Inventory{Path: cfg.InventoryFile}
		if _, err := metadata.ParseInventory(cfg.InventoryFile); err != nil {
			return fmt.Errorf("join service: %w", err)
		}
		instances = inv
	}
	kube, err := kubeClient(cfg.Kubeconfig)
	if err != nil {
		return fmt.Errorf("join service: %w", err)
	}
	ips, err := cfg.certificateIPs()
	if err != nil {
		return fmt.Errorf("join service: %w", err)
	}
	opts := Options{
		Listen: cfg.Listen, Names: cfg.ServerNames, IPs: ips, Kube: kube,
		PolicyFile: cfg.PolicyFile, PolicyConfigMap: cfg.PolicyConfigMap, Log: log,
	}
	if cfg.MetricsListen != "" {
		lis, err := net.Listen("tcp", cfg.MetricsListen)
		if err != nil {
			return fmt.Errorf("join service: metrics listener: %w", err)
		}
		mlog := logger.With("component", "metrics")
		opts.Metrics = telemetry.New(TelemetryLabels(build))
		opts.Health = telemetry.NewServer(opts.Metrics, mlog)
		go func() {
			if err := opts.Health.Serve(ctx, lis); err != nil {
				mlog.Error("serving metrics", "error", err)
			}
		}()
		mlog.Info("metrics and health listening", "address", lis.Addr().String())
	}
	return Serve(ctx, opts, joinservice.Config{
		Verifier:          verifier,
		Instances:         instances,
		MasterSecret:      secrets.MasterSecret,
		Salt:              secrets.Salt,
		KubernetesCA:      kubeCA,
		KubeletSigner:     signer,
		APIServerEndpoint: cfg.APIServerEndpoint,
		KubernetesVersion: cfg.KubernetesVersion,
		JoinCA:            joinCA,
		Method:            berthv1.JoinMethod_JOIN_METHOD_KUBELET,
		Kubelet:           &berthv1.KubeletSettings{ClusterDns: cfg.ClusterDNS, ClusterDomain: cfg.ClusterDomain},
		Timeout:           cfg.Timeout.Duration,
		Logger:            log,
	})
}
