package initserver

import (
	"bytes"
	"encoding/hex"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/keys"
	"github.com/berthlabs/berth/internal/kubeadm"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/policy"
)

// CA material a fuzzed request carries, chosen by a fuzzed byte.
const (
	casValid = iota
	casSameCA
	casSwappedKeys
	casExpired
	casCount
)

// FuzzValidateRequest checks that the request validator never panics, and that whatever it accepts is
// complete and consistent: keys long enough, the derived disk key and cluster ID those of the request,
// a kubeadm configuration for the node, and a policy that parses.
func FuzzValidateRequest(f *testing.F) {
	now := time.Date(2026, 6, 1, 12, 0, 0, 0, time.UTC)
	newCA := func(name string, at time.Time) (cert, key []byte) {
		ca, err := pki.NewCA(name, at, 24*time.Hour)
		if err != nil {
			f.Fatal(err)
		}
		k, err := ca.KeyPEM()
		if err != nil {
			f.Fatal(err)
		}
		return ca.CertPEM(), k
	}
	kubeCert, kubeKey := newCA("kubernetes", now)
	joinCert, joinKey := newCA("berth-join-ca", now)
	oldCert, oldKey := newCA("old", now.AddDate(0, 0, -2))
	inst := metadata.Instance{Name: "cp-0", Role: metadata.RoleControlPlane, Addresses: []netip.Addr{netip.MustParseAddr("192.0.2.10")}}
	disk, err := keys.DiskLabel("0f1e2d3c-4b5a-4978-8796-a5b4c3d2e1f0")
	if err != nil {
		f.Fatal(err)
	}
	const pkiDir = "/etc/kubernetes/pki"

	f.Fuzz(func(t *testing.T, master, salt []byte, cas uint8, clusterName, version, endpoint, podSubnet, serviceSubnet string, joinPolicy []byte) {
		req := &berthv1.InitRequest{
			InitSecret: []byte("checked before validation"), MasterSecret: master, Salt: salt,
			KubernetesCaCertificate: kubeCert, KubernetesCaKey: kubeKey, JoinCaCertificate: joinCert, JoinCaKey: joinKey,
			ClusterName: clusterName, KubernetesVersion: version, ControlPlaneEndpoint: endpoint,
			PodSubnet: podSubnet, ServiceSubnet: serviceSubnet, JoinPolicy: joinPolicy,
		}
		switch cas % casCount {
		case casSameCA:
			req.JoinCaCertificate, req.JoinCaKey = kubeCert, kubeKey
		case casSwappedKeys:
			req.KubernetesCaKey, req.JoinCaKey = joinKey, kubeKey
		case casExpired:
			req.JoinCaCertificate, req.JoinCaKey = oldCert, oldKey
		}
		p, err := validateAndPlan(req, inst, disk, kubeadm.InitParams{CertificatesDir: pkiDir}, now)
		if err != nil {
			if p != nil {
				t.Fatalf("refused request (%v) came with a plan", err)
			}
			return
		}

		if cas%casCount != casValid {
			t.Fatalf("accepted CA case %d", cas%casCount)
		}
		if len(master) < minMasterSecret || len(salt) < minSalt {
			t.Fatalf("accepted a master secret of %d and a salt of %d bytes", len(master), len(salt))
		}
		if !kubernetesVersion.MatchString(version) || clusterName == "" {
			t.Fatalf("accepted version %q, cluster name %q", version, clusterName)
		}
		wantKey, err := keys.Derive(master, salt, disk, diskKeySize)
		if err != nil || !bytes.Equal(p.diskKey, wantKey) {
			t.Fatalf("disk key is not the one derived from the request (%v)", err)
		}
		if id, err := keys.ClusterIDOf(master, salt); err != nil || p.clusterID != id {
			t.Fatalf("cluster ID %q, want %q (%v)", p.clusterID, id, err)
		}
		wantEndpoint := endpoint
		if wantEndpoint == "" {
			wantEndpoint = "192.0.2.10:6443"
		}
		if p.apiEndpoint != wantEndpoint || p.secrets.APIServerEndpoint != wantEndpoint {
			t.Fatalf("API server endpoint %q, want %q", p.apiEndpoint, wantEndpoint)
		}
		config := string(p.kubeadmConfig)
		for _, want := range []string{"kubernetesVersion: " + version, "certificatesDir: " + pkiDir, "name: cp-0"} {
			if !strings.Contains(config, want) {
				t.Fatalf("kubeadm configuration lacks %q:\n%s", want, config)
			}
		}
		if !bytes.Equal(p.joinPolicy, joinPolicy) {
			t.Fatal("join policy changed")
		}
		if len(joinPolicy) > 0 {
			if _, err := policy.Parse(joinPolicy); err != nil {
				t.Fatalf("accepted a join policy that does not parse: %v", err)
			}
		}
		if !bytes.Equal(p.secrets.MasterSecret, master) || !bytes.Equal(p.secrets.Salt, salt) ||
			!bytes.Equal(p.secrets.JoinCACert, joinCert) || !bytes.Equal(p.secrets.JoinCAKey, joinKey) ||
			!bytes.Equal(p.kubeCA.CertPEM(), kubeCert) || !bytes.Equal(p.kubeCAKeyPEM, kubeKey) {
			t.Fatal("the plan's secrets are not the request's")
		}
	})
}

func TestValidateRequestErrorsHoldNoSecret(t *testing.T) {
	now := time.Now()
	kube, err := pki.NewCA("kubernetes", now, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	join, err := pki.NewCA("berth-join-ca", now, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	kubeKey, err := kube.KeyPEM()
	if err != nil {
		t.Fatal(err)
	}
	joinKey, err := join.KeyPEM()
	if err != nil {
		t.Fatal(err)
	}
	master, err := keys.NewSecret()
	if err != nil {
		t.Fatal(err)
	}
	salt, err := keys.NewSecret()
	if err != nil {
		t.Fatal(err)
	}
	valid := func() *berthv1.InitRequest {
		return &berthv1.InitRequest{
			InitSecret: []byte("init-secret"), MasterSecret: master, Salt: salt,
			KubernetesCaCertificate: kube.CertPEM(), KubernetesCaKey: kubeKey,
			JoinCaCertificate: join.CertPEM(), JoinCaKey: joinKey,
			ClusterName: "lab", KubernetesVersion: "v1.36.3",
		}
	}
	inst := metadata.Instance{Name: "cp-0", Role: metadata.RoleControlPlane, Addresses: []netip.Addr{netip.MustParseAddr("192.0.2.10")}}
	disk, err := keys.DiskLabel("0f1e2d3c-4b5a-4978-8796-a5b4c3d2e1f0")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := validateAndPlan(valid(), inst, disk, kubeadm.InitParams{CertificatesDir: "/etc/kubernetes/pki"}, now); err != nil {
		t.Fatalf("valid request refused: %v", err)
	}

	for _, tc := range []struct {
		name   string
		change func(r *berthv1.InitRequest)
		want   string
	}{
		{"short master secret", func(r *berthv1.InitRequest) { r.MasterSecret = master[:31] }, "master secret is 31 bytes"},
		{"short salt", func(r *berthv1.InitRequest) { r.Salt = salt[:15] }, "salt is 15 bytes"},
		{"Kubernetes CA key of the join CA", func(r *berthv1.InitRequest) { r.KubernetesCaKey = joinKey }, "Kubernetes CA"},
		{"join CA key missing", func(r *berthv1.InitRequest) { r.JoinCaKey = nil }, "join CA"},
		{"one CA for both", func(r *berthv1.InitRequest) { r.JoinCaCertificate, r.JoinCaKey = kube.CertPEM(), kubeKey }, "different CAs"},
		{"no cluster name", func(r *berthv1.InitRequest) { r.ClusterName = "" }, "cluster name is empty"},
		{"cluster name with dots", func(r *berthv1.InitRequest) { r.ClusterName = "a.b" }, "DNS-1123 label"},
		{"version without v", func(r *berthv1.InitRequest) { r.KubernetesVersion = "1.36.3" }, `kubernetes version "1.36.3"`},
		{"version latest", func(r *berthv1.InitRequest) { r.KubernetesVersion = "stable" }, "release version"},
		{"endpoint without port", func(r *berthv1.InitRequest) { r.ControlPlaneEndpoint = "lb.example.com" }, "control-plane endpoint"},
		{"pod subnet with host bits", func(r *berthv1.InitRequest) { r.PodSubnet = "10.244.0.1/16" }, "pod subnet"},
		{"policy with unknown field", func(r *berthv1.InitRequest) { r.JoinPolicy = []byte("images: []\nallow: all\n") }, "initial join policy"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := valid()
			tc.change(r)
			_, err := validateAndPlan(r, inst, disk, kubeadm.InitParams{CertificatesDir: "/etc/kubernetes/pki"}, now)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
			msg := err.Error()
			for _, secret := range [][]byte{r.MasterSecret, r.Salt, r.KubernetesCaKey, r.JoinCaKey, r.InitSecret} {
				if len(secret) > 0 && (strings.Contains(msg, string(secret)) || strings.Contains(msg, hex.EncodeToString(secret))) {
					t.Fatalf("error %q holds secret material", msg)
				}
			}
		})
	}
}

// validateAndPlan is what the server does with a request once the init secret is accepted.
func validateAndPlan(req *berthv1.InitRequest, inst metadata.Instance, disk keys.Label, base kubeadm.InitParams, now time.Time) (*plan, error) {
	checked, err := validateRequest(req, inst, now)
	if err != nil {
		return nil, err
	}
	return planInit(checked, inst, disk, base)
}
