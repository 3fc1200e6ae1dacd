package initserver

import (
	"cmp"
	"errors"
	"fmt"
	"net"
	"strconv"
	"time"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/clusterinfo"
	"github.com/berthlabs/berth/internal/clustername"
	"github.com/berthlabs/berth/internal/keys"
	"github.com/berthlabs/berth/internal/kubeadm"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/podnetwork"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
)

// Minimum sizes of the key material, the same that keys.Derive enforces, checked here so that a short
// secret is refused by name before anything else.
const (
	minMasterSecret = 32
	minSalt         = 16
	// maxCertificateValiditySeconds is ten years, as long as kubeadm's own CAs last.
	maxCertificateValiditySeconds = 10 * 365 * 24 * 60 * 60
)

// plan is a checked init request with everything derived from it: nothing in it can fail to apply for a
// reason the request could have shown.
type plan struct {
	// record is what the cluster keeps of itself (clusterinfo), written right after kubeadm init.
	record        clusterinfo.Info
	diskKey       []byte
	kubeCA        *pki.CA
	kubeCAKeyPEM  []byte
	kubeadmConfig []byte
	apiEndpoint   string
	joinPolicy    []byte
	// podNetwork is the plugin installed after kubeadm init (podnetwork.None for none), for pods of
	// podSubnet, the cluster's.
	podNetwork, podSubnet string
	secrets               *nodestate.ClusterSecrets
}

// checkedRequest is an init request that validateRequest accepted, with the CAs it parsed on the way.
type checkedRequest struct {
	req            *berthv1.InitRequest
	kubeCA, joinCA *pki.CA
}

// validateRequest checks req for the node inst at now, before anything is derived from it. Errors name the
// field and never carry secret material.
func validateRequest(req *berthv1.InitRequest, inst metadata.Instance, now time.Time) (*checkedRequest, error) {
	if req == nil {
		return nil, errors.New("no init request")
	}
	if n := len(req.MasterSecret); n < minMasterSecret {
		return nil, fmt.Errorf("master secret is %d bytes, want at least %d", n, minMasterSecret)
	}
	if n := len(req.Salt); n < minSalt {
		return nil, fmt.Errorf("salt is %d bytes, want at least %d", n, minSalt)
	}
	kubeCA, err := checkCA("Kubernetes CA", req.KubernetesCaCertificate, req.KubernetesCaKey, now)
	if err != nil {
		return nil, err
	}
	joinCA, err := checkCA("join CA", req.JoinCaCertificate, req.JoinCaKey, now)
	if err != nil {
		return nil, err
	}
	// Nodes pin the join CA to trust join services; if it were the Kubernetes CA, every API server
	// certificate would pass for a join service.
	if pki.SPKIPin(kubeCA.Cert) == pki.SPKIPin(joinCA.Cert) {
		return nil, errors.New("the join CA and the Kubernetes CA have the same key; they must be different CAs")
	}
	if err := clustername.Validate(req.ClusterName); err != nil {
		return nil, err
	}
	if !kubeadm.IsRelease(req.KubernetesVersion) {
		return nil, fmt.Errorf("kubernetes version %q is not a release version such as v1.36.3", req.KubernetesVersion)
	}
	if len(req.JoinPolicy) > 0 {
		if _, err := policy.Parse(req.JoinPolicy); err != nil {
			return nil, fmt.Errorf("initial join policy: %w", err)
		}
	}
	if err := podnetwork.Check(req.PodNetwork); err != nil {
		return nil, err
	}
	// kubeadm checks the lower bound; this one keeps the seconds within a time.Duration.
	if v := req.CertificateValiditySeconds; v < 0 || v > maxCertificateValiditySeconds {
		return nil, fmt.Errorf("certificate validity of %d seconds: want 0 (kubeadm's year) up to %d (ten years)", v, maxCertificateValiditySeconds)
	}
	if len(inst.Addresses) == 0 {
		return nil, fmt.Errorf("instance %q has no address to advertise", inst.Name)
	}
	return &checkedRequest{req: req, kubeCA: kubeCA, joinCA: joinCA}, nil
}

// certificateValidity is v as the cluster record keeps it: "" for kubeadm's default.
func certificateValidity(v time.Duration) string {
	if v == 0 {
		return ""
	}
	return v.String()
}

// planInit derives everything the init of node inst, whose state disk is disk, needs from a checked request.
// base holds this machine's kubeadm settings (image, phases, kubelet, certificates directory); the node's
// identity and the request's cluster settings are filled in here. Its errors are those of the request's
// cluster settings that only kubeadm's configuration checks (subnets, endpoint), named without secrets.
func planInit(c *checkedRequest, inst metadata.Instance, disk keys.Label, base kubeadm.InitParams) (*plan, error) {
	req, kubeCA, joinCA := c.req, c.kubeCA, c.joinCA
	advertise := inst.Addresses[0]
	params := base
	params.NodeName, params.AdvertiseAddress = inst.Name, advertise
	params.ControlPlaneEndpoint, params.KubernetesVersion, params.ClusterName = req.ControlPlaneEndpoint, req.KubernetesVersion, req.ClusterName
	params.PodSubnet, params.ServiceSubnet = req.PodSubnet, req.ServiceSubnet
	params.CertificateValidity = time.Duration(req.CertificateValiditySeconds) * time.Second
	config, err := kubeadm.InitConfig(params)
	if err != nil {
		return nil, fmt.Errorf("kubeadm configuration: %w", err)
	}
	endpoint := req.ControlPlaneEndpoint
	if endpoint == "" {
		endpoint = net.JoinHostPort(advertise.Unmap().String(), strconv.Itoa(int(kubeadm.DefaultBindPort)))
	}

	diskKey, err := keys.Derive(req.MasterSecret, req.Salt, disk, keys.DiskKeySize)
	if err != nil {
		return nil, err
	}
	clusterID, err := keys.ClusterIDOf(req.MasterSecret, req.Salt)
	if err != nil {
		return nil, err
	}
	kubeKeyPEM, err := kubeCA.KeyPEM()
	if err != nil {
		return nil, fmt.Errorf("Kubernetes CA: %w", err)
	}
	joinKeyPEM, err := joinCA.KeyPEM()
	if err != nil {
		return nil, fmt.Errorf("join CA: %w", err)
	}
	podNetwork := cmp.Or(req.PodNetwork, podnetwork.None)
	return &plan{
		record: clusterinfo.Info{ID: clusterID, Name: req.ClusterName, Init: clusterinfo.InitSettings{
			KubernetesVersion:    req.KubernetesVersion,
			ControlPlaneEndpoint: req.ControlPlaneEndpoint,
			PodSubnet:            req.PodSubnet,
			ServiceSubnet:        req.ServiceSubnet,
			PodNetwork:           podNetwork,
			APIServerEndpoint:    endpoint,
			JoinCACertificate:    string(joinCA.CertPEM()),
			CertificateValidity:  certificateValidity(params.CertificateValidity),
		}},
		diskKey:       diskKey,
		kubeCA:        kubeCA,
		kubeCAKeyPEM:  kubeKeyPEM,
		kubeadmConfig: config,
		apiEndpoint:   endpoint,
		joinPolicy:    req.JoinPolicy,
		podNetwork:    podNetwork,
		podSubnet:     cmp.Or(req.PodSubnet, kubeadm.DefaultPodSubnet),
		secrets: &nodestate.ClusterSecrets{
			MasterSecret:      req.MasterSecret,
			Salt:              req.Salt,
			JoinCACert:        joinCA.CertPEM(),
			JoinCAKey:         joinKeyPEM,
			APIServerEndpoint: endpoint,
			KubernetesVersion: req.KubernetesVersion,
		},
	}, nil
}

// checkCA parses a CA and refuses one that has expired: kubeadm would only fail later, after the node is
// committed to this init.
func checkCA(name string, certPEM, keyPEM []byte, now time.Time) (*pki.CA, error) {
	ca, err := pki.ParseCA(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	if now.After(ca.Cert.NotAfter) {
		return nil, fmt.Errorf("%s %q expired at %s", name, ca.Cert.Subject.CommonName, ca.Cert.NotAfter.UTC().Format(time.RFC3339))
	}
	return ca, nil
}
