package kubeadm

import (
	"net/netip"
	"reflect"
	"strings"
	"testing"

	kubeletv1beta1 "k8s.io/kubelet/config/v1beta1"
	"sigs.k8s.io/yaml"
)

func validKubeletParams() KubeletParams {
	return KubeletParams{
		NodeName: "metal-7", NodeIP: netip.MustParseAddr("10.0.0.7"), ClientCAFile: "/etc/kubernetes/pki/ca.crt",
		ClusterDNS: []string{"10.96.0.10"}, ClusterDomain: "cluster.local",
		Kubelet: KubeletSettings{CgroupDriver: "cgroupfs", AllowCgroupV1: true},
	}
}

func TestKubeletFiles(t *testing.T) {
	config, flags, err := KubeletFiles(validKubeletParams())
	if err != nil {
		t.Fatal(err)
	}
	var got kubeletv1beta1.KubeletConfiguration
	if err := yaml.UnmarshalStrict(config, &got); err != nil {
		t.Fatalf("config.yaml does not parse as a KubeletConfiguration: %v\n%s", err, config)
	}
	if got.Kind != "KubeletConfiguration" || got.APIVersion != "kubelet.config.k8s.io/v1beta1" {
		t.Errorf("kind %q, apiVersion %q", got.Kind, got.APIVersion)
	}
	if got.Authentication.Anonymous.Enabled == nil || *got.Authentication.Anonymous.Enabled {
		t.Error("anonymous requests to the kubelet are not refused")
	}
	if got.Authentication.Webhook.Enabled == nil || !*got.Authentication.Webhook.Enabled || got.Authorization.Mode != "Webhook" {
		t.Errorf("authentication webhook %v, authorization %q: want the API server to decide", got.Authentication.Webhook.Enabled, got.Authorization.Mode)
	}
	if got.Authentication.X509.ClientCAFile != "/etc/kubernetes/pki/ca.crt" {
		t.Errorf("client CA file %q", got.Authentication.X509.ClientCAFile)
	}
	if !reflect.DeepEqual(got.ClusterDNS, []string{"10.96.0.10"}) || got.ClusterDomain != "cluster.local" {
		t.Errorf("cluster DNS %v, domain %q", got.ClusterDNS, got.ClusterDomain)
	}
	if got.CgroupDriver != "cgroupfs" || got.FailCgroupV1 == nil || *got.FailCgroupV1 {
		t.Errorf("cgroup driver %q, failCgroupV1 %v", got.CgroupDriver, got.FailCgroupV1)
	}
	if got.ContainerRuntimeEndpoint != DefaultCRISocket {
		t.Errorf("container runtime endpoint %q, want %q", got.ContainerRuntimeEndpoint, DefaultCRISocket)
	}
	if got.RotateCertificates {
		t.Error("certificate rotation is on, with no CSR signer to serve it")
	}
	if strings.Contains(string(config), "syncFrequency") {
		t.Errorf("config.yaml spells out unset fields:\n%s", config)
	}
	if want := "KUBELET_KUBEADM_ARGS=\"--hostname-override=metal-7 --node-ip=10.0.0.7\"\n"; string(flags) != want {
		t.Errorf("kubeadm-flags.env = %q, want %q", flags, want)
	}
}

func TestKubeletFilesCloud(t *testing.T) {
	p := validKubeletParams()
	p.Cloud = Cloud{External: true, ProviderID: "aws:///us-east-1a/i-0123456789abcdef0"}
	_, flags, err := KubeletFiles(p)
	if err != nil {
		t.Fatal(err)
	}
	want := "KUBELET_KUBEADM_ARGS=\"--hostname-override=metal-7 --node-ip=10.0.0.7 --cloud-provider=external --provider-id=aws:///us-east-1a/i-0123456789abcdef0\"\n"
	if string(flags) != want {
		t.Errorf("kubeadm-flags.env = %q, want %q", flags, want)
	}
}

func TestKubeletFilesRefusesBadInput(t *testing.T) {
	tests := []struct {
		name    string
		mutate  func(*KubeletParams)
		wantErr string
	}{
		{"no node name", func(p *KubeletParams) { p.NodeName = "" }, "node name is required"},
		{"flag in the node name", func(p *KubeletParams) { p.NodeName = "a --anonymous-auth=true" }, "not a DNS-1123 subdomain"},
		{"no node IP", func(p *KubeletParams) { p.NodeIP = netip.Addr{} }, "node IP is required"},
		{"relative CA file", func(p *KubeletParams) { p.ClientCAFile = "ca.crt" }, "not an absolute path"},
		{"DNS not an IP", func(p *KubeletParams) { p.ClusterDNS = []string{"dns.local"} }, `cluster DNS "dns.local"`},
		{"bad domain", func(p *KubeletParams) { p.ClusterDomain = "Cluster Local" }, "cluster domain"},
		{"tcp CRI socket", func(p *KubeletParams) { p.CRISocket = "tcp://10.0.0.1:1" }, "CRI socket"},
		{"cgroup driver", func(p *KubeletParams) { p.Kubelet.CgroupDriver = "openrc" }, "cgroup driver"},
		{"flag in the provider ID", func(p *KubeletParams) { p.Cloud.ProviderID = "aws:///z/i-0\" --anonymous-auth=true" }, "provider ID"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := validKubeletParams()
			tt.mutate(&p)
			_, _, err := KubeletFiles(p)
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("error %v, want one containing %q", err, tt.wantErr)
			}
		})
	}
}
