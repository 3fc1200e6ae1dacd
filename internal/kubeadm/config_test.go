package kubeadm

import (
	"bytes"
	"net/netip"
	"reflect"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	kubeproxyv1alpha1 "k8s.io/kube-proxy/config/v1alpha1"
	kubeletv1beta1 "k8s.io/kubelet/config/v1beta1"
	bootstraptokenv1 "k8s.io/kubernetes/cmd/kubeadm/app/apis/bootstraptoken/v1"
	kubeadmapi "k8s.io/kubernetes/cmd/kubeadm/app/apis/kubeadm"
	kubeadmscheme "k8s.io/kubernetes/cmd/kubeadm/app/apis/kubeadm/scheme"
	"k8s.io/kubernetes/cmd/kubeadm/app/apis/kubeadm/v1beta4"
	kubeadmutil "k8s.io/kubernetes/cmd/kubeadm/app/util"
	"k8s.io/kubernetes/cmd/kubeadm/app/util/config/strict"
	"sigs.k8s.io/yaml"
)

const (
	testToken = "7q4mzk.q8r2m4x7k1z9w3p6"
	testHash  = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	testHash2 = "sha256:fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210"
)

// documents splits a rendered file with kubeadm's own splitter and checks
// each document with kubeadm's strict decoder (unknown or duplicate fields
// fail), returning the documents by kind.
func documents(t *testing.T, b []byte) map[string][]byte {
	t.Helper()
	gvkmap, err := kubeadmutil.SplitConfigDocuments(b)
	if err != nil {
		t.Fatalf("kubeadm cannot split the configuration: %v\n%s", err, b)
	}
	docs := map[string][]byte{}
	for gvk, doc := range gvkmap {
		if gvk.GroupVersion() != v1beta4.SchemeGroupVersion {
			t.Errorf("document %s has group version %s, want %s", gvk.Kind, gvk.GroupVersion(), v1beta4.SchemeGroupVersion)
		}
		if err := strict.VerifyUnmarshalStrict([]*runtime.Scheme{kubeadmscheme.Scheme}, gvk, doc); err != nil {
			t.Errorf("kubeadm's strict decoder rejects %s: %v", gvk.Kind, err)
		}
		docs[gvk.Kind] = doc
	}
	return docs
}

// decodeStrict decodes a document into the v1beta4 type without defaulting,
// so that the comparison sees exactly what was written.
func decodeStrict(t *testing.T, doc []byte, into any) {
	t.Helper()
	if err := yaml.UnmarshalStrict(doc, into); err != nil {
		t.Fatalf("decoding %T: %v\n%s", into, err, doc)
	}
}

// decodeInternal runs a document through kubeadm's scheme: version check,
// defaulting and conversion to the internal type, as `kubeadm --config` does.
func decodeInternal(t *testing.T, doc []byte, into runtime.Object) {
	t.Helper()
	if err := runtime.DecodeInto(kubeadmscheme.Codecs.UniversalDecoder(), doc, into); err != nil {
		t.Fatalf("kubeadm's decoder rejects %T: %v\n%s", into, err, doc)
	}
}

func assertEqual(t *testing.T, what string, got, want any) {
	t.Helper()
	if !reflect.DeepEqual(got, want) {
		g, _ := yaml.Marshal(got)
		w, _ := yaml.Marshal(want)
		t.Errorf("%s differs\ngot:\n%s\nwant:\n%s", what, g, w)
	}
}

func fullInitParams() InitParams {
	return InitParams{
		NodeName:             "cp-0.example.internal",
		AdvertiseAddress:     netip.MustParseAddr("10.0.0.10"),
		BindPort:             8443,
		ControlPlaneEndpoint: "api.example.internal:6443",
		KubernetesVersion:    "v1.36.3",
		ClusterName:          "berth-test",
		PodSubnet:            "10.32.0.0/16,fd00:10:32::/56",
		ServiceSubnet:        "10.112.0.0/16",
		CertificatesDir:      "/var/lib/berth/pki",
		ImageRepository:      "registry.example.internal:5000/k8s",
		CRISocket:            "unix:///var/run/crio/crio.sock",
		SkipPhases:           []string{"addon/kube-proxy", "show-join-command"},
		KubeletExtraArgs:     map[string]string{"node-labels": "berth.dev/role=control-plane", "cgroup-driver": "cgroupfs", "v": "2"},
	}
}

func TestInitConfigFull(t *testing.T) {
	p := fullInitParams()
	b, err := InitConfig(p)
	if err != nil {
		t.Fatalf("InitConfig: %v", err)
	}
	docs := documents(t, b)
	if len(docs) != 2 {
		t.Fatalf("got %d documents, want InitConfiguration and ClusterConfiguration:\n%s", len(docs), b)
	}

	var initCfg v1beta4.InitConfiguration
	decodeStrict(t, docs["InitConfiguration"], &initCfg)
	assertEqual(t, "InitConfiguration", initCfg, v1beta4.InitConfiguration{
		TypeMeta: metav1.TypeMeta{APIVersion: "kubeadm.k8s.io/v1beta4", Kind: "InitConfiguration"},
		BootstrapTokens: []bootstraptokenv1.BootstrapToken{{
			Description: "made by kubeadm init; Berth issues join tokens itself",
			TTL:         &metav1.Duration{Duration: time.Minute},
		}},
		NodeRegistration: v1beta4.NodeRegistrationOptions{
			Name:      "cp-0.example.internal",
			CRISocket: "unix:///var/run/crio/crio.sock",
			KubeletExtraArgs: []v1beta4.Arg{
				{Name: "cgroup-driver", Value: "cgroupfs"},
				{Name: "node-ip", Value: "10.0.0.10"},
				{Name: "node-labels", Value: "berth.dev/role=control-plane"},
				{Name: "v", Value: "2"},
			},
		},
		LocalAPIEndpoint: v1beta4.APIEndpoint{AdvertiseAddress: "10.0.0.10", BindPort: 8443},
		SkipPhases:       []string{"addon/kube-proxy", "show-join-command"},
	})

	var clusterCfg v1beta4.ClusterConfiguration
	decodeStrict(t, docs["ClusterConfiguration"], &clusterCfg)
	assertEqual(t, "ClusterConfiguration", clusterCfg, v1beta4.ClusterConfiguration{
		TypeMeta:             metav1.TypeMeta{APIVersion: "kubeadm.k8s.io/v1beta4", Kind: "ClusterConfiguration"},
		Networking:           v1beta4.Networking{PodSubnet: "10.32.0.0/16,fd00:10:32::/56", ServiceSubnet: "10.112.0.0/16"},
		KubernetesVersion:    "v1.36.3",
		ControlPlaneEndpoint: "api.example.internal:6443",
		CertificatesDir:      "/var/lib/berth/pki",
		ImageRepository:      "registry.example.internal:5000/k8s",
		ClusterName:          "berth-test",
	})

	// kubeadm's view after its own defaulting: our values survive and the
	// only bootstrap token kubeadm will create is the short-lived one.
	var internalInit kubeadmapi.InitConfiguration
	decodeInternal(t, docs["InitConfiguration"], &internalInit)
	if n := len(internalInit.BootstrapTokens); n != 1 {
		t.Fatalf("kubeadm sees %d bootstrap tokens, want 1", n)
	}
	if ttl := internalInit.BootstrapTokens[0].TTL.Duration; ttl != time.Minute {
		t.Errorf("kubeadm init token TTL = %v, want 1m (kubeadm's default is 24h)", ttl)
	}
	if got := internalInit.NodeRegistration.Name; got != p.NodeName {
		t.Errorf("internal node name = %q, want %q", got, p.NodeName)
	}
	if got := internalInit.LocalAPIEndpoint; got != (kubeadmapi.APIEndpoint{AdvertiseAddress: "10.0.0.10", BindPort: 8443}) {
		t.Errorf("internal local API endpoint = %+v", got)
	}
	if got := internalInit.NodeRegistration.ImagePullPolicy; got != corev1.PullIfNotPresent {
		t.Errorf("internal image pull policy = %q: kubeadm's defaults were not applied", got)
	}

	var internalCluster kubeadmapi.ClusterConfiguration
	decodeInternal(t, docs["ClusterConfiguration"], &internalCluster)
	if internalCluster.Networking.PodSubnet != p.PodSubnet || internalCluster.Networking.ServiceSubnet != p.ServiceSubnet {
		t.Errorf("internal networking = %+v", internalCluster.Networking)
	}
	if internalCluster.Networking.DNSDomain != "cluster.local" {
		t.Errorf("internal DNS domain = %q: kubeadm's defaults were not applied", internalCluster.Networking.DNSDomain)
	}
	if internalCluster.Etcd.Local == nil || internalCluster.Etcd.Local.DataDir != "/var/lib/etcd" {
		t.Errorf("internal etcd = %+v, want kubeadm's default local etcd", internalCluster.Etcd)
	}
	if internalCluster.ImageRepository != p.ImageRepository || internalCluster.ClusterName != p.ClusterName ||
		internalCluster.CertificatesDir != p.CertificatesDir || internalCluster.KubernetesVersion != p.KubernetesVersion {
		t.Errorf("internal cluster configuration lost a value: %+v", internalCluster)
	}
}

func TestInitConfigDefaults(t *testing.T) {
	b, err := InitConfig(InitParams{
		NodeName:          "cp-0",
		AdvertiseAddress:  netip.MustParseAddr("192.0.2.7"),
		KubernetesVersion: "v1.36.3",
	})
	if err != nil {
		t.Fatalf("InitConfig: %v", err)
	}
	docs := documents(t, b)

	var initCfg v1beta4.InitConfiguration
	decodeStrict(t, docs["InitConfiguration"], &initCfg)
	assertEqual(t, "LocalAPIEndpoint", initCfg.LocalAPIEndpoint, v1beta4.APIEndpoint{AdvertiseAddress: "192.0.2.7", BindPort: 6443})
	assertEqual(t, "NodeRegistration", initCfg.NodeRegistration, v1beta4.NodeRegistrationOptions{
		Name:             "cp-0",
		CRISocket:        "unix:///run/containerd/containerd.sock",
		KubeletExtraArgs: []v1beta4.Arg{{Name: "node-ip", Value: "192.0.2.7"}},
	})
	if initCfg.SkipPhases != nil {
		t.Errorf("SkipPhases = %q, want none", initCfg.SkipPhases)
	}

	var clusterCfg v1beta4.ClusterConfiguration
	decodeStrict(t, docs["ClusterConfiguration"], &clusterCfg)
	assertEqual(t, "ClusterConfiguration", clusterCfg, v1beta4.ClusterConfiguration{
		TypeMeta:          metav1.TypeMeta{APIVersion: "kubeadm.k8s.io/v1beta4", Kind: "ClusterConfiguration"},
		Networking:        v1beta4.Networking{PodSubnet: "10.244.0.0/16", ServiceSubnet: "10.96.0.0/12"},
		KubernetesVersion: "v1.36.3",
		CertificatesDir:   "/etc/kubernetes/pki",
	})

	// Left empty here, kubeadm fills in its own defaults.
	var internalCluster kubeadmapi.ClusterConfiguration
	decodeInternal(t, docs["ClusterConfiguration"], &internalCluster)
	if internalCluster.ClusterName != "kubernetes" || internalCluster.ImageRepository != "registry.k8s.io" {
		t.Errorf("kubeadm defaults: cluster name %q, image repository %q", internalCluster.ClusterName, internalCluster.ImageRepository)
	}
}

func TestInitConfigStable(t *testing.T) {
	p := fullInitParams()
	for i := range 20 {
		p.KubeletExtraArgs[string(rune('a'+i))+"-flag"] = "x"
	}
	first, err := InitConfig(p)
	if err != nil {
		t.Fatalf("InitConfig: %v", err)
	}
	for range 5 {
		again, err := InitConfig(p)
		if err != nil {
			t.Fatalf("InitConfig: %v", err)
		}
		if !bytes.Equal(first, again) {
			t.Fatalf("output differs between calls:\n%s\n---- vs ----\n%s", first, again)
		}
	}
	// The rendered order is the sorted order, not just a stable one.
	last := -1
	for _, name := range []string{"a-flag", "b-flag", "cgroup-driver", "node-ip", "node-labels", "t-flag", "v"} {
		i := bytes.Index(first, []byte("name: "+name+"\n"))
		if i <= last {
			t.Fatalf("kubelet arg %q is not after the previous one in:\n%s", name, first)
		}
		last = i
	}
}

func TestInitConfigIPv6(t *testing.T) {
	p := fullInitParams()
	p.AdvertiseAddress = netip.MustParseAddr("2001:db8::10")
	p.ControlPlaneEndpoint = "[2001:db8::1]:6443"
	b, err := InitConfig(p)
	if err != nil {
		t.Fatalf("InitConfig: %v", err)
	}
	var initCfg v1beta4.InitConfiguration
	decodeStrict(t, documents(t, b)["InitConfiguration"], &initCfg)
	if got := initCfg.LocalAPIEndpoint.AdvertiseAddress; got != "2001:db8::10" {
		t.Errorf("advertise address = %q", got)
	}
	if got := initCfg.NodeRegistration.KubeletExtraArgs[1]; got != (v1beta4.Arg{Name: "node-ip", Value: "2001:db8::10"}) {
		t.Errorf("node-ip arg = %+v", got)
	}
}

func TestInitConfigRejects(t *testing.T) {
	tests := []struct {
		name    string
		mutate  func(*InitParams)
		wantErr string
	}{
		{"no node name", func(p *InitParams) { p.NodeName = "" }, "node name is required"},
		{"node name upper case", func(p *InitParams) { p.NodeName = "CP-0" }, "node name \"CP-0\" is not a DNS-1123 subdomain"},
		{"node name underscore", func(p *InitParams) { p.NodeName = "cp_0" }, "not a DNS-1123 subdomain"},
		{"no advertise address", func(p *InitParams) { p.AdvertiseAddress = netip.Addr{} }, "advertise address is required"},
		{"unspecified advertise address", func(p *InitParams) { p.AdvertiseAddress = netip.IPv4Unspecified() }, "0.0.0.0 is not a global unicast address"},
		{"link-local advertise address", func(p *InitParams) { p.AdvertiseAddress = netip.MustParseAddr("169.254.1.1") }, "not a global unicast address"},
		{"link-local advertise address", func(p *InitParams) { p.AdvertiseAddress = netip.MustParseAddr("fe80::1%eth0") }, "not a global unicast address"},
		{"negative port", func(p *InitParams) { p.BindPort = -1 }, "bind port -1 is out of range"},
		{"port too large", func(p *InitParams) { p.BindPort = 70000 }, "bind port 70000 is out of range"},
		{"endpoint without port", func(p *InitParams) { p.ControlPlaneEndpoint = "api.example.internal" }, "control-plane endpoint: \"api.example.internal\" is not host:port"},
		{"endpoint port zero", func(p *InitParams) { p.ControlPlaneEndpoint = "api.example.internal:0" }, "has no valid port"},
		{"endpoint bad host", func(p *InitParams) { p.ControlPlaneEndpoint = "api_example:6443" }, "neither an IP address nor a DNS name"},
		{"no version", func(p *InitParams) { p.KubernetesVersion = "" }, "kubernetes version is required"},
		{"version label", func(p *InitParams) { p.KubernetesVersion = "stable-1" }, "\"stable-1\" is not a semantic version"},
		{"cluster name", func(p *InitParams) { p.ClusterName = "Berth Test" }, "cluster name \"Berth Test\" is not a DNS-1123 label"},
		{"pod subnet", func(p *InitParams) { p.PodSubnet = "10.244.0.0" }, "pod subnet \"10.244.0.0\""},
		{"pod subnet host bits", func(p *InitParams) { p.PodSubnet = "10.244.1.0/16" }, "has host bits set, use 10.244.0.0/16"},
		{"service subnet same family", func(p *InitParams) { p.ServiceSubnet = "10.96.0.0/12,10.128.0.0/12" }, "needs one IPv4 and one IPv6 CIDR"},
		{"service subnet three", func(p *InitParams) { p.ServiceSubnet = "10.96.0.0/12,fd00::/108,10.128.0.0/12" }, "more than two CIDRs"},
		{"relative cert dir", func(p *InitParams) { p.CertificatesDir = "pki" }, "certificates dir \"pki\" must be a clean absolute path"},
		{"unclean cert dir", func(p *InitParams) { p.CertificatesDir = "/etc/../pki" }, "must be a clean absolute path"},
		{"image repository", func(p *InitParams) { p.ImageRepository = "https://registry.example/k8s" }, "image repository"},
		{"CRI socket scheme", func(p *InitParams) { p.CRISocket = "/run/containerd/containerd.sock" }, "CRI socket \"/run/containerd/containerd.sock\" is not a unix:///absolute/path URL"},
		{"CRI socket relative", func(p *InitParams) { p.CRISocket = "unix://containerd.sock" }, "is not a unix:///absolute/path URL"},
		{"node-ip in extra args", func(p *InitParams) { p.KubeletExtraArgs["node-ip"] = "10.0.0.11" }, "kubelet extra arg \"node-ip\" is set from the node address"},
		{"cloud-provider in extra args", func(p *InitParams) { p.KubeletExtraArgs["cloud-provider"] = "external" }, "kubelet extra arg \"cloud-provider\" is set from the node's cloud"},
		{"provider-id in extra args", func(p *InitParams) { p.KubeletExtraArgs["provider-id"] = "aws:///us-east-1a/i-0" }, "kubelet extra arg \"provider-id\" is set from the node's cloud"},
		{"provider ID with a space", func(p *InitParams) { p.Cloud.ProviderID = "aws:///us-east-1a/i-0 --anonymous-auth=true" }, "provider ID \"aws:///us-east-1a/i-0 --anonymous-auth=true\" is not <provider>://<path>"},
		{"provider ID with a quote", func(p *InitParams) { p.Cloud.ProviderID = `gce://p/z/"n` }, "without spaces, quotes or backslashes"},
		{"provider ID without scheme", func(p *InitParams) { p.Cloud.ProviderID = "i-0123456789abcdef0" }, "is not <provider>://<path>"},
		{"extra arg with dashes", func(p *InitParams) { p.KubeletExtraArgs["--v"] = "4" }, "kubelet extra arg name \"--v\""},
		{"extra arg empty name", func(p *InitParams) { p.KubeletExtraArgs[""] = "4" }, "kubelet extra arg name \"\""},
		{"extra arg value with space", func(p *InitParams) { p.KubeletExtraArgs["node-labels"] = "a=b --anonymous-auth=true" }, "\"node-labels\" has whitespace or control characters"},
		{"extra arg value with newline", func(p *InitParams) { p.KubeletExtraArgs["node-labels"] = "a=b\nX=y" }, "whitespace or control characters"},
		{"skip phase", func(p *InitParams) { p.SkipPhases = []string{"preflight", "--all"} }, "skip phase \"--all\""},
		{"empty skip phase", func(p *InitParams) { p.SkipPhases = []string{""} }, "skip phase \"\""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := fullInitParams()
			tt.mutate(&p)
			b, err := InitConfig(p)
			if err == nil {
				t.Fatalf("InitConfig accepted it:\n%s", b)
			}
			if !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("error %q does not contain %q", err, tt.wantErr)
			}
		})
	}
}

func workerParams() JoinParams {
	return JoinParams{
		NodeName:          "worker-1",
		NodeIP:            netip.MustParseAddr("10.0.1.21"),
		APIServerEndpoint: "10.0.0.10:6443",
		Token:             testToken,
		CACertHashes:      []string{testHash, testHash2},
		SkipPhases:        []string{"preflight"},
		KubeletExtraArgs:  map[string]string{"node-labels": "berth.dev/pool=a", "cgroup-driver": "cgroupfs"},
	}
}

func TestJoinConfigWorker(t *testing.T) {
	b, err := JoinConfig(workerParams())
	if err != nil {
		t.Fatalf("JoinConfig: %v", err)
	}
	docs := documents(t, b)
	if len(docs) != 1 {
		t.Fatalf("got %d documents, want only JoinConfiguration:\n%s", len(docs), b)
	}
	var cfg v1beta4.JoinConfiguration
	decodeStrict(t, docs["JoinConfiguration"], &cfg)
	assertEqual(t, "JoinConfiguration", cfg, v1beta4.JoinConfiguration{
		TypeMeta: metav1.TypeMeta{APIVersion: "kubeadm.k8s.io/v1beta4", Kind: "JoinConfiguration"},
		NodeRegistration: v1beta4.NodeRegistrationOptions{
			Name:      "worker-1",
			CRISocket: "unix:///run/containerd/containerd.sock",
			KubeletExtraArgs: []v1beta4.Arg{
				{Name: "cgroup-driver", Value: "cgroupfs"},
				{Name: "node-ip", Value: "10.0.1.21"},
				{Name: "node-labels", Value: "berth.dev/pool=a"},
			},
			IgnorePreflightErrors: []string{"FileAvailable--etc-kubernetes-kubelet.conf"},
		},
		Discovery: v1beta4.Discovery{BootstrapToken: &v1beta4.BootstrapTokenDiscovery{
			Token:             testToken,
			APIServerEndpoint: "10.0.0.10:6443",
			CACertHashes:      []string{testHash, testHash2},
		}},
		SkipPhases: []string{"preflight"},
	})

	var internal kubeadmapi.JoinConfiguration
	decodeInternal(t, docs["JoinConfiguration"], &internal)
	if internal.ControlPlane != nil {
		t.Errorf("worker has control-plane settings: %+v", internal.ControlPlane)
	}
	if internal.NodeRegistration.Taints != nil {
		t.Errorf("worker gets taints %v, want none", internal.NodeRegistration.Taints)
	}
	bt := internal.Discovery.BootstrapToken
	if bt == nil || bt.Token != testToken || bt.UnsafeSkipCAVerification || len(bt.CACertHashes) != 2 {
		t.Fatalf("internal bootstrap token discovery = %+v", bt)
	}
	if internal.Discovery.TLSBootstrapToken != testToken {
		t.Error("kubeadm does not default the TLS bootstrap token to the discovery token")
	}
}

// TestJoinConfigCloud: a node of a cloud with a controller manager tells its kubelet to wait for it and which
// instance it is; the flags come from Cloud, sorted among the others.
func TestJoinConfigCloud(t *testing.T) {
	p := workerParams()
	p.Cloud = Cloud{External: true, ProviderID: "aws:///eu-west-1b/i-0123456789abcdef0"}
	b, err := JoinConfig(p)
	if err != nil {
		t.Fatalf("JoinConfig: %v", err)
	}
	var cfg v1beta4.JoinConfiguration
	decodeStrict(t, documents(t, b)["JoinConfiguration"], &cfg)
	assertEqual(t, "kubelet extra args", cfg.NodeRegistration.KubeletExtraArgs, []v1beta4.Arg{
		{Name: "cgroup-driver", Value: "cgroupfs"},
		{Name: "cloud-provider", Value: "external"},
		{Name: "node-ip", Value: "10.0.1.21"},
		{Name: "node-labels", Value: "berth.dev/pool=a"},
		{Name: "provider-id", Value: "aws:///eu-west-1b/i-0123456789abcdef0"},
	})

	// A provider ID alone (a controller manager that is not the kubelet's cloud provider) sets only that.
	p.Cloud = Cloud{ProviderID: "gce://berth-prod/europe-west1-b/berth-workers-7x2k"}
	if b, err = JoinConfig(p); err != nil {
		t.Fatalf("JoinConfig: %v", err)
	}
	decodeStrict(t, documents(t, b)["JoinConfiguration"], &cfg)
	for _, a := range cfg.NodeRegistration.KubeletExtraArgs {
		if a.Name == "cloud-provider" {
			t.Errorf("kubelet gets --cloud-provider=%s without Cloud.External", a.Value)
		}
	}
}

func TestJoinConfigControlPlane(t *testing.T) {
	p := workerParams()
	p.NodeName = "cp-1"
	p.NodeIP = netip.MustParseAddr("10.0.0.11")
	p.CRISocket = "unix:///var/run/containerd/containerd.sock"
	p.ControlPlane = &ControlPlaneJoin{AdvertiseAddress: netip.MustParseAddr("10.0.0.11")}
	b, err := JoinConfig(p)
	if err != nil {
		t.Fatalf("JoinConfig: %v", err)
	}
	docs := documents(t, b)
	var cfg v1beta4.JoinConfiguration
	decodeStrict(t, docs["JoinConfiguration"], &cfg)
	assertEqual(t, "ControlPlane", cfg.ControlPlane, &v1beta4.JoinControlPlane{
		LocalAPIEndpoint: v1beta4.APIEndpoint{AdvertiseAddress: "10.0.0.11", BindPort: 6443},
	})
	assertEqual(t, "NodeRegistration", cfg.NodeRegistration, v1beta4.NodeRegistrationOptions{
		Name:      "cp-1",
		CRISocket: "unix:///var/run/containerd/containerd.sock",
		KubeletExtraArgs: []v1beta4.Arg{
			{Name: "cgroup-driver", Value: "cgroupfs"},
			{Name: "node-ip", Value: "10.0.0.11"},
			{Name: "node-labels", Value: "berth.dev/pool=a"},
		},
		IgnorePreflightErrors: []string{"FileAvailable--etc-kubernetes-kubelet.conf"},
	})

	p.ControlPlane.BindPort = 7443
	b, err = JoinConfig(p)
	if err != nil {
		t.Fatalf("JoinConfig: %v", err)
	}
	var internal kubeadmapi.JoinConfiguration
	decodeInternal(t, documents(t, b)["JoinConfiguration"], &internal)
	if internal.ControlPlane == nil || internal.ControlPlane.LocalAPIEndpoint != (kubeadmapi.APIEndpoint{AdvertiseAddress: "10.0.0.11", BindPort: 7443}) {
		t.Errorf("internal control plane = %+v", internal.ControlPlane)
	}
}

func TestJoinConfigRejects(t *testing.T) {
	tests := []struct {
		name    string
		mutate  func(*JoinParams)
		wantErr string
	}{
		{"no node name", func(p *JoinParams) { p.NodeName = "" }, "node name is required"},
		{"bad node name", func(p *JoinParams) { p.NodeName = "worker.1." }, "not a DNS-1123 subdomain"},
		{"no node IP", func(p *JoinParams) { p.NodeIP = netip.Addr{} }, "node IP is required"},
		{"link-local node IP", func(p *JoinParams) { p.NodeIP = netip.MustParseAddr("fe80::1") }, "node IP fe80::1 is not a global unicast address"},
		{"no endpoint", func(p *JoinParams) { p.APIServerEndpoint = "" }, "API server endpoint"},
		{"endpoint without port", func(p *JoinParams) { p.APIServerEndpoint = "10.0.0.10" }, "API server endpoint: \"10.0.0.10\" is not host:port"},
		{"endpoint bad port", func(p *JoinParams) { p.APIServerEndpoint = "10.0.0.10:https" }, "has no valid port"},
		{"no token", func(p *JoinParams) { p.Token = "" }, "bootstrap token is not of the form"},
		{"token upper case", func(p *JoinParams) { p.Token = strings.ToUpper(testToken) }, "bootstrap token is not of the form"},
		{"token too long", func(p *JoinParams) { p.Token = testToken + "0" }, "bootstrap token is not of the form"},
		{"token without dot", func(p *JoinParams) { p.Token = strings.Replace(testToken, ".", ":", 1) }, "bootstrap token is not of the form"},
		{"token with newline", func(p *JoinParams) { p.Token = testToken + "\n" }, "bootstrap token is not of the form"},
		{"no hashes", func(p *JoinParams) { p.CACertHashes = nil }, "at least one CA certificate hash is required"},
		{"hash without prefix", func(p *JoinParams) { p.CACertHashes = []string{strings.TrimPrefix(testHash, "sha256:")} }, "CA certificate hash 0"},
		{"hash too short", func(p *JoinParams) { p.CACertHashes = []string{testHash, testHash[:70]} }, "CA certificate hash 1"},
		{"hash upper case", func(p *JoinParams) { p.CACertHashes = []string{strings.ToUpper(testHash)} }, "64 lowercase hex digits"},
		{"node-ip in extra args", func(p *JoinParams) { p.KubeletExtraArgs = map[string]string{"node-ip": "10.0.1.22"} }, "\"node-ip\" is set from the node address"},
		{"extra arg value with tab", func(p *JoinParams) { p.KubeletExtraArgs = map[string]string{"v": "2\t--x"} }, "whitespace or control characters"},
		{"skip phase", func(p *JoinParams) { p.SkipPhases = []string{"Preflight"} }, "skip phase \"Preflight\""},
		{"CRI socket", func(p *JoinParams) { p.CRISocket = "npipe:////./pipe/containerd" }, "CRI socket"},
		{"control plane without address", func(p *JoinParams) { p.ControlPlane = &ControlPlaneJoin{} }, "control-plane advertise address is required"},
		{"control plane bad port", func(p *JoinParams) {
			p.ControlPlane = &ControlPlaneJoin{AdvertiseAddress: netip.MustParseAddr("10.0.0.11"), BindPort: 65536}
		}, "bind port 65536 is out of range"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := workerParams()
			tt.mutate(&p)
			b, err := JoinConfig(p)
			if err == nil {
				t.Fatalf("JoinConfig accepted it:\n%s", b)
			}
			if !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("error %q does not contain %q", err, tt.wantErr)
			}
			for _, secret := range []string{p.Token, strings.TrimSpace(p.Token), "q8r2m4x7k1z9w3p6"} {
				if secret != "" && strings.Contains(err.Error(), secret) {
					t.Errorf("error %q contains the token", err)
				}
			}
		})
	}
}

// configDocument is the document of kind want.Kind in the multi-document configuration b, which must be of
// want's group and version.
func configDocument(t *testing.T, b []byte, want schema.GroupVersionKind) []byte {
	t.Helper()
	gvkmap, err := kubeadmutil.SplitConfigDocuments(b)
	if err != nil {
		t.Fatal(err)
	}
	for gvk, doc := range gvkmap {
		if gvk.Kind != want.Kind {
			continue
		}
		if gvk != want {
			t.Errorf("%s has group version %s, want %s", want.Kind, gvk.GroupVersion(), want.GroupVersion())
		}
		return doc
	}
	t.Fatalf("no %s document:\n%s", want.Kind, b)
	return nil
}

func TestInitConfigKubelet(t *testing.T) {
	p := fullInitParams()
	p.Kubelet = KubeletSettings{CgroupDriver: "cgroupfs", AllowCgroupV1: true}
	b, err := InitConfig(p)
	if err != nil {
		t.Fatal(err)
	}
	kubelet := configDocument(t, b, kubeletv1beta1.SchemeGroupVersion.WithKind("KubeletConfiguration"))
	var got kubeletv1beta1.KubeletConfiguration
	decodeStrict(t, kubelet, &got)
	if got.CgroupDriver != "cgroupfs" || got.FailCgroupV1 == nil || *got.FailCgroupV1 {
		t.Errorf("kubelet configuration %+v", got)
	}
	var fields map[string]any
	decodeStrict(t, kubelet, &fields)
	if len(fields) != 4 {
		t.Errorf("the kubelet document sets %v; want only apiVersion, kind, cgroupDriver and failCgroupV1", fields)
	}

	p.Kubelet = KubeletSettings{}
	if b, err = InitConfig(p); err != nil || strings.Contains(string(b), "KubeletConfiguration") {
		t.Errorf("no kubelet settings must leave kubeadm's kubelet defaults: %v\n%s", err, b)
	}
	p.Kubelet = KubeletSettings{CgroupDriver: "cgroupv1"}
	if _, err := InitConfig(p); err == nil || !strings.Contains(err.Error(), "cgroup driver") {
		t.Errorf("bad cgroup driver: %v", err)
	}
}

func TestInitConfigKubeProxy(t *testing.T) {
	p := fullInitParams()
	zero := int32(0)
	p.KubeProxy = KubeProxySettings{ConntrackMaxPerCore: &zero}
	b, err := InitConfig(p)
	if err != nil {
		t.Fatal(err)
	}
	proxy := configDocument(t, b, kubeproxyv1alpha1.SchemeGroupVersion.WithKind("KubeProxyConfiguration"))
	var got kubeproxyv1alpha1.KubeProxyConfiguration
	decodeStrict(t, proxy, &got)
	if got.Conntrack.MaxPerCore == nil || *got.Conntrack.MaxPerCore != 0 {
		t.Errorf("kube-proxy conntrack %+v, want maxPerCore 0", got.Conntrack)
	}
	var fields map[string]any
	decodeStrict(t, proxy, &fields)
	if len(fields) != 3 {
		t.Errorf("the kube-proxy document sets %v; want only apiVersion, kind and conntrack", fields)
	}

	p.KubeProxy = KubeProxySettings{}
	if b, err = InitConfig(p); err != nil || strings.Contains(string(b), "KubeProxyConfiguration") {
		t.Errorf("no kube-proxy settings must leave kubeadm's kube-proxy defaults: %v\n%s", err, b)
	}
	negative := int32(-1)
	p.KubeProxy = KubeProxySettings{ConntrackMaxPerCore: &negative}
	if _, err := InitConfig(p); err == nil || !strings.Contains(err.Error(), "conntrackMaxPerCore -1") {
		t.Errorf("negative conntrackMaxPerCore: %v", err)
	}
}

// TestInitConfigCertificateValidity: a validity reaches kubeadm's ClusterConfiguration, which kubeadm also
// reads at every renewal; one shorter than a renewal could keep up with is refused.
func TestInitConfigCertificateValidity(t *testing.T) {
	p := InitParams{NodeName: "cp-0", AdvertiseAddress: netip.MustParseAddr("192.0.2.7"), KubernetesVersion: "v1.36.3",
		CertificateValidity: 90 * 24 * time.Hour}
	b, err := InitConfig(p)
	if err != nil {
		t.Fatal(err)
	}
	var internalCluster kubeadmapi.ClusterConfiguration
	decodeInternal(t, documents(t, b)["ClusterConfiguration"], &internalCluster)
	if v := internalCluster.CertificateValidityPeriod; v == nil || v.Duration != 90*24*time.Hour {
		t.Errorf("kubeadm reads certificateValidityPeriod %v, want 2160h", v)
	}
	p.CertificateValidity = time.Minute
	if _, err := InitConfig(p); err == nil || !strings.Contains(err.Error(), "certificate validity") {
		t.Errorf("a one-minute validity: %v, want refused", err)
	}
}
