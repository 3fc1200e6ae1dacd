package joinclient

import (
	"crypto/ecdsa"
	"crypto/subtle"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/keys"
	"github.com/berthlabs/berth/internal/kubeadm"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
)

// apiServerPort is where kubeadm's API server listens on control-plane nodes.
const apiServerPort = 6443

// kubeletCSR makes the kubelet's client key and the CSR the join service checks against the instance record.
func kubeletCSR(inst metadata.Instance) (*ecdsa.PrivateKey, []byte, error) {
	key, err := pki.NewKey()
	if err != nil {
		return nil, nil, err
	}
	ips := make([]net.IP, len(inst.Addresses))
	for i, a := range inst.Addresses {
		ips[i] = a.AsSlice()
	}
	csr, err := x509.CreateCertificateRequest(nil, &x509.CertificateRequest{
		Subject:     pkix.Name{CommonName: "system:node:" + inst.Name, Organization: []string{"system:nodes"}},
		IPAddresses: ips,
	}, key)
	if err != nil {
		return nil, nil, fmt.Errorf("creating kubelet CSR: %w", err)
	}
	return key, csr, nil
}

// KubeletCertPath is where the kubelet looks for its current client certificate and key.
func KubeletCertPath(p nodestate.Paths) string {
	return filepath.Join(p.KubeletDir, "pki", "kubelet-client-current.pem")
}

// joinPlan is everything a join ticket leaves on the node, checked and rendered before the node commits to
// the ticket (takes its lock, keys its disk), so that a ticket that fails any check leaves the node as it was.
type joinPlan struct {
	diskKey []byte
	// files are the credentials and configuration in the order they are written: the kubelet's kubeconfig
	// is written with the certificate the join service issued, so the kubelet starts with an identity
	// checked against the instance record instead of bootstrapping one of its own choosing.
	files []credentialFile
	// joinConfig is the path of the kubeadm join configuration among files, "" when the ticket's method
	// needs no kubeadm.
	joinConfig string
	// secrets, for a control-plane node, are what its own join service derives keys from.
	secrets *nodestate.ClusterSecrets
	// unlockPolicy is what the node may seal its disk key to; nil when the ticket has none.
	unlockPolicy []byte
}

// planJoin checks the whole ticket for the node self, whose state disk is diskUUID and whose CSR carried
// kubeletKey, and renders what it leaves on the node. Its errors name the field that failed and never carry
// secret material.
func planJoin(cfg *Config, self *metadata.Self, t *berthv1.JoinTicket, kubeletKey *ecdsa.PrivateKey, diskUUID string) (*joinPlan, error) {
	inst := self.Instance
	caCert, cert, err := checkTicket(inst, t, kubeletKey)
	if err != nil {
		return nil, err
	}
	if err := checkDiskKey(t.DiskKey); err != nil {
		return nil, err
	}
	files, joinConfig, err := credentialFiles(cfg, self, t, caCert, cert, kubeletKey)
	if err != nil {
		return nil, err
	}
	plan := &joinPlan{diskKey: t.DiskKey, files: files, joinConfig: joinConfig}
	if t.ClusterSecrets != nil {
		if plan.secrets, err = checkClusterSecrets(self, t, diskUUID); err != nil {
			return nil, fmt.Errorf("ticket's cluster secrets: %w", err)
		}
	}
	if len(t.UnlockPolicy) > 0 {
		if err := checkUnlockPolicy(t.UnlockPolicy, inst.Role); err != nil {
			return nil, fmt.Errorf("ticket's unlock policy: %w", err)
		}
		plan.unlockPolicy = t.UnlockPolicy
	}
	return plan, nil
}

// checkClusterSecrets checks the secrets a control-plane node's own join service will derive every key from
// and sign with: the master secret and salt must derive the very disk key the ticket carries for this disk
// (so they are the cluster's, not any secret), and the join CA must be the one this node pins in its
// user-data (so the node's join service presents the certificate every node checks).
func checkClusterSecrets(self *metadata.Self, t *berthv1.JoinTicket, diskUUID string) (*nodestate.ClusterSecrets, error) {
	s := t.ClusterSecrets
	label, err := keys.DiskLabel(diskUUID)
	if err != nil {
		return nil, err
	}
	derived, err := keys.Derive(s.MasterSecret, s.Salt, label, keys.DiskKeySize)
	if err != nil {
		return nil, err
	}
	if subtle.ConstantTimeCompare(derived, t.DiskKey) != 1 {
		return nil, errors.New("the master secret and salt do not derive the ticket's disk key")
	}
	joinCA, err := pki.ParseCA(s.JoinCaCertificate, s.JoinCaKey)
	if err != nil {
		return nil, fmt.Errorf("join CA: %w", err)
	}
	if !pki.PinMatches(self.UserData.JoinCAPin, joinCA.Cert) {
		return nil, fmt.Errorf("join CA %q is not the one this node's user-data pins", joinCA.Cert.Subject.CommonName)
	}
	return &nodestate.ClusterSecrets{
		MasterSecret: s.MasterSecret, Salt: s.Salt, JoinCACert: s.JoinCaCertificate, JoinCAKey: s.JoinCaKey,
		APIServerEndpoint: t.ApiServerEndpoint, KubernetesVersion: t.KubernetesVersion,
	}, nil
}

// checkRejoinTicket checks a rejoin ticket before the node uses it: a disk key of the size join services
// derive, and an unlock policy the node could seal to.
func checkRejoinTicket(t *berthv1.RejoinTicket, role metadata.Role) error {
	if err := checkDiskKey(t.DiskKey); err != nil {
		return err
	}
	if len(t.UnlockPolicy) > 0 {
		if err := checkUnlockPolicy(t.UnlockPolicy, role); err != nil {
			return fmt.Errorf("ticket's unlock policy: %w", err)
		}
	}
	return nil
}

// checkDiskKey checks a ticket's disk key is of the size every join service derives.
func checkDiskKey(key []byte) error {
	if n := len(key); n != keys.DiskKeySize {
		return fmt.Errorf("ticket's disk key is %d bytes, want %d", n, keys.DiskKeySize)
	}
	return nil
}

// checkUnlockPolicy checks a ticket's unlock policy as the node will read it when it seals its disk key:
// a policy that parses, each of whose images admits the node's role (the join service sends the part of
// its policy for that role).
func checkUnlockPolicy(data []byte, role metadata.Role) error {
	p, err := policy.Parse(data)
	if err != nil {
		return err
	}
	for _, img := range p.Images {
		if !slices.Contains(img.Roles, role) {
			return fmt.Errorf("image %q is not for a %s node", img.Name, role)
		}
	}
	return nil
}

// write leaves the plan's files on the node: the credentials and configuration, then the cluster secrets
// and the unlock policy.
func (p *joinPlan) write(cfg *Config) error {
	for _, f := range p.files {
		if err := nodestate.WriteFile(f.path, f.data, f.mode); err != nil {
			return fmt.Errorf("writing credentials: %w", err)
		}
	}
	if p.secrets != nil {
		if err := nodestate.WriteSecrets(cfg.Paths.State, p.secrets); err != nil {
			return fmt.Errorf("writing cluster secrets: %w", err)
		}
	}
	if p.unlockPolicy != nil {
		if err := nodestate.WriteFile(filepath.Join(cfg.Paths.State, UnlockPolicyFile), p.unlockPolicy, 0o600); err != nil {
			return fmt.Errorf("writing the unlock policy: %w", err)
		}
	}
	return nil
}

// checkTicket checks what the node will trust in a ticket: that it is for this node (its name; control-plane
// material only for a control-plane node, since a worker must never hold the CA keys or the cluster's
// secrets, whatever a service sends it), an API server endpoint that is host:port, a kubelet certificate
// that the ticket's CA signed for this node's own key, control-plane files that stay in the certificates
// directory, and an instance record with an address to join from. It returns the parsed CA and kubelet
// certificates.
func checkTicket(inst metadata.Instance, t *berthv1.JoinTicket, kubeletKey *ecdsa.PrivateKey) (caCert, cert *x509.Certificate, err error) {
	if t.NodeName != inst.Name {
		return nil, nil, fmt.Errorf("the ticket is for node %q, this node is %q", t.NodeName, inst.Name)
	}
	if inst.Role != metadata.RoleControlPlane && (len(t.ControlPlaneFiles) > 0 || t.ClusterSecrets != nil) {
		return nil, nil, fmt.Errorf("the ticket carries control-plane material (%d files, cluster secrets: %v) for a %s node: refusing it",
			len(t.ControlPlaneFiles), t.ClusterSecrets != nil, inst.Role)
	}
	if err := kubeadm.ValidateEndpoint(t.ApiServerEndpoint); err != nil {
		return nil, nil, fmt.Errorf("ticket's API server endpoint: %w", err)
	}
	if caCert, err = x509.ParseCertificate(t.KubernetesCaCertificate); err != nil {
		return nil, nil, fmt.Errorf("ticket's Kubernetes CA: %w", err)
	}
	if cert, err = x509.ParseCertificate(t.KubeletCertificate); err != nil {
		return nil, nil, fmt.Errorf("ticket's kubelet certificate: %w", err)
	}
	if err := cert.CheckSignatureFrom(caCert); err != nil {
		return nil, nil, fmt.Errorf("ticket's kubelet certificate is not signed by its Kubernetes CA: %w", err)
	}
	if !kubeletKey.PublicKey.Equal(cert.PublicKey) {
		return nil, nil, errors.New("ticket's kubelet certificate is not for the key this node sent in its CSR")
	}
	for _, f := range t.ControlPlaneFiles {
		if !filepath.IsLocal(f.Path) {
			return nil, nil, fmt.Errorf("control-plane file path %q leaves the certificates directory", f.Path)
		}
	}
	if len(inst.Addresses) == 0 {
		return nil, nil, errors.New("instance record has no address")
	}
	return caCert, cert, nil
}

// kubeletKubeconfig is the kubelet's kubeconfig: the API server of the ticket, trusted through caCert, and
// the client certificate and key in the one file at certPath, where the kubelet rotates them.
func kubeletKubeconfig(apiServerEndpoint string, caCert *x509.Certificate, certPath string) ([]byte, error) {
	kubeconfig := clientcmdapi.NewConfig()
	kubeconfig.Clusters["default-cluster"] = &clientcmdapi.Cluster{
		Server: "https://" + apiServerEndpoint, CertificateAuthorityData: pki.EncodeCertPEM(caCert),
	}
	kubeconfig.AuthInfos["default-auth"] = &clientcmdapi.AuthInfo{ClientCertificate: certPath, ClientKey: certPath}
	kubeconfig.Contexts["default-context"] = &clientcmdapi.Context{Cluster: "default-cluster", AuthInfo: "default-auth"}
	kubeconfig.CurrentContext = "default-context"
	return clientcmd.Write(*kubeconfig)
}

// credentialFile is one file a ticket leaves on the node.
type credentialFile struct {
	path string
	data []byte
	mode os.FileMode
}

// credentialFiles renders every file a checked ticket leaves on the node, in the order they are written,
// and the path of the kubeadm join configuration among them ("" for the kubelet method).
func credentialFiles(cfg *Config, self *metadata.Self, t *berthv1.JoinTicket, caCert, cert *x509.Certificate, kubeletKey *ecdsa.PrivateKey) ([]credentialFile, string, error) {
	inst, p := self.Instance, cfg.Paths
	cloud := cfg.KubeadmJoin.Cloud
	cloud.ProviderID = self.ProviderID
	keyPEM, err := pki.EncodeKeyPEM(kubeletKey)
	if err != nil {
		return nil, "", err
	}
	certPath := KubeletCertPath(p)
	kubeconfigData, err := kubeletKubeconfig(t.ApiServerEndpoint, caCert, certPath)
	if err != nil {
		return nil, "", err
	}
	files := make([]credentialFile, 0, len(t.ControlPlaneFiles)+5)
	for _, f := range t.ControlPlaneFiles {
		files = append(files, credentialFile{filepath.Join(p.PKIDir(), f.Path), f.Content, os.FileMode(f.Mode & 0o644)})
	}
	files = append(files,
		credentialFile{certPath, append(pki.EncodeCertPEM(cert), keyPEM...), 0o600},
		credentialFile{filepath.Join(p.KubernetesDir, "kubelet.conf"), kubeconfigData, 0o600},
	)
	joinConfigPath := ""
	switch t.JoinMethod {
	case berthv1.JoinMethod_JOIN_METHOD_KUBEADM:
		params := cfg.KubeadmJoin
		params.NodeName, params.NodeIP, params.Cloud = t.NodeName, inst.Addresses[0], cloud
		params.APIServerEndpoint, params.Token, params.CACertHashes = t.ApiServerEndpoint, t.BootstrapToken, t.DiscoveryCaCertHashes
		if inst.Role == metadata.RoleControlPlane {
			params.ControlPlane = &kubeadm.ControlPlaneJoin{AdvertiseAddress: inst.Addresses[0], BindPort: apiServerPort}
		}
		joinConfig, err := kubeadm.JoinConfig(params)
		if err != nil {
			return nil, "", err
		}
		joinConfigPath = filepath.Join(p.State, "kubeadm-join.yaml")
		// pki/ca.crt is not written for workers: kubeadm join writes it from discovery and refuses to find
		// one. The configuration holds the bootstrap token: it stays on the encrypted state disk, readable
		// by root only.
		files = append(files, credentialFile{joinConfigPath, joinConfig, 0o600})
	case berthv1.JoinMethod_JOIN_METHOD_KUBELET:
		caPath := filepath.Join(p.PKIDir(), "ca.crt")
		settings := t.KubeletSettings
		if settings == nil {
			settings = &berthv1.KubeletSettings{}
		}
		config, flags, err := kubeadm.KubeletFiles(kubeadm.KubeletParams{
			NodeName: t.NodeName, NodeIP: inst.Addresses[0], ClientCAFile: caPath,
			ClusterDNS: settings.ClusterDns, ClusterDomain: settings.ClusterDomain,
			CRISocket: cfg.KubeadmJoin.CRISocket, Kubelet: cfg.Kubelet, Cloud: cloud,
		})
		if err != nil {
			return nil, "", fmt.Errorf("kubelet configuration: %w", err)
		}
		// The kubelet starts once its configuration and flags exist (kubelet.Supervisor, or systemd's
		// drop-in), so they come last, after the credentials they name.
		files = append(files,
			credentialFile{caPath, pki.EncodeCertPEM(caCert), 0o644},
			credentialFile{filepath.Join(p.KubeletDir, "config.yaml"), config, 0o644},
			credentialFile{filepath.Join(p.KubeletDir, "kubeadm-flags.env"), flags, 0o644},
		)
	default:
		return nil, "", fmt.Errorf("ticket's join method %v is not one this agent knows", t.JoinMethod)
	}
	return files, joinConfigPath, nil
}
