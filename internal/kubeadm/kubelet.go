package kubeadm

import (
	"cmp"
	"fmt"
	"net/netip"
	"path/filepath"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	kubeletv1beta1 "k8s.io/kubelet/config/v1beta1"
	"sigs.k8s.io/yaml"
)

// KubeletParams describe a node that joins an external control plane without kubeadm: its kubelet gets the
// same two files kubeadm join's kubelet-start phase would write, so that it starts the same way.
type KubeletParams struct {
	NodeName string
	NodeIP   netip.Addr
	// ClientCAFile is the cluster CA's certificate: the kubelet accepts the API server's client certificate
	// (logs, exec) by it.
	ClientCAFile string
	// ClusterDNS and ClusterDomain are the cluster's; empty leaves pods without cluster DNS.
	ClusterDNS    []string
	ClusterDomain string
	// CRISocket defaults to DefaultCRISocket.
	CRISocket string
	Kubelet   KubeletSettings
	Cloud     Cloud
}

// KubeletFiles renders the kubelet's configuration (config.yaml) and kubeadm-flags.env for p.
//
// The kubelet authenticates callers by client certificate or token review and asks the API server to
// authorize them, as kubeadm configures it; anonymous requests are refused. Client-certificate rotation
// stays off: it needs a CSR signer in the cluster, and an external control plane whose CA key lives in a
// remote signer has none, so the kubelet keeps the certificate its join ticket carried.
func KubeletFiles(p KubeletParams) (config, flagsEnv []byte, err error) {
	if err := validateNodeName(p.NodeName); err != nil {
		return nil, nil, err
	}
	ip, err := nodeAddress("node IP", p.NodeIP, allowLoopback)
	if err != nil {
		return nil, nil, err
	}
	if !filepath.IsAbs(p.ClientCAFile) {
		return nil, nil, fmt.Errorf("kubelet client CA file %q is not an absolute path", p.ClientCAFile)
	}
	for _, s := range p.ClusterDNS {
		if _, err := netip.ParseAddr(s); err != nil {
			return nil, nil, fmt.Errorf("cluster DNS %q is not an IP address", s)
		}
	}
	if p.ClusterDomain != "" {
		if errs := validation.IsDNS1123Subdomain(p.ClusterDomain); len(errs) > 0 {
			return nil, nil, fmt.Errorf("cluster domain %q is not a DNS-1123 subdomain: %s", p.ClusterDomain, strings.Join(errs, "; "))
		}
	}
	socket := cmp.Or(p.CRISocket, DefaultCRISocket)
	if path, ok := strings.CutPrefix(socket, "unix://"); !ok || !filepath.IsAbs(path) {
		return nil, nil, fmt.Errorf("CRI socket %q is not a unix:///absolute/path URL", socket)
	}
	if d := p.Kubelet.CgroupDriver; d != "" && d != "systemd" && d != "cgroupfs" {
		return nil, nil, fmt.Errorf("kubelet cgroup driver %q: want systemd or cgroupfs", d)
	}

	off, on := false, true
	cfg := kubeletv1beta1.KubeletConfiguration{
		TypeMeta: metav1.TypeMeta{APIVersion: kubeletv1beta1.SchemeGroupVersion.String(), Kind: "KubeletConfiguration"},
		Authentication: kubeletv1beta1.KubeletAuthentication{
			X509:      kubeletv1beta1.KubeletX509Authentication{ClientCAFile: p.ClientCAFile},
			Webhook:   kubeletv1beta1.KubeletWebhookAuthentication{Enabled: &on},
			Anonymous: kubeletv1beta1.KubeletAnonymousAuthentication{Enabled: &off},
		},
		Authorization:            kubeletv1beta1.KubeletAuthorization{Mode: kubeletv1beta1.KubeletAuthorizationModeWebhook},
		ClusterDNS:               p.ClusterDNS,
		ClusterDomain:            p.ClusterDomain,
		CgroupDriver:             cmp.Or(p.Kubelet.CgroupDriver, "systemd"),
		ContainerRuntimeEndpoint: socket,
	}
	if p.Kubelet.AllowCgroupV1 {
		cfg.FailCgroupV1 = &off
	}
	doc, err := setFields(cfg, kubeletv1beta1.KubeletConfiguration{TypeMeta: cfg.TypeMeta})
	if err != nil {
		return nil, nil, err
	}
	if config, err = yaml.Marshal(doc); err != nil {
		return nil, nil, fmt.Errorf("encoding kubelet configuration: %w", err)
	}
	cloudArgs, err := p.Cloud.args()
	if err != nil {
		return nil, nil, err
	}
	// The values are a checked DNS name, an IP address and checked cloud flags: none has a space or a
	// quote, so systemd's and the supervisor's splitting on spaces gives back exactly these flags.
	flags := []string{"--hostname-override=" + p.NodeName, "--node-ip=" + ip.String()}
	for _, a := range cloudArgs {
		flags = append(flags, "--"+a.Name+"="+a.Value)
	}
	flagsEnv = fmt.Appendf(nil, "KUBELET_KUBEADM_ARGS=\"%s\"\n", strings.Join(flags, " "))
	return config, flagsEnv, nil
}
