package joinclient

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/tls"
	"crypto/x509"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"k8s.io/client-go/tools/clientcmd"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/keys"
	"github.com/berthlabs/berth/internal/kubeadm"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
)

const testToken = "abcdef.0123456789abcdef"

var credInstance = metadata.Instance{Name: "w-0", Role: metadata.RoleWorker, Addresses: addrs("10.0.0.20", "fd00::20")}

func testPaths(t *testing.T) nodestate.Paths {
	t.Helper()
	dir := t.TempDir()
	return nodestate.Paths{
		State:         filepath.Join(dir, "var/lib/berth"),
		KubernetesDir: filepath.Join(dir, "etc/kubernetes"),
		KubeletDir:    filepath.Join(dir, "var/lib/kubelet"),
	}
}

// ticketFor is the ticket a join service would issue to inst for the kubelet key in its CSR.
func ticketFor(t *testing.T, ca *pki.CA, inst metadata.Instance) (*berthv1.JoinTicket, *ecdsa.PrivateKey) {
	t.Helper()
	key, csrDER, err := kubeletCSR(inst)
	if err != nil {
		t.Fatal(err)
	}
	ticket, err := ticketForCSR(ca, inst, csrDER)
	if err != nil {
		t.Fatal(err)
	}
	return ticket, key
}

// ticketForCSR is the ticket a join service would issue to inst for the CSR csrDER.
func ticketForCSR(ca *pki.CA, inst metadata.Instance, csrDER []byte) (*berthv1.JoinTicket, error) {
	csr, err := x509.ParseCertificateRequest(csrDER)
	if err != nil {
		return nil, err
	}
	cert, err := ca.IssueClient(pki.ClientTemplate{
		CommonName: csr.Subject.CommonName, Organization: csr.Subject.Organization, IPAddresses: csr.IPAddresses,
	}, csr.PublicKey, time.Now(), time.Hour)
	if err != nil {
		return nil, err
	}
	return &berthv1.JoinTicket{
		NodeName:                inst.Name,
		ClusterId:               "0123456789abcdef0123456789abcdef",
		ApiServerEndpoint:       "10.0.0.1:6443",
		BootstrapToken:          testToken,
		DiscoveryCaCertHashes:   []string{pki.SPKIPin(ca.Cert)},
		KubeletCertificate:      cert.Raw,
		KubernetesCaCertificate: ca.Cert.Raw,
		KubernetesVersion:       "v1.36.3",
		JoinMethod:              berthv1.JoinMethod_JOIN_METHOD_KUBEADM,
		DiskKey:                 bytes.Repeat([]byte{0x5a}, keys.DiskKeySize),
	}, nil
}

// writeCredentials plans the join of inst with ticket for testDisk and writes what it leaves, as Join does
// once it holds the node lock and has keyed the disk. It returns the kubeadm join configuration's path.
func writeCredentials(cfg *Config, inst metadata.Instance, ticket *berthv1.JoinTicket, key *ecdsa.PrivateKey) (string, error) {
	plan, err := planJoin(cfg, &metadata.Self{Instance: inst}, ticket, key, testDisk.UUID)
	if err != nil {
		return "", err
	}
	return plan.joinConfig, plan.write(cfg)
}

func newKubeCA(t *testing.T) *pki.CA {
	t.Helper()
	ca, err := pki.NewCA("kubernetes", time.Now(), 2*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	return ca
}

func fileMode(t *testing.T, path string) os.FileMode {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Mode().Perm()
}

func TestWriteCredentials(t *testing.T) {
	ca := newKubeCA(t)
	p := testPaths(t)
	ticket, key := ticketFor(t, ca, credInstance)

	joinConfig, err := writeCredentials(&Config{Paths: p}, credInstance, ticket, key)
	if err != nil {
		t.Fatal(err)
	}

	kubeletConf := filepath.Join(p.KubernetesDir, "kubelet.conf")
	cfg, err := clientcmd.LoadFromFile(kubeletConf)
	if err != nil {
		t.Fatalf("kubelet.conf does not load: %v", err)
	}
	if m := fileMode(t, kubeletConf); m != 0o600 {
		t.Errorf("kubelet.conf mode %#o, want 0600", m)
	}
	ctx := cfg.Contexts[cfg.CurrentContext]
	if ctx == nil {
		t.Fatalf("current context %q does not exist", cfg.CurrentContext)
	}
	cluster, auth := cfg.Clusters[ctx.Cluster], cfg.AuthInfos[ctx.AuthInfo]
	if cluster == nil || auth == nil {
		t.Fatalf("context %+v names a missing cluster or user", ctx)
	}
	if cluster.Server != "https://10.0.0.1:6443" {
		t.Errorf("server %q, want https://10.0.0.1:6443", cluster.Server)
	}
	if !bytes.Equal(cluster.CertificateAuthorityData, pki.EncodeCertPEM(ca.Cert)) {
		t.Error("kubelet.conf does not carry the ticket's CA")
	}
	certPath := KubeletCertPath(p)
	if auth.ClientCertificate != certPath || auth.ClientKey != certPath {
		t.Errorf("client certificate %q and key %q, want both %q", auth.ClientCertificate, auth.ClientKey, certPath)
	}

	// The rest config client-go builds from kubelet.conf must hold a certificate and key that belong together.
	rest, err := clientcmd.NewDefaultClientConfig(*cfg, nil).ClientConfig()
	if err != nil {
		t.Fatalf("client config from kubelet.conf: %v", err)
	}
	if _, err := tls.LoadX509KeyPair(rest.TLSClientConfig.CertFile, rest.TLSClientConfig.KeyFile); err != nil {
		t.Errorf("kubelet certificate and key do not match: %v", err)
	}
	if m := fileMode(t, certPath); m != 0o600 {
		t.Errorf("kubelet certificate file mode %#o, want 0600", m)
	}

	// kubeadm join's worker preflight refuses an existing pki/ca.crt: it writes the file from discovery.
	if _, err := os.Stat(filepath.Join(p.PKIDir(), "ca.crt")); err == nil {
		t.Error("pki/ca.crt was written for a worker")
	}

	if joinConfig != filepath.Join(p.State, "kubeadm-join.yaml") {
		t.Errorf("join configuration at %s", joinConfig)
	}
	if m := fileMode(t, joinConfig); m != 0o600 {
		t.Errorf("join configuration mode %#o, want 0600: it holds the bootstrap token", m)
	}
	jc, err := os.ReadFile(joinConfig)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"kind: JoinConfiguration", testToken, "10.0.0.1:6443", pki.SPKIPin(ca.Cert), "name: w-0", "10.0.0.20"} {
		if !strings.Contains(string(jc), want) {
			t.Errorf("join configuration lacks %q:\n%s", want, jc)
		}
	}
	if strings.Contains(string(jc), "controlPlane") {
		t.Errorf("a worker's join configuration has a control-plane section:\n%s", jc)
	}
}

// TestWriteCredentialsKubeletMethod: a ticket for an external control plane gives the kubelet everything
// kubeadm join would have written (kubeconfig, CA, configuration, flags) and no kubeadm configuration.
func TestWriteCredentialsKubeletMethod(t *testing.T) {
	ca := newKubeCA(t)
	p := testPaths(t)
	ticket, key := ticketFor(t, ca, credInstance)
	ticket.JoinMethod = berthv1.JoinMethod_JOIN_METHOD_KUBELET
	ticket.BootstrapToken, ticket.DiscoveryCaCertHashes = "", nil
	ticket.KubeletSettings = &berthv1.KubeletSettings{ClusterDns: []string{"10.96.0.10"}, ClusterDomain: "cluster.local"}
	cfg := &Config{Paths: p, Kubelet: kubeadm.KubeletSettings{CgroupDriver: "cgroupfs"}}

	joinConfig, err := writeCredentials(cfg, credInstance, ticket, key)
	if err != nil {
		t.Fatal(err)
	}
	if joinConfig != "" {
		t.Errorf("join configuration %q written for a ticket without kubeadm", joinConfig)
	}
	if _, err := os.Stat(filepath.Join(p.State, "kubeadm-join.yaml")); err == nil {
		t.Error("kubeadm-join.yaml exists")
	}
	caPEM, err := os.ReadFile(filepath.Join(p.PKIDir(), "ca.crt"))
	if err != nil || !bytes.Equal(caPEM, pki.EncodeCertPEM(ca.Cert)) {
		t.Errorf("pki/ca.crt: %v, want the ticket's CA", err)
	}
	if _, err := clientcmd.LoadFromFile(filepath.Join(p.KubernetesDir, "kubelet.conf")); err != nil {
		t.Errorf("kubelet.conf: %v", err)
	}
	config, err := os.ReadFile(filepath.Join(p.KubeletDir, "config.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"kind: KubeletConfiguration", "clientCAFile: " + filepath.Join(p.PKIDir(), "ca.crt"),
		"- 10.96.0.10", "clusterDomain: cluster.local", "cgroupDriver: cgroupfs"} {
		if !strings.Contains(string(config), want) {
			t.Errorf("config.yaml lacks %q:\n%s", want, config)
		}
	}
	flags, err := os.ReadFile(filepath.Join(p.KubeletDir, "kubeadm-flags.env"))
	if err != nil {
		t.Fatal(err)
	}
	if want := "KUBELET_KUBEADM_ARGS=\"--hostname-override=w-0 --node-ip=10.0.0.20\"\n"; string(flags) != want {
		t.Errorf("kubeadm-flags.env = %q, want %q", flags, want)
	}
}

// TestWriteCredentialsCloud: a node of a cloud tells its kubelet its provider ID, from its own record, and to
// wait for the cloud's controller manager, from the image, whichever way it joins.
func TestWriteCredentialsCloud(t *testing.T) {
	ca := newKubeCA(t)
	self := &metadata.Self{Instance: credInstance, ProviderID: "aws:///eu-west-1b/i-0123456789abcdef0"}
	// Where each join method writes the kubelet's flags, and how they read there.
	for method, want := range map[berthv1.JoinMethod][]string{
		berthv1.JoinMethod_JOIN_METHOD_KUBEADM: {"name: cloud-provider\n    value: external", "name: provider-id\n    value: aws:///eu-west-1b/i-0123456789abcdef0"},
		berthv1.JoinMethod_JOIN_METHOD_KUBELET: {"--cloud-provider=external --provider-id=aws:///eu-west-1b/i-0123456789abcdef0\""},
	} {
		t.Run(method.String(), func(t *testing.T) {
			p := testPaths(t)
			ticket, key := ticketFor(t, ca, credInstance)
			ticket.JoinMethod = method
			cfg := &Config{Paths: p, KubeadmJoin: kubeadm.JoinParams{Cloud: kubeadm.Cloud{External: true}}}
			plan, err := planJoin(cfg, self, ticket, key, testDisk.UUID)
			if err != nil {
				t.Fatal(err)
			}
			if err := plan.write(cfg); err != nil {
				t.Fatal(err)
			}
			written := filepath.Join(p.KubeletDir, "kubeadm-flags.env")
			if method == berthv1.JoinMethod_JOIN_METHOD_KUBEADM {
				written = plan.joinConfig
			}
			b, err := os.ReadFile(written)
			if err != nil {
				t.Fatal(err)
			}
			for _, w := range want {
				if !strings.Contains(string(b), w) {
					t.Errorf("%s lacks %q:\n%s", written, w, b)
				}
			}
		})
	}
}

func TestWriteCredentialsRefusesUnknownMethod(t *testing.T) {
	ca := newKubeCA(t)
	p := testPaths(t)
	ticket, key := ticketFor(t, ca, credInstance)
	ticket.JoinMethod = berthv1.JoinMethod_JOIN_METHOD_UNSPECIFIED
	_, err := writeCredentials(&Config{Paths: p}, credInstance, ticket, key)
	if err == nil || !strings.Contains(err.Error(), "not one this agent knows") {
		t.Fatalf("writeCredentials: %v, want the method refused", err)
	}
	if _, err := os.Stat(p.KubernetesDir); err == nil {
		t.Error("files were written for a refused ticket")
	}
}

func TestWriteCredentialsControlPlane(t *testing.T) {
	ca := newKubeCA(t)
	p := testPaths(t)
	inst := metadata.Instance{Name: "cp-1", Role: metadata.RoleControlPlane, Addresses: addrs("10.0.0.11")}
	ticket, key := ticketFor(t, ca, inst)
	ticket.ControlPlaneFiles = []*berthv1.File{
		{Path: "ca.key", Content: []byte("ca key"), Mode: 0o600},
		{Path: "etcd/ca.crt", Content: []byte("etcd ca"), Mode: 0o644},
		{Path: "sa.pub", Content: []byte("sa pub"), Mode: 0o4777},
	}
	joinConfig, err := writeCredentials(&Config{Paths: p}, inst, ticket, key)
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]os.FileMode{"ca.key": 0o600, "etcd/ca.crt": 0o644, "sa.pub": 0o644} {
		path := filepath.Join(p.PKIDir(), name)
		if m := fileMode(t, path); m != want {
			t.Errorf("%s mode %#o, want %#o", name, m, want)
		}
	}
	if fi, _ := os.Stat(filepath.Join(p.PKIDir(), "sa.pub")); fi != nil && fi.Mode()&(os.ModeSetuid|0o111) != 0 {
		t.Errorf("sa.pub mode %v: set-uid or executable bits came through from the ticket", fi.Mode())
	}
	jc, err := os.ReadFile(joinConfig)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(jc), "controlPlane") || !strings.Contains(string(jc), "advertiseAddress: 10.0.0.11") {
		t.Errorf("control-plane join configuration lacks its control-plane section:\n%s", jc)
	}
}

func TestWriteCredentialsRefusesNonLocalPaths(t *testing.T) {
	ca := newKubeCA(t)
	cp := metadata.Instance{Name: "cp-1", Role: metadata.RoleControlPlane, Addresses: addrs("10.0.0.11")}
	for _, path := range []string{"../x", "/etc/passwd", "etcd/../../x", ""} {
		t.Run(path, func(t *testing.T) {
			p := testPaths(t)
			ticket, key := ticketFor(t, ca, cp)
			ticket.ControlPlaneFiles = []*berthv1.File{{Path: path, Content: []byte("attacker"), Mode: 0o644}}
			_, err := writeCredentials(&Config{Paths: p}, cp, ticket, key)
			if err == nil || !strings.Contains(err.Error(), "leaves the certificates directory") {
				t.Fatalf("writeCredentials: %v, want the path refused", err)
			}
			if _, err := os.Stat(filepath.Join(p.KubernetesDir, "x")); err == nil {
				t.Error("a file was written outside the certificates directory")
			}
			if _, err := os.Stat(filepath.Join(p.KubernetesDir, "kubelet.conf")); err == nil {
				t.Error("kubelet.conf was written from a refused ticket")
			}
		})
	}
}

func TestWriteCredentialsRefusesForeignKubeletCertificate(t *testing.T) {
	ca, other := newKubeCA(t), newKubeCA(t)
	p := testPaths(t)
	ticket, key := ticketFor(t, ca, credInstance)
	forged, _ := ticketFor(t, other, credInstance)
	ticket.KubeletCertificate = forged.KubeletCertificate

	_, err := writeCredentials(&Config{Paths: p}, credInstance, ticket, key)
	if err == nil || !strings.Contains(err.Error(), "not signed by its Kubernetes CA") {
		t.Fatalf("writeCredentials: %v, want the kubelet certificate refused", err)
	}
	if _, err := os.Stat(p.KubernetesDir); err == nil {
		t.Error("files were written for a refused ticket")
	}
	if _, err := os.Stat(KubeletCertPath(p)); err == nil {
		t.Error("the foreign kubelet certificate was written")
	}
}

func TestWriteCredentialsRefusesCertificateForAnotherKey(t *testing.T) {
	ca := newKubeCA(t)
	p := testPaths(t)
	ticket, _ := ticketFor(t, ca, credInstance)
	_, otherKey := ticketFor(t, ca, credInstance)

	_, err := writeCredentials(&Config{Paths: p}, credInstance, ticket, otherKey)
	if err == nil || !strings.Contains(err.Error(), "not for the key this node sent") {
		t.Fatalf("writeCredentials: %v, want the certificate refused", err)
	}
	if _, err := os.Stat(p.KubernetesDir); err == nil {
		t.Error("files were written for a refused ticket")
	}
}

func TestWriteCredentialsRefusesMalformedCertificates(t *testing.T) {
	ca := newKubeCA(t)
	for name, tamper := range map[string]func(*berthv1.JoinTicket){
		"no CA":               func(tk *berthv1.JoinTicket) { tk.KubernetesCaCertificate = nil },
		"CA garbage":          func(tk *berthv1.JoinTicket) { tk.KubernetesCaCertificate = []byte("garbage") },
		"no kubelet cert":     func(tk *berthv1.JoinTicket) { tk.KubeletCertificate = nil },
		"kubelet cert is PEM": func(tk *berthv1.JoinTicket) { tk.KubeletCertificate = pki.EncodeCertPEM(ca.Cert) },
	} {
		t.Run(name, func(t *testing.T) {
			p := testPaths(t)
			ticket, key := ticketFor(t, ca, credInstance)
			tamper(ticket)
			if _, err := writeCredentials(&Config{Paths: p}, credInstance, ticket, key); err == nil {
				t.Fatal("writeCredentials accepted the ticket")
			}
		})
	}
}

// A ticket is checked against the node it is for, whatever the service that sent it: a worker takes no
// control-plane material, no ticket of another node, no endpoint that is not host:port; nothing is written.
func TestWriteCredentialsRefusesTicketsNotForThisNode(t *testing.T) {
	ca := newKubeCA(t)
	for _, tc := range []struct {
		name   string
		change func(*berthv1.JoinTicket)
		want   string
	}{
		{"control-plane files to a worker", func(tk *berthv1.JoinTicket) {
			tk.ControlPlaneFiles = []*berthv1.File{{Path: "ca.key", Content: []byte("ca key"), Mode: 0o600}}
		}, "control-plane material (1 files, cluster secrets: false) for a worker node"},
		{"cluster secrets to a worker", func(tk *berthv1.JoinTicket) {
			tk.ClusterSecrets = &berthv1.ClusterSecrets{MasterSecret: []byte("master")}
		}, "cluster secrets: true) for a worker node"},
		{"another node's ticket", func(tk *berthv1.JoinTicket) { tk.NodeName = "cp-0" }, `for node "cp-0", this node is "w-0"`},
		{"endpoint without a port", func(tk *berthv1.JoinTicket) { tk.ApiServerEndpoint = "10.0.0.1" }, "API server endpoint"},
		{"endpoint with a path", func(tk *berthv1.JoinTicket) { tk.ApiServerEndpoint = "evil.example/x:6443" }, "API server endpoint"},
		{"kubelet method, bad endpoint", func(tk *berthv1.JoinTicket) {
			tk.JoinMethod, tk.ApiServerEndpoint = berthv1.JoinMethod_JOIN_METHOD_KUBELET, "10.0.0.1:0"
		}, "API server endpoint"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := testPaths(t)
			ticket, key := ticketFor(t, ca, credInstance)
			tc.change(ticket)
			_, err := writeCredentials(&Config{Paths: p}, credInstance, ticket, key)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("writeCredentials: %v, want a refusal with %q", err, tc.want)
			}
			if _, err := os.Stat(p.KubernetesDir); err == nil {
				t.Error("files were written for a refused ticket")
			}
		})
	}
}

// clusterSecretsFor makes the cluster secrets a join service sends a control-plane node with testDisk:
// the ticket's disk key derived from them, and self's pin of their join CA.
func clusterSecretsFor(t *testing.T, ticket *berthv1.JoinTicket, self *metadata.Self) {
	t.Helper()
	master, salt := bytes.Repeat([]byte{1}, 32), bytes.Repeat([]byte{2}, 16)
	label, err := keys.DiskLabel(testDisk.UUID)
	if err != nil {
		t.Fatal(err)
	}
	if ticket.DiskKey, err = keys.Derive(master, salt, label, keys.DiskKeySize); err != nil {
		t.Fatal(err)
	}
	joinCA, err := pki.NewCA("join", time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	keyPEM, err := joinCA.KeyPEM()
	if err != nil {
		t.Fatal(err)
	}
	ticket.ClusterSecrets = &berthv1.ClusterSecrets{MasterSecret: master, Salt: salt, JoinCaCertificate: joinCA.CertPEM(), JoinCaKey: keyPEM}
	self.UserData.JoinCAPin = pki.SPKIPin(joinCA.Cert)
}

// unlockPolicyFor is a one-image unlock policy for role.
func unlockPolicyFor(t *testing.T, role metadata.Role) []byte {
	t.Helper()
	p := &policy.Policy{Images: []policy.Image{{Name: "node-" + string(role), Roles: []metadata.Role{role}, PCRs: map[int][]byte{4: make([]byte, 32)}}}}
	data, err := p.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// TestPlanJoinControlPlane writes everything a control-plane ticket carries: its cluster secrets and its
// unlock policy, after the credentials.
func TestPlanJoinControlPlane(t *testing.T) {
	ca := newKubeCA(t)
	cfg := &Config{Paths: testPaths(t)}
	self := &metadata.Self{Instance: metadata.Instance{Name: "cp-1", Role: metadata.RoleControlPlane, Addresses: addrs("10.0.0.11")}}
	ticket, key := ticketFor(t, ca, self.Instance)
	clusterSecretsFor(t, ticket, self)
	ticket.UnlockPolicy = unlockPolicyFor(t, metadata.RoleControlPlane)
	plan, err := planJoin(cfg, self, ticket, key, testDisk.UUID)
	if err != nil {
		t.Fatal(err)
	}
	if err := plan.write(cfg); err != nil {
		t.Fatal(err)
	}
	secrets, err := nodestate.ReadSecrets(cfg.Paths.State)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(secrets.MasterSecret, ticket.ClusterSecrets.MasterSecret) || secrets.APIServerEndpoint != ticket.ApiServerEndpoint {
		t.Errorf("cluster secrets written %+v, want the ticket's", secrets)
	}
	if got, err := os.ReadFile(filepath.Join(cfg.Paths.State, UnlockPolicyFile)); err != nil || !bytes.Equal(got, ticket.UnlockPolicy) {
		t.Errorf("unlock policy written %q (%v), want the ticket's", got, err)
	}
}

// A ticket is checked whole before the node commits to it: a malformed field, whichever, is refused by name
// and nothing is written (Join takes its lock and keys its disk only after planJoin).
func TestPlanJoinRefusesMalformedTickets(t *testing.T) {
	ca := newKubeCA(t)
	worker := credInstance
	cp := metadata.Instance{Name: "cp-1", Role: metadata.RoleControlPlane, Addresses: addrs("10.0.0.11")}
	otherCA, err := pki.NewCA("join", time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	garbage := make([]byte, 200<<10)
	for i := range garbage {
		garbage[i] = byte('a' + i%26)
	}
	for _, tc := range []struct {
		name   string
		inst   metadata.Instance
		change func(*berthv1.JoinTicket, *metadata.Self)
		want   string
	}{
		{"no disk key", worker, func(tk *berthv1.JoinTicket, _ *metadata.Self) { tk.DiskKey = nil }, "disk key is 0 bytes, want 32"},
		{"short disk key", worker, func(tk *berthv1.JoinTicket, _ *metadata.Self) { tk.DiskKey = tk.DiskKey[:16] }, "disk key is 16 bytes, want 32"},
		{"malformed bootstrap token", worker, func(tk *berthv1.JoinTicket, _ *metadata.Self) { tk.BootstrapToken = "abcdef.0123" }, "bootstrap token"},
		{"malformed CA hash", worker, func(tk *berthv1.JoinTicket, _ *metadata.Self) { tk.DiscoveryCaCertHashes = []string{"md5:00"} }, "CA certificate hash 0"},
		{"no CA hash", worker, func(tk *berthv1.JoinTicket, _ *metadata.Self) { tk.DiscoveryCaCertHashes = nil }, "CA certificate hash is required"},
		{"kubelet method, cluster DNS not an address", worker, func(tk *berthv1.JoinTicket, _ *metadata.Self) {
			tk.JoinMethod, tk.KubeletSettings = berthv1.JoinMethod_JOIN_METHOD_KUBELET, &berthv1.KubeletSettings{ClusterDns: []string{"dns.example"}}
		}, "cluster DNS"},
		{"kubelet method, bad cluster domain", worker, func(tk *berthv1.JoinTicket, _ *metadata.Self) {
			tk.JoinMethod, tk.KubeletSettings = berthv1.JoinMethod_JOIN_METHOD_KUBELET, &berthv1.KubeletSettings{ClusterDomain: "Cluster Local"}
		}, "cluster domain"},
		{"garbage unlock policy of 200 KiB", worker, func(tk *berthv1.JoinTicket, _ *metadata.Self) { tk.UnlockPolicy = garbage }, "unlock policy"},
		{"unlock policy for another role", worker, func(tk *berthv1.JoinTicket, _ *metadata.Self) {
			tk.UnlockPolicy = unlockPolicyFor(t, metadata.RoleControlPlane)
		}, `image "node-control-plane" is not for a worker node`},
		{"cluster secrets that do not derive the disk key", cp, func(tk *berthv1.JoinTicket, self *metadata.Self) {
			clusterSecretsFor(t, tk, self)
			tk.ClusterSecrets.MasterSecret = bytes.Repeat([]byte{9}, 32)
		}, "do not derive the ticket's disk key"},
		{"cluster secrets with a short master secret", cp, func(tk *berthv1.JoinTicket, self *metadata.Self) {
			clusterSecretsFor(t, tk, self)
			tk.ClusterSecrets.MasterSecret = []byte("short")
		}, "master secret is 5 bytes"},
		{"cluster secrets with another join CA", cp, func(tk *berthv1.JoinTicket, self *metadata.Self) {
			clusterSecretsFor(t, tk, self)
			self.UserData.JoinCAPin = pki.SPKIPin(otherCA.Cert)
		}, "is not the one this node's user-data pins"},
		{"cluster secrets with a join CA key that does not parse", cp, func(tk *berthv1.JoinTicket, self *metadata.Self) {
			clusterSecretsFor(t, tk, self)
			tk.ClusterSecrets.JoinCaKey = []byte("not a key")
		}, "join CA"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := &Config{Paths: testPaths(t)}
			self := &metadata.Self{Instance: tc.inst}
			ticket, key := ticketFor(t, ca, tc.inst)
			tc.change(ticket, self)
			_, err := planJoin(cfg, self, ticket, key, testDisk.UUID)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("planJoin: %v, want a refusal with %q", err, tc.want)
			}
			if strings.Contains(err.Error(), string(garbage[:32])) {
				t.Error("the refusal quotes the unlock policy")
			}
			for _, dir := range []string{cfg.Paths.State, cfg.Paths.KubernetesDir, cfg.Paths.KubeletDir} {
				if _, err := os.Stat(dir); err == nil {
					t.Errorf("%s was written for a refused ticket", dir)
				}
			}
		})
	}
}

// A rejoin ticket's disk key opens the state disk and its unlock policy is what the node seals to: both are
// checked before the node uses them.
func TestCheckRejoinTicket(t *testing.T) {
	good := func() *berthv1.RejoinTicket {
		return &berthv1.RejoinTicket{DiskKey: bytes.Repeat([]byte{1}, keys.DiskKeySize), UnlockPolicy: unlockPolicyFor(t, metadata.RoleWorker)}
	}
	if err := checkRejoinTicket(good(), metadata.RoleWorker); err != nil {
		t.Fatalf("a good rejoin ticket: %v", err)
	}
	noPolicy := good()
	noPolicy.UnlockPolicy = nil
	if err := checkRejoinTicket(noPolicy, metadata.RoleWorker); err != nil {
		t.Errorf("a rejoin ticket without an unlock policy: %v", err)
	}
	for _, tc := range []struct {
		name   string
		change func(*berthv1.RejoinTicket)
		want   string
	}{
		{"short disk key", func(tk *berthv1.RejoinTicket) { tk.DiskKey = tk.DiskKey[:8] }, "disk key is 8 bytes, want 32"},
		{"garbage unlock policy", func(tk *berthv1.RejoinTicket) { tk.UnlockPolicy = []byte("{{{") }, "unlock policy"},
		{"unlock policy for another role", func(tk *berthv1.RejoinTicket) {
			tk.UnlockPolicy = unlockPolicyFor(t, metadata.RoleControlPlane)
		}, "not for a worker node"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ticket := good()
			tc.change(ticket)
			if err := checkRejoinTicket(ticket, metadata.RoleWorker); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("checkRejoinTicket: %v, want a refusal with %q", err, tc.want)
			}
		})
	}
}
