package initserver

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/clusterinfo"
	"github.com/berthlabs/berth/internal/keys"
	"github.com/berthlabs/berth/internal/kubeadm"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/internal/rpc/rpctest"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
	"github.com/berthlabs/berth/nodeagent/internal/statedisk"
	"golang.org/x/crypto/argon2"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// CA material a fuzzed request carries, chosen by a fuzzed byte.
const (
	casValid = iota
	casSameCA
	casSwappedKeys
	casExpired
	casCount
)

// fuzzCA is a CA valid for a day from at, as PEM.
func fuzzCA(f *testing.F, name string, at time.Time) (cert, key []byte) {
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

// FuzzValidateRequest checks that the request validator never panics, and that whatever it accepts is
// complete and consistent: keys long enough, the derived disk key and cluster ID those of the request,
// a kubeadm configuration for the node, and a policy that parses.
func FuzzValidateRequest(f *testing.F) {
	now := time.Date(2026, 6, 1, 12, 0, 0, 0, time.UTC)
	newCA := func(name string, at time.Time) (cert, key []byte) { return fuzzCA(f, name, at) }
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
		if !kubeadm.IsRelease(version) || clusterName == "" {
			t.Fatalf("accepted version %q, cluster name %q", version, clusterName)
		}
		wantKey, err := keys.Derive(master, salt, disk, keys.DiskKeySize)
		if err != nil || !bytes.Equal(p.diskKey, wantKey) {
			t.Fatalf("disk key is not the one derived from the request (%v)", err)
		}
		if id, err := keys.ClusterIDOf(master, salt); err != nil || p.record.ID != id {
			t.Fatalf("cluster ID %q, want %q (%v)", p.record.ID, id, err)
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

// cannedProver answers as a TPM would without being one: the init server's handler takes its evidence and
// activation on trust, since the client checks them.
type cannedProver struct{}

func (cannedProver) Evidence([]byte, []int) (*berthv1.Evidence, error) {
	return &berthv1.Evidence{Quote: []byte("quote")}, nil
}

func (cannedProver) Activate(*berthv1.ActivationChallenge) ([]byte, error) {
	return make([]byte, 32), nil
}

// lockTaken is a node lock someone else holds: an exchange that gets this far has been checked in full and
// changes nothing.
type lockTaken struct{}

func (lockTaken) TryLock(string) bool { return false }

// beyondTheLock is everything the server uses only after it took the node lock; with lockTaken it is never
// reached, and says so if it is.
type beyondTheLock struct{}

var errBeyondTheLock = errors.New("reached past a node lock that was taken")

func (beyondTheLock) SetKey(context.Context, []byte, []byte) error          { return errBeyondTheLock }
func (beyondTheLock) Init(context.Context, string, func(string)) error      { return errBeyondTheLock }
func (beyondTheLock) Join(context.Context, string, func(string)) error      { return errBeyondTheLock }
func (beyondTheLock) RecordCluster(context.Context, clusterinfo.Info) error { return errBeyondTheLock }
func (beyondTheLock) InstallPodNetwork(context.Context, string, string) error {
	return errBeyondTheLock
}

// cheapHash is the argon2id PHC string of secret with the smallest parameters the server accepts, so that
// fuzzing reaches past the secret check thousands of times a second.
func cheapHash(secret, salt []byte) string {
	enc := base64.RawStdEncoding
	return fmt.Sprintf("$argon2id$v=19$m=8,t=1,p=1$%s$%s", enc.EncodeToString(salt), enc.EncodeToString(argon2.IDKey(secret, salt, 1, 8, 1, 32)))
}

// FuzzInit feeds the init handler what arrives on the wire: three fuzzed messages, decoded as gRPC's codec
// decodes them (hello, challenge, request). Before the init secret is checked every answer is the one
// "init refused"; after it, a request is refused with its reason or, checked in full, meets the node lock,
// which is taken. Nothing else may come back, and no answer repeats the request's secrets.
func FuzzInit(f *testing.F) {
	now := time.Now()
	secret := []byte("the init secret of this fuzz target")
	kubeCert, kubeKey := fuzzCA(f, "kubernetes", now)
	joinCert, joinKey := fuzzCA(f, "berth-join-ca", now)
	pol, err := (&policy.Policy{Images: []policy.Image{{Name: "zero", Roles: []metadata.Role{metadata.RoleControlPlane, metadata.RoleWorker},
		PCRs: map[int][]byte{7: make([]byte, 32)}}}}).Marshal()
	if err != nil {
		f.Fatal(err)
	}
	wire := func(m *berthv1.InitClientMessage) []byte {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		return b
	}
	hello := wire(&berthv1.InitClientMessage{Msg: &berthv1.InitClientMessage_Hello{Hello: &berthv1.InitHello{Pcrs: []uint32{7}}}})
	challenge := wire(&berthv1.InitClientMessage{Msg: &berthv1.InitClientMessage_Challenge{Challenge: &berthv1.ActivationChallenge{}}})
	request := &berthv1.InitRequest{
		InitSecret: secret, MasterSecret: bytes.Repeat([]byte{1}, 32), Salt: bytes.Repeat([]byte{2}, 32),
		KubernetesCaCertificate: kubeCert, KubernetesCaKey: kubeKey, JoinCaCertificate: joinCert, JoinCaKey: joinKey,
		ClusterName: "lab", KubernetesVersion: "v1.36.3", JoinPolicy: pol,
	}
	f.Add(hello, challenge, wire(&berthv1.InitClientMessage{Msg: &berthv1.InitClientMessage_Request{Request: request}}))
	wrong := proto.Clone(request).(*berthv1.InitRequest)
	wrong.InitSecret = []byte("wrong")
	f.Add(hello, challenge, wire(&berthv1.InitClientMessage{Msg: &berthv1.InitClientMessage_Request{Request: wrong}}))

	inst := metadata.Instance{Name: "cp-0", Role: metadata.RoleControlPlane, Addresses: []netip.Addr{netip.MustParseAddr("192.0.2.10")}}
	srv, err := New(Config{
		Prover: cannedProver{}, Lock: lockTaken{}, Disk: beyondTheLock{}, Kubeadm: beyondTheLock{}, Recorder: beyondTheLock{},
		Prepared: statedisk.Prepared{UUID: "0f1e2d3c-4b5a-4978-8796-a5b4c3d2e1f0", Fresh: true, InitialKey: make([]byte, 32)},
		Self:     &metadata.Self{Instance: inst, UserData: metadata.UserData{ClusterName: "lab", InitSecretHash: cheapHash(secret, []byte("saltsaltsaltsalt"))}},
		Paths:    nodestate.Paths{State: "/var/lib/berth", KubernetesDir: "/etc/kubernetes", KubeletDir: "/var/lib/kubelet"},
		Timeout:  time.Second,
	})
	if err != nil {
		f.Fatal(err)
	}
	ctx := rpctest.PeerContext(f, netip.MustParseAddr("192.0.2.99"))

	f.Fuzz(func(t *testing.T, hello, challenge, request []byte) {
		var in []*berthv1.InitClientMessage
		var sent *berthv1.InitRequest
		for _, w := range [][]byte{hello, challenge, request} {
			m := &berthv1.InitClientMessage{}
			if proto.Unmarshal(w, m) != nil {
				break
			}
			in = append(in, m)
			if r := m.GetRequest(); r != nil && sent == nil {
				sent = r
			}
		}
		st := &rpctest.Stream[berthv1.InitClientMessage, berthv1.InitServerMessage]{Ctx: ctx, In: in}
		err := srv.Init(st)
		s, ok := status.FromError(err)
		switch {
		case err == nil:
			t.Fatal("an init succeeded with the node lock taken")
		case !ok:
			t.Fatalf("Init ended with %v, which is no gRPC status", err)
		case s.Code() == codes.PermissionDenied && s.Message() == "init refused":
		case s.Code() == codes.InvalidArgument && strings.HasPrefix(s.Message(), "init request refused: "),
			s.Code() == codes.FailedPrecondition && s.Message() == "node is already a cluster member (or joining)":
			if sent == nil || !bytes.Equal(sent.InitSecret, secret) {
				t.Fatalf("%v without the init secret", err)
			}
			for _, b := range [][]byte{sent.MasterSecret, sent.Salt, sent.InitSecret} {
				if len(b) >= 8 && (strings.Contains(s.Message(), string(b)) || strings.Contains(s.Message(), hex.EncodeToString(b))) {
					t.Fatalf("the refusal %q repeats a secret of the request", s.Message())
				}
			}
		default:
			t.Fatalf("Init ended with %v", err)
		}
	})
}
