package initserver

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/tls"
	"encoding/base64"
	"errors"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/clusterinfo"
	"github.com/berthlabs/berth/internal/initclient"
	"github.com/berthlabs/berth/internal/initsecret"
	"github.com/berthlabs/berth/internal/keys"
	"github.com/berthlabs/berth/internal/luks"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/podnetwork"
	"github.com/berthlabs/berth/internal/rpc"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
	"github.com/berthlabs/berth/nodeagent/internal/statedisk"
	"github.com/berthlabs/berth/test/swtpm/swtpmtest"
)

// quotedPCRs are what the tests expect: a fresh swtpm has them all zero.
var quotedPCRs = []int{0, 4, 7, 9, 11}

var progressLines = []string{
	"[init] Using Kubernetes version: v1.36.3",
	"[preflight] Running pre-flight checks",
	"[certs] Using existing ca certificate authority",
	"Your Kubernetes control-plane has initialized successfully!",
}

const fakeAdminConf = "apiVersion: v1\nkind: Config\nclusters:\n- name: lab\n  cluster:\n    server: https://192.0.2.10:6443\n"

// nodeAddr is the instance record's address: init refuses loopback, and kubeadm is faked, so nothing
// connects to it.
var nodeAddr = netip.MustParseAddr("192.0.2.10")

// fixture is what every node of a test shares: the EK CA, one swtpm, the init secret and the cluster's CAs.
type fixture struct {
	ekCA       *swtpmtest.CA
	prover     *attest.Prover
	verifier   *attest.Verifier
	secret     []byte
	hash       string
	kubeCA     *pki.CA
	joinCA     *pki.CA
	joinPolicy []byte
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	if _, err := exec.LookPath("cryptsetup"); err != nil {
		t.Fatal("cryptsetup not found: run make deps")
	}
	f := &fixture{ekCA: swtpmtest.NewCA(t)}
	tpm, err := attest.OpenTPM(f.ekCA.NewTPM(t).Device())
	if err != nil {
		t.Fatal(err)
	}
	if f.prover, err = attest.NewProver(tpm); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.prover.Close() })
	f.verifier = attest.NewVerifier(attest.NewCertChain(f.ekCA.Roots(), f.ekCA.Intermediates(), nil))
	s, err := initsecret.NewSecret()
	if err != nil {
		t.Fatal(err)
	}
	f.secret = []byte(s)
	if f.hash, err = initsecret.Hash(f.secret); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	if f.kubeCA, err = pki.NewCA("kubernetes", now, 24*time.Hour); err != nil {
		t.Fatal(err)
	}
	if f.joinCA, err = pki.NewCA("berth-join-ca", now, 24*time.Hour); err != nil {
		t.Fatal(err)
	}
	f.joinPolicy = []byte("images:\n- name: swtpm-zero\n  roles: [control-plane, worker]\n  pcrs:\n    \"9\": \"" +
		strings.Repeat("00", 32) + "\"\n")
	return f
}

// request is a valid init request with new master secret and salt.
func (f *fixture) request(t *testing.T) *berthv1.InitRequest {
	t.Helper()
	master, err := keys.NewSecret()
	if err != nil {
		t.Fatal(err)
	}
	salt, err := keys.NewSecret()
	if err != nil {
		t.Fatal(err)
	}
	kubeKey, err := f.kubeCA.KeyPEM()
	if err != nil {
		t.Fatal(err)
	}
	joinKey, err := f.joinCA.KeyPEM()
	if err != nil {
		t.Fatal(err)
	}
	return &berthv1.InitRequest{
		InitSecret:              f.secret,
		MasterSecret:            master,
		Salt:                    salt,
		KubernetesCaCertificate: f.kubeCA.CertPEM(),
		KubernetesCaKey:         kubeKey,
		JoinCaCertificate:       f.joinCA.CertPEM(),
		JoinCaKey:               joinKey,
		ClusterName:             "lab",
		KubernetesVersion:       "v1.36.3",
		JoinPolicy:              f.joinPolicy,
	}
}

func expectedPCRs() map[int][]byte {
	m := map[int][]byte{}
	for _, i := range quotedPCRs {
		m[i] = make([]byte, 32)
	}
	return m
}

// node is one machine under test: an init server on its own port with a real LUKS2 state disk.
type node struct {
	srv      *Server
	addr     string
	logs     *safeBuffer
	lock     *nodestate.Lock
	kubeadm  *recorder
	prover   *countingProver
	volume   *luks.Volume
	prepared statedisk.Prepared
	paths    nodestate.Paths
}

type nodeOption func(*Config)

func (f *fixture) newNode(t *testing.T, opts ...nodeOption) *node {
	t.Helper()
	dir := t.TempDir()
	img := filepath.Join(dir, "state.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 32<<20); err != nil {
		t.Fatal(err)
	}
	n := &node{logs: &safeBuffer{}, lock: &nodestate.Lock{}, prover: &countingProver{p: f.prover}}
	n.volume = luks.New(img, nil)
	disk := statedisk.New(n.volume, nil)
	var err error
	if n.prepared, err = disk.Prepare(context.Background()); err != nil {
		t.Fatal(err)
	}
	n.paths = nodestate.Paths{State: filepath.Join(dir, "state"), KubernetesDir: filepath.Join(dir, "etc-kubernetes"),
		KubeletDir: filepath.Join(dir, "var-lib-kubelet")}
	n.kubeadm = &recorder{paths: n.paths}
	cfg := Config{
		Prover:   n.prover,
		Lock:     n.lock,
		Disk:     disk,
		Prepared: n.prepared,
		Self: &metadata.Self{
			Instance: metadata.Instance{Name: "cp-0", Role: metadata.RoleControlPlane, Addresses: []netip.Addr{nodeAddr}},
			UserData: metadata.UserData{ClusterName: "lab", JoinPort: 9443, InitSecretHash: f.hash},
		},
		Kubeadm:  n.kubeadm,
		Recorder: n.kubeadm,
		Paths:    n.paths,
		Timeout:  20 * time.Second,
		Logger:   slog.New(slog.NewTextHandler(n.logs, nil)),
	}
	for _, o := range opts {
		o(&cfg)
	}
	if n.srv, err = New(cfg); err != nil {
		t.Fatal(err)
	}
	cert, err := ServerCredentials()
	if err != nil {
		t.Fatal(err)
	}
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	n.addr = inner.Addr().String()
	// As the agent serves it, but every client here comes from one address.
	lis := rpc.Admit(inner, rpc.AdmitConfig{Slots: 8, PerAddress: 8, Exchange: time.Minute})
	gs := grpc.NewServer(append(rpc.ServerOptions(cert), rpc.OneExchange())...)
	berthv1.RegisterInitServiceServer(gs, n.srv)
	go gs.Serve(lis)
	t.Cleanup(gs.Stop)
	return n
}

// idle waits until no Init is running, so that a stream the client abandoned has been torn down.
func (n *node) idle() {
	n.srv.slot <- struct{}{}
	<-n.srv.slot
}

func (n *node) client(f *fixture, req *berthv1.InitRequest, lines *[]string) initclient.Config {
	return initclient.Config{
		Endpoint:     n.addr,
		Verifier:     f.verifier,
		ExpectedPCRs: expectedPCRs(),
		Request:      req,
		Progress:     func(l string) { *lines = append(*lines, l) },
		Timeout:      time.Minute,
	}
}

// checkUntouched asserts that the node was not changed: lock free, kubeadm never run, disk still fresh.
func (n *node) checkUntouched(t *testing.T) {
	t.Helper()
	if o := n.lock.Owner(); o != "" {
		t.Errorf("node lock taken by %q", o)
	}
	if runs := n.kubeadm.count(); runs != 0 {
		t.Errorf("kubeadm init ran %d times", runs)
	}
	if _, err := n.volume.KeySlot(context.Background(), n.prepared.InitialKey); err != nil {
		t.Errorf("state disk no longer opens with its initial key: %v", err)
	}
	select {
	case <-n.srv.Done():
		t.Error("Done is closed")
	default:
	}
}

// checkRefused asserts the one answer a server gives before the init secret has passed.
func checkRefused(t *testing.T, err error) {
	t.Helper()
	var se interface{ GRPCStatus() *status.Status }
	if !errors.As(err, &se) {
		t.Fatalf("error %v carries no gRPC status", err)
	}
	if st := se.GRPCStatus(); st.Code() != codes.PermissionDenied || st.Message() != "init refused" {
		t.Fatalf("status %v %q, want PermissionDenied \"init refused\"", st.Code(), st.Message())
	}
}

func TestInit(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()

	t.Run("bad request, then init, then no second init", func(t *testing.T) {
		n := f.newNode(t)
		var lines []string
		bad := f.request(t)
		bad.MasterSecret = bad.MasterSecret[:8]
		_, err := initclient.Init(ctx, n.client(f, bad, &lines))
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "master secret is 8 bytes, want at least 32") {
			t.Fatalf("bad request: error %v, want InvalidArgument naming the master secret", err)
		}
		// Checking the request changes nothing, so the operator may fix it and try again.
		n.checkUntouched(t)
		if logs := n.logs.String(); !strings.Contains(logs, "init request refused") || strings.Contains(logs, string(f.secret)) {
			t.Errorf("log after a bad request:\n%s", logs)
		}

		req := f.request(t)
		lines = nil
		res, err := initclient.Init(ctx, n.client(f, req, &lines))
		if err != nil {
			t.Fatalf("init: %v\n%s", err, n.logs)
		}
		wantID, err := keys.ClusterIDOf(req.MasterSecret, req.Salt)
		if err != nil {
			t.Fatal(err)
		}
		if string(res.Kubeconfig) != fakeAdminConf || res.ClusterId != wantID || res.ApiServerEndpoint != "192.0.2.10:6443" {
			t.Errorf("result: cluster %q endpoint %q kubeconfig %q; want cluster %q", res.ClusterId, res.ApiServerEndpoint, res.Kubeconfig, wantID)
		}
		if !slices.Equal(lines, progressLines) {
			t.Errorf("progress lines %q, want %q", lines, progressLines)
		}
		for _, l := range progressLines {
			if !strings.Contains(n.logs.String(), l) {
				t.Errorf("progress line %q not logged", l)
			}
		}
		checkDiskKeyed(t, n, req)
		checkFiles(t, f, n, req, wantID)
		// The record keeps the settings as the request gave them, and the join CA an import of the cluster
		// finds nowhere else.
		want := clusterinfo.Info{ID: wantID, Name: req.ClusterName, Init: clusterinfo.InitSettings{
			KubernetesVersion: req.KubernetesVersion, PodSubnet: req.PodSubnet, ServiceSubnet: req.ServiceSubnet,
			PodNetwork: "none", APIServerEndpoint: "192.0.2.10:6443", JoinCACertificate: string(req.JoinCaCertificate)}}
		if !slices.Equal(n.kubeadm.records, []clusterinfo.Info{want}) {
			t.Errorf("cluster records published: %+v, want %+v", n.kubeadm.records, want)
		}
		// A request without a pod network is one from a provider before them: those clusters got none.
		if len(n.kubeadm.networks) != 0 {
			t.Errorf("pod networks installed: %q, want none", n.kubeadm.networks)
		}
		select {
		case <-n.srv.Done():
		default:
			t.Fatal("Done is not closed after init")
		}
		if r := n.srv.Result(); r == nil || r.State.ClusterID != wantID || !bytes.Equal(r.Secrets.MasterSecret, req.MasterSecret) ||
			!r.KubernetesCA.Cert.Equal(f.kubeCA.Cert) {
			t.Errorf("Result() = %+v", r)
		}
		for _, secret := range [][]byte{f.secret, req.MasterSecret, req.Salt} {
			if bytes.Contains([]byte(n.logs.String()), secret) {
				t.Error("a secret appears in the log")
			}
		}

		_, err = initclient.Init(ctx, n.client(f, f.request(t), &lines))
		if status.Code(err) != codes.FailedPrecondition {
			t.Fatalf("second init: error %v, want FailedPrecondition", err)
		}
		if runs := n.kubeadm.count(); runs != 1 {
			t.Errorf("kubeadm init ran %d times, want 1", runs)
		}
	})

	t.Run("join client holds the node lock", func(t *testing.T) {
		n := f.newNode(t)
		if !n.lock.TryLock(nodestate.OwnerJoin) {
			t.Fatal("fresh lock taken")
		}
		var lines []string
		_, err := initclient.Init(ctx, n.client(f, f.request(t), &lines))
		if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "already a cluster member") {
			t.Fatalf("error %v, want FailedPrecondition", err)
		}
		if runs := n.kubeadm.count(); runs != 0 {
			t.Errorf("kubeadm init ran %d times", runs)
		}
		if _, err := n.volume.KeySlot(ctx, n.prepared.InitialKey); err != nil {
			t.Errorf("the init server touched the disk of a joining node: %v", err)
		}
	})

	t.Run("the cluster record cannot be published", func(t *testing.T) {
		n := f.newNode(t)
		n.kubeadm.recordFail = errors.New("the API server went away")
		var lines []string
		_, err := initclient.Init(ctx, n.client(f, f.request(t), &lines))
		if status.Code(err) != codes.Internal || !strings.Contains(err.Error(), "the API server went away") {
			t.Fatalf("error %v, want Internal naming why the record failed", err)
		}
		if _, err := nodestate.Read(n.paths.State); !errors.Is(err, nodestate.ErrNoState) {
			t.Errorf("membership recorded although the cluster record is missing: %v", err)
		}
	})

	t.Run("the certificate validity", func(t *testing.T) {
		n := f.newNode(t)
		for _, seconds := range []int64{-1, 60, 11 * 365 * 24 * 60 * 60} {
			bad := f.request(t)
			bad.CertificateValiditySeconds = seconds
			var lines []string
			_, err := initclient.Init(ctx, n.client(f, bad, &lines))
			if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "certificate validity") {
				t.Errorf("%d seconds: %v, want InvalidArgument naming the certificate validity", seconds, err)
			}
		}
		n.checkUntouched(t)
	})

	t.Run("the pod network", func(t *testing.T) {
		n := f.newNode(t)
		bad := f.request(t)
		bad.PodNetwork = "calico"
		var lines []string
		_, err := initclient.Init(ctx, n.client(f, bad, &lines))
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), `pod network "calico" is not one Berth installs (flannel, none)`) {
			t.Fatalf("error %v, want InvalidArgument naming the pod networks Berth installs", err)
		}
		n.checkUntouched(t)

		n.kubeadm.networkFail = errors.New("the API server went away")
		req := f.request(t)
		req.PodNetwork = podnetwork.Flannel
		lines = nil
		_, err = initclient.Init(ctx, n.client(f, req, &lines))
		if status.Code(err) != codes.Internal || !strings.Contains(err.Error(), "the API server went away") {
			t.Fatalf("error %v, want Internal naming why the pod network failed", err)
		}
		if want := []string{"flannel 10.244.0.0/16"}; !slices.Equal(n.kubeadm.networks, want) {
			t.Errorf("pod networks installed: %q, want %q (the request's plugin, kubeadm's default subnet)", n.kubeadm.networks, want)
		}
		if !slices.Contains(lines, "installing the pod network: flannel") {
			t.Errorf("progress lines %q do not say that the pod network is being installed", lines)
		}
		if _, err := nodestate.Read(n.paths.State); !errors.Is(err, nodestate.ErrNoState) {
			t.Errorf("membership recorded although the pod network is missing: %v", err)
		}
	})

	t.Run("a node waiting for init is recognized", func(t *testing.T) {
		n := f.newNode(t)
		if ok, err := initclient.AwaitsInit(ctx, n.addr, 20*time.Second); !ok || err != nil {
			t.Errorf("AwaitsInit on a fresh node = %v, %v; want true", ok, err)
		}
		n.idle()
		n.checkUntouched(t)
		if ok, err := initclient.AwaitsInit(ctx, "127.0.0.1:1", 5*time.Second); ok || err == nil {
			t.Errorf("AwaitsInit where nothing listens = %v, %v; want false and why", ok, err)
		}
	})

	t.Run("kubeadm fails after the lock", func(t *testing.T) {
		n := f.newNode(t)
		n.kubeadm.fail = errors.New("[wait-control-plane] timed out")
		var lines []string
		_, err := initclient.Init(ctx, n.client(f, f.request(t), &lines))
		if status.Code(err) != codes.Internal || !strings.Contains(err.Error(), "half-initialized") ||
			!strings.Contains(err.Error(), "timed out") {
			t.Fatalf("error %v, want Internal saying the node is half-initialized and why", err)
		}
		if !strings.Contains(n.logs.String(), "half-initialized") {
			t.Errorf("failure not logged:\n%s", n.logs)
		}
		if n.lock.Owner() != nodestate.OwnerInit {
			t.Errorf("lock owner %q after a failed init, want it kept by init", n.lock.Owner())
		}
		_, err = initclient.Init(ctx, n.client(f, f.request(t), &lines))
		if status.Code(err) != codes.FailedPrecondition {
			t.Fatalf("init after a failed one: error %v, want FailedPrecondition", err)
		}
		if _, err := nodestate.Read(n.paths.State); !errors.Is(err, nodestate.ErrNoState) {
			t.Errorf("membership recorded after a failed init: %v", err)
		}
	})

	t.Run("client goes away during kubeadm init", func(t *testing.T) {
		n := f.newNode(t)
		n.kubeadm.hold = make(chan struct{})
		cctx, cancel := context.WithCancel(ctx)
		defer cancel()
		cfg := n.client(f, f.request(t), new([]string))
		cfg.Progress = func(string) { cancel() }
		if _, err := initclient.Init(cctx, cfg); status.Code(err) != codes.Canceled {
			t.Fatalf("error %v, want Canceled", err)
		}
		close(n.kubeadm.hold)
		select {
		case <-n.srv.Done():
		case <-time.After(30 * time.Second):
			t.Fatalf("init did not finish after the client left\n%s", n.logs)
		}
		if st, err := nodestate.Read(n.paths.State); err != nil || st.Via != nodestate.OwnerInit {
			t.Fatalf("node state %+v, %v", st, err)
		}
	})

	t.Run("refusals before the init secret", func(t *testing.T) {
		n := f.newNode(t, func(c *Config) { c.SlotWait = 100 * time.Millisecond })

		t.Run("wrong init secret", func(t *testing.T) {
			req := f.request(t)
			req.InitSecret = []byte("not-the-init-secret")
			_, err := initclient.Init(ctx, n.client(f, req, new([]string)))
			checkRefused(t, err)
			if n.prover.evidences.Load() != 0 {
				t.Error("the node quoted for a client that could not prove the init secret")
			}
		})

		// Whoever reads the node's user-data knows the hash, which passes the secret challenge; the init
		// secret in the request is still checked, after the attestation.
		t.Run("the hash but not the secret", func(t *testing.T) {
			st := rawStream(t, n.addr)
			f.admit(t, st, hashProof(t, f.hash), 7)
			msg, err := st.Recv()
			if err != nil || msg.GetEvidence() == nil {
				t.Fatalf("want evidence, got %v, %v", msg, err)
			}
			req := f.request(t)
			req.InitSecret = []byte("not-the-init-secret")
			if err := st.Send(&berthv1.InitClientMessage{Msg: &berthv1.InitClientMessage_Request{Request: req}}); err != nil {
				t.Fatal(err)
			}
			_, err = st.Recv()
			checkRefused(t, err)
		})

		t.Run("a client that skips or garbles the exchange", func(t *testing.T) {
			right := f.request(t)
			hello := func(pcrs ...uint32) *berthv1.InitClientMessage {
				return &berthv1.InitClientMessage{Msg: &berthv1.InitClientMessage_Hello{Hello: &berthv1.InitHello{Pcrs: pcrs}}}
			}
			request := &berthv1.InitClientMessage{Msg: &berthv1.InitClientMessage_Request{Request: right}}
			proof := func(mac []byte) *berthv1.InitClientMessage {
				return &berthv1.InitClientMessage{Msg: &berthv1.InitClientMessage_SecretProof{SecretProof: &berthv1.InitSecretProof{Mac: mac}}}
			}
			for _, tc := range []struct {
				name string
				send []*berthv1.InitClientMessage
				// afterChallenge sends these once the secret challenge has arrived.
				afterChallenge []*berthv1.InitClientMessage
				// afterEvidence says hello, proves the init secret and, once the evidence arrived, sends these.
				afterEvidence []*berthv1.InitClientMessage
			}{
				{name: "request with the right secret, no hello", send: []*berthv1.InitClientMessage{request}},
				{name: "empty message", send: []*berthv1.InitClientMessage{{}}},
				{name: "challenge first", send: []*berthv1.InitClientMessage{{Msg: &berthv1.InitClientMessage_Challenge{Challenge: &berthv1.ActivationChallenge{}}}}},
				{name: "hello without PCRs", send: []*berthv1.InitClientMessage{hello()}},
				{name: "hello with PCR 24", send: []*berthv1.InitClientMessage{hello(7, 24)}},
				{name: "hello with a PCR twice", send: []*berthv1.InitClientMessage{hello(7, 7)}},
				{name: "hello with 25 PCRs", send: []*berthv1.InitClientMessage{hello(slices.Repeat([]uint32{1}, 25)...)}},
				{name: "hello, then no proof", send: []*berthv1.InitClientMessage{hello(7)}, afterChallenge: []*berthv1.InitClientMessage{}},
				{name: "hello, then a wrong proof", send: []*berthv1.InitClientMessage{hello(7)},
					afterChallenge: []*berthv1.InitClientMessage{proof(bytes.Repeat([]byte{1}, 32))}},
				{name: "hello, then an empty proof", send: []*berthv1.InitClientMessage{hello(7)},
					afterChallenge: []*berthv1.InitClientMessage{proof(nil)}},
				{name: "hello, then the request with the right secret instead of the proof", send: []*berthv1.InitClientMessage{hello(7)},
					afterChallenge: []*berthv1.InitClientMessage{request}},
				{name: "request with the right secret instead of the challenge",
					afterEvidence: []*berthv1.InitClientMessage{request}},
				{name: "garbage challenge",
					afterEvidence: []*berthv1.InitClientMessage{{Msg: &berthv1.InitClientMessage_Challenge{Challenge: &berthv1.ActivationChallenge{
						Credential: []byte("garbage"), Secret: []byte("garbage")}}}}},
				{name: "proof, then the client stops sending", afterEvidence: []*berthv1.InitClientMessage{}},
			} {
				t.Run(tc.name, func(t *testing.T) {
					evidences := n.prover.evidences.Load()
					st := rawStream(t, n.addr)
					for _, m := range tc.send {
						if err := st.Send(m); err != nil {
							t.Fatal(err)
						}
					}
					if tc.afterChallenge != nil {
						msg, err := st.Recv()
						if err != nil || msg.GetSecretChallenge() == nil {
							t.Fatalf("want the secret challenge, got %v, %v", msg, err)
						}
						for _, m := range tc.afterChallenge {
							if err := st.Send(m); err != nil {
								t.Fatal(err)
							}
						}
					}
					if tc.afterEvidence != nil {
						f.admit(t, st, f.secretProof, 7)
						msg, err := st.Recv()
						if err != nil || msg.GetEvidence() == nil {
							t.Fatalf("want evidence, got %v, %v", msg, err)
						}
						for _, m := range tc.afterEvidence {
							if err := st.Send(m); err != nil {
								t.Fatal(err)
							}
						}
					}
					if err := st.CloseSend(); err != nil {
						t.Fatal(err)
					}
					_, err := st.Recv()
					checkRefused(t, err)
					if tc.afterEvidence == nil && n.prover.evidences.Load() != evidences {
						t.Error("the node quoted before the client proved the init secret")
					}
				})
			}
		})

		t.Run("second init while one is running", func(t *testing.T) {
			first := rawStream(t, n.addr)
			f.admit(t, first, f.secretProof, 7)
			if msg, err := first.Recv(); err != nil || msg.GetEvidence() == nil {
				t.Fatalf("want evidence, got %v, %v", msg, err)
			}
			cfg := n.client(f, f.request(t), new([]string))
			// Long enough for a first busy answer on a loaded machine: each attempt proves the init secret
			// (a memory-hard hash) before it waits for the slot.
			cfg.Timeout = 8 * time.Second
			busy := 0
			cfg.Busy = func(int, time.Duration) { busy++ }
			_, err := initclient.Init(ctx, cfg)
			if !rpc.IsBusy(err) || busy == 0 {
				t.Fatalf("error %v after %d busy answers, want busy until the client's timeout", err, busy)
			}
			// Ending the first stream with a message out of order gets its refusal only after the server
			// has let go of it.
			if err := first.Send(&berthv1.InitClientMessage{}); err != nil {
				t.Fatal(err)
			}
			_, err = first.Recv()
			checkRefused(t, err)
		})

		t.Run("measurements differ", func(t *testing.T) {
			activations := n.prover.activations.Load()
			cfg := n.client(f, f.request(t), new([]string))
			cfg.ExpectedPCRs[9] = bytes.Repeat([]byte{0x3d}, 32)
			_, err := initclient.Init(ctx, cfg)
			var me *initclient.MeasurementError
			if !errors.As(err, &me) || me.PCR != 9 || !bytes.Equal(me.Got, make([]byte, 32)) {
				t.Fatalf("error %v, want a MeasurementError for PCR 9", err)
			}
			if want := "PCR 9: expected " + strings.Repeat("3d", 32) + ", got " + strings.Repeat("00", 32); me.Error() != want {
				t.Errorf("message %q, want %q", me.Error(), want)
			}
			n.idle()
			if got := n.prover.activations.Load(); got != activations {
				t.Error("the client went on to challenge a node whose measurements differ")
			}
		})

		t.Run("EK certificate from an unknown CA", func(t *testing.T) {
			activations := n.prover.activations.Load()
			other := swtpmtest.NewCA(t)
			cfg := n.client(f, f.request(t), new([]string))
			cfg.Verifier = attest.NewVerifier(attest.NewCertChain(other.Roots(), other.Intermediates(), nil))
			if _, err := initclient.Init(ctx, cfg); !errors.Is(err, attest.ErrUntrusted) {
				t.Fatalf("error %v, want ErrUntrusted", err)
			}
			n.idle()
			if got := n.prover.activations.Load(); got != activations {
				t.Error("the client went on to challenge an untrusted TPM")
			}
		})

		n.idle()
		if logs := n.logs.String(); logs != "" {
			t.Errorf("the server logged before any init secret passed:\n%s", logs)
		}
		n.checkUntouched(t)
	})

	t.Run("no init secret hash in the user-data", func(t *testing.T) {
		n := f.newNode(t, func(c *Config) { c.Self.UserData.InitSecretHash = "" })
		before := n.logs.String()
		_, err := initclient.Init(ctx, n.client(f, f.request(t), new([]string)))
		checkRefused(t, err)
		n.idle()
		if after := n.logs.String(); after != before {
			t.Errorf("the server logged during a refused init:\n%s", strings.TrimPrefix(after, before))
		}
		n.checkUntouched(t)
	})

	t.Run("silent streams do not keep the client out", func(t *testing.T) {
		n := f.newNode(t)
		silent := []grpc.BidiStreamingClient[berthv1.InitClientMessage, berthv1.InitServerMessage]{rawStream(t, n.addr), rawStream(t, n.addr)}
		if _, err := initclient.Init(ctx, n.client(f, f.request(t), new([]string))); err != nil {
			t.Fatalf("init while two streams are held open without a hello: %v", err)
		}
		for _, st := range silent {
			_, err := st.Recv()
			checkRefused(t, err)
		}
	})

	t.Run("a client asks again while the node is busy", func(t *testing.T) {
		n := f.newNode(t, func(c *Config) { c.SlotWait = 100 * time.Millisecond })
		first := rawStream(t, n.addr)
		f.admit(t, first, f.secretProof, 7)
		if msg, err := first.Recv(); err != nil || msg.GetEvidence() == nil {
			t.Fatalf("want evidence, got %v, %v", msg, err)
		}
		busy := make(chan struct{}, 100)
		cfg := n.client(f, f.request(t), new([]string))
		cfg.Busy = func(int, time.Duration) { busy <- struct{}{} }
		done := make(chan error, 1)
		go func() {
			_, err := initclient.Init(ctx, cfg)
			done <- err
		}()
		<-busy
		// The first client gives up; the second gets the slot at its next attempt.
		if err := first.CloseSend(); err != nil {
			t.Fatal(err)
		}
		if err := <-done; err != nil {
			t.Fatalf("init after the node was busy: %v", err)
		}
	})

	t.Run("exchange timeout", func(t *testing.T) {
		n := f.newNode(t, func(c *Config) { c.Timeout = 200 * time.Millisecond })
		st := rawStream(t, n.addr)
		_, err := st.Recv()
		checkRefused(t, err)
		if logs := n.logs.String(); logs != "" {
			t.Errorf("the server logged on a timeout:\n%s", logs)
		}
	})
}

func checkDiskKeyed(t *testing.T, n *node, req *berthv1.InitRequest) {
	t.Helper()
	label, err := keys.DiskLabel(n.prepared.UUID)
	if err != nil {
		t.Fatal(err)
	}
	key, err := keys.Derive(req.MasterSecret, req.Salt, label, 32)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := n.volume.KeySlot(context.Background(), key); err != nil {
		t.Errorf("state disk does not open with the derived key: %v", err)
	}
	if _, err := n.volume.KeySlot(context.Background(), n.prepared.InitialKey); !errors.Is(err, luks.ErrWrongKey) {
		t.Errorf("state disk still opens with the initial key (error %v)", err)
	}
}

func checkFiles(t *testing.T, f *fixture, n *node, req *berthv1.InitRequest, clusterID string) {
	t.Helper()
	wantKey, err := f.kubeCA.KeyPEM()
	if err != nil {
		t.Fatal(err)
	}
	for _, file := range []struct {
		path string
		mode os.FileMode
		want []byte
	}{
		{filepath.Join(n.paths.PKIDir(), "ca.crt"), 0o644, f.kubeCA.CertPEM()},
		{filepath.Join(n.paths.PKIDir(), "ca.key"), 0o600, wantKey},
		{filepath.Join(n.paths.State, JoinPolicyFile), 0o600, f.joinPolicy},
		{filepath.Join(n.paths.State, KubeadmConfigFile), 0o600, nil},
	} {
		fi, err := os.Stat(file.path)
		if err != nil {
			t.Error(err)
			continue
		}
		if fi.Mode().Perm() != file.mode {
			t.Errorf("%s has mode %v, want %v", file.path, fi.Mode().Perm(), file.mode)
		}
		if got, _ := os.ReadFile(file.path); file.want != nil && !bytes.Equal(got, file.want) {
			t.Errorf("%s holds %q, want %q", file.path, got, file.want)
		}
	}
	runs := n.kubeadm.snapshot()
	if len(runs) != 1 {
		t.Fatalf("kubeadm init ran %d times", len(runs))
	}
	if !bytes.Equal(runs[0].ca, f.kubeCA.CertPEM()) {
		t.Error("ca.crt was not in place when kubeadm init ran")
	}
	for _, want := range []string{"name: cp-0", "advertiseAddress: 192.0.2.10", "clusterName: lab",
		"kubernetesVersion: v1.36.3", "certificatesDir: " + n.paths.PKIDir()} {
		if !strings.Contains(runs[0].config, want) {
			t.Errorf("kubeadm configuration lacks %q:\n%s", want, runs[0].config)
		}
	}

	st, err := nodestate.Read(n.paths.State)
	if err != nil {
		t.Fatal(err)
	}
	if st.ClusterID != clusterID || st.NodeName != "cp-0" || st.Role != string(metadata.RoleControlPlane) || st.Via != nodestate.OwnerInit {
		t.Errorf("node state %+v", st)
	}
	sec, err := nodestate.ReadSecrets(n.paths.State)
	if err != nil {
		t.Fatal(err)
	}
	joinKey, err := f.joinCA.KeyPEM()
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(sec.MasterSecret, req.MasterSecret) || !bytes.Equal(sec.Salt, req.Salt) ||
		!bytes.Equal(sec.JoinCACert, f.joinCA.CertPEM()) || !bytes.Equal(sec.JoinCAKey, joinKey) ||
		sec.APIServerEndpoint != "192.0.2.10:6443" || sec.KubernetesVersion != "v1.36.3" {
		t.Errorf("cluster secrets do not match the request (endpoint %q, version %q)", sec.APIServerEndpoint, sec.KubernetesVersion)
	}
}

// admit says hello to st asking for pcrs and answers the secret challenge with prove's proof for the
// stream's nonce.
func (f *fixture) admit(t *testing.T, st grpc.BidiStreamingClient[berthv1.InitClientMessage, berthv1.InitServerMessage],
	prove func(t *testing.T, c *berthv1.InitSecretChallenge, nonce []byte) []byte, pcrs ...uint32) {
	t.Helper()
	if err := st.Send(&berthv1.InitClientMessage{Msg: &berthv1.InitClientMessage_Hello{Hello: &berthv1.InitHello{Pcrs: pcrs}}}); err != nil {
		t.Fatal(err)
	}
	msg, err := st.Recv()
	if err != nil || msg.GetSecretChallenge() == nil {
		t.Fatalf("want the secret challenge, got %v, %v", msg, err)
	}
	nonce, err := rpc.StreamNonce(st.Context())
	if err != nil {
		t.Fatal(err)
	}
	mac := prove(t, msg.GetSecretChallenge(), nonce)
	if err := st.Send(&berthv1.InitClientMessage{Msg: &berthv1.InitClientMessage_SecretProof{SecretProof: &berthv1.InitSecretProof{Mac: mac}}}); err != nil {
		t.Fatal(err)
	}
}

// secretProof proves the fixture's init secret, as the init client does.
func (f *fixture) secretProof(t *testing.T, c *berthv1.InitSecretChallenge, nonce []byte) []byte {
	mac, err := initsecret.Proof(c.GetHashParameters(), int(c.GetHashLength()), f.secret, nonce)
	if err != nil {
		t.Fatal(err)
	}
	return mac
}

// hashProof proves knowledge of the hash encoded (not of the secret) by the construction init.proto
// describes: HMAC-SHA256 keyed with the hash, of the label and the nonce.
func hashProof(t *testing.T, encoded string) func(*testing.T, *berthv1.InitSecretChallenge, []byte) []byte {
	return func(t *testing.T, _ *berthv1.InitSecretChallenge, nonce []byte) []byte {
		key, err := base64.RawStdEncoding.DecodeString(encoded[strings.LastIndexByte(encoded, '$')+1:])
		if err != nil {
			t.Fatal(err)
		}
		m := hmac.New(sha256.New, key)
		m.Write([]byte("berth init admission\x00"))
		m.Write(nonce)
		return m.Sum(nil)
	}
}

func rawStream(t *testing.T, addr string) grpc.BidiStreamingClient[berthv1.InitClientMessage, berthv1.InitServerMessage] {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{
		MinVersion: tls.VersionTLS13, InsecureSkipVerify: true,
	})))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	st, err := berthv1.NewInitServiceClient(conn).Init(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// recorder stands in for kubeadm: it records what it was given, reports a few lines and writes the admin
// kubeconfig kubeadm would.
type recorder struct {
	paths nodestate.Paths
	fail  error
	// hold, if set, keeps init running after its first line until it is closed.
	hold chan struct{}

	// recordFail, if set, is what publishing the cluster record returns; networkFail, installing the pod
	// network.
	recordFail, networkFail error

	mu       sync.Mutex
	runs     []run
	records  []clusterinfo.Info
	networks []string
}

func (r *recorder) InstallPodNetwork(_ context.Context, plugin, podSubnet string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.networks = append(r.networks, plugin+" "+podSubnet)
	return r.networkFail
}

func (r *recorder) RecordCluster(_ context.Context, info clusterinfo.Info) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.records = append(r.records, info)
	return r.recordFail
}

type run struct {
	config string
	ca     []byte
}

func (r *recorder) Init(ctx context.Context, configPath string, progress func(string)) error {
	config, err := os.ReadFile(configPath)
	if err != nil {
		return err
	}
	ca, err := os.ReadFile(filepath.Join(r.paths.PKIDir(), "ca.crt"))
	if err != nil {
		return err
	}
	r.mu.Lock()
	r.runs = append(r.runs, run{config: string(config), ca: ca})
	r.mu.Unlock()
	for i, l := range progressLines {
		progress(l)
		if i == 0 && r.hold != nil {
			select {
			case <-r.hold:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
	}
	if r.fail != nil {
		return r.fail
	}
	return os.WriteFile(filepath.Join(r.paths.KubernetesDir, "admin.conf"), []byte(fakeAdminConf), 0o600)
}

func (r *recorder) Join(context.Context, string, func(string)) error {
	return errors.New("kubeadm join is not expected from the init server")
}

func (r *recorder) count() int { return len(r.snapshot()) }

func (r *recorder) snapshot() []run {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.runs)
}

// countingProver is the node's real prover, counting the quotes and credential activations it performed.
type countingProver struct {
	p                      *attest.Prover
	evidences, activations atomic.Int64
}

func (c *countingProver) Evidence(nonce []byte, pcrs []int) (*berthv1.Evidence, error) {
	c.evidences.Add(1)
	return c.p.Evidence(nonce, pcrs)
}

func (c *countingProver) Activate(ch *berthv1.ActivationChallenge) ([]byte, error) {
	c.activations.Add(1)
	return c.p.Activate(ch)
}

type safeBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *safeBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *safeBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
