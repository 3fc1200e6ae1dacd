package joinlab

import (
	"bytes"
	"cmp"
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/hex"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/backoff"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/internal/rpc"
	"github.com/berthlabs/berth/nodeagent/internal/joinclient"
	"github.com/berthlabs/berth/nodeagent/internal/joinservice"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
	"github.com/berthlabs/berth/nodeagent/internal/statedisk"
	"github.com/berthlabs/berth/test/clustertest"
	"github.com/berthlabs/berth/test/swtpm/swtpmtest"
)

type bidi = grpc.BidiStreamingClient[berthv1.JoinClientMessage, berthv1.JoinServerMessage]

// attack is one request of a hostile or broken node; the zero value (with a node) is an honest join.
type attack struct {
	node   *Node
	rejoin bool
	// renew asks for a renewed kubelet certificate instead of a ticket.
	renew bool
	disk  string
	// role and name are what the node says it is; its own by default.
	role, name string
	csr        []byte
	// evidence replaces the honest evidence made for the stream's nonce.
	evidence func(t *testing.T, nonce []byte) *berthv1.Evidence
	// first replaces the whole first message.
	first func(ev *berthv1.Evidence) *berthv1.JoinClientMessage
	// proof answers the challenge instead of the node's TPM.
	proof func(t *testing.T, c *berthv1.ActivationChallenge) []byte
	tls   *tls.Config
	// unboundedSend lifts the client's own send limit, so the server's limit is what refuses.
	unboundedSend bool
}

// openStream dials the lab's join service from n's address and opens a stream of the call.
func openStream(t *testing.T, ctx context.Context, lab *Lab, n *Node, call int, tlsCfg *tls.Config, opts ...grpc.CallOption) (bidi, error) {
	t.Helper()
	if tlsCfg == nil {
		var err error
		if tlsCfg, err = rpc.PinnedTLS(pki.SPKIPin(lab.JoinCA.Cert), nil); err != nil {
			t.Fatal(err)
		}
	}
	conn, err := grpc.NewClient(lab.JoinAddr, rpc.DialOptions(tlsCfg, n.Addr)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	client := berthv1.NewJoinServiceClient(conn)
	switch call {
	case callRejoin:
		return client.IssueRejoinTicket(ctx, opts...)
	case callRenew:
		return client.RenewKubeletCertificate(ctx, opts...)
	}
	return client.IssueJoinTicket(ctx, opts...)
}

// The join service's calls.
const (
	callJoin = iota
	callRejoin
	callRenew
)

// evidenceOn makes honest evidence of n for a stream.
func evidenceOn(t *testing.T, n *Node, st bidi) *berthv1.Evidence {
	t.Helper()
	nonce, err := rpc.StreamNonce(st.Context())
	if err != nil {
		t.Fatal(err)
	}
	ev, err := n.Prover.Evidence(nonce, clustertest.QuotedPCRs)
	if err != nil {
		t.Fatal(err)
	}
	return ev
}

// run sends the attack and returns the service's final answer.
func (a attack) run(t *testing.T, lab *Lab) (*berthv1.JoinServerMessage, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var opts []grpc.CallOption
	if a.unboundedSend {
		opts = append(opts, grpc.MaxCallSendMsgSize(4*rpc.MaxMessageSize))
	}
	call := callJoin
	switch {
	case a.rejoin:
		call = callRejoin
	case a.renew:
		call = callRenew
	}
	st, err := openStream(t, ctx, lab, a.node, call, a.tls, opts...)
	if err != nil {
		return nil, err
	}
	var ev *berthv1.Evidence
	if a.evidence != nil {
		nonce, err := rpc.StreamNonce(st.Context())
		if err != nil {
			t.Fatal(err)
		}
		ev = a.evidence(t, nonce)
	} else {
		ev = evidenceOn(t, a.node, st)
	}
	first := a.first
	if first == nil {
		disk := a.disk
		if disk == "" {
			disk = newUUID(t)
		}
		role, name := cmp.Or(a.role, string(a.node.Role)), cmp.Or(a.name, a.node.Name)
		first = func(ev *berthv1.Evidence) *berthv1.JoinClientMessage {
			if a.rejoin {
				return &berthv1.JoinClientMessage{Msg: &berthv1.JoinClientMessage_Rejoin{Rejoin: &berthv1.RejoinRequest{
					Evidence: ev, DiskUuid: disk, Role: role, NodeName: name}}}
			}
			csr := a.csr
			if csr == nil {
				csr = honestCSR(t, a.node)
			}
			if a.renew {
				return &berthv1.JoinClientMessage{Msg: &berthv1.JoinClientMessage_Renew{Renew: &berthv1.RenewRequest{
					Evidence: ev, DiskUuid: disk, KubeletCsr: csr, Role: role, NodeName: name}}}
			}
			return &berthv1.JoinClientMessage{Msg: &berthv1.JoinClientMessage_Join{Join: &berthv1.JoinRequest{
				Evidence: ev, DiskUuid: disk, KubeletCsr: csr, Role: role, NodeName: name}}}
		}
	}
	if err := st.Send(first(ev)); err != nil {
		_, rerr := st.Recv()
		return nil, rerr
	}
	msg, err := st.Recv()
	if err != nil {
		return nil, err
	}
	challenge := msg.GetChallenge()
	if challenge == nil {
		return msg, nil
	}
	var secret []byte
	if a.proof != nil {
		secret = a.proof(t, challenge)
	} else if secret, err = a.node.Prover.Activate(challenge); err != nil {
		t.Fatalf("honest TPM could not activate: %v", err)
	}
	if err := st.Send(&berthv1.JoinClientMessage{Msg: &berthv1.JoinClientMessage_Proof{Proof: &berthv1.ActivationProof{Secret: secret}}}); err != nil {
		_, rerr := st.Recv()
		return nil, rerr
	}
	return st.Recv()
}

func newUUID(t *testing.T) string {
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	h := hex.EncodeToString(b)
	return h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}

// honestCSR is the CSR an honest kubelet of n sends.
func honestCSR(t *testing.T, n *Node) []byte {
	return csrFor(t, "system:node:"+n.Name, []string{"system:nodes"}, []net.IP{n.Addr.AsSlice()}, nil)
}

// csrWithKey is the CSR an honest kubelet of n would send, on key.
func csrWithKey(t *testing.T, n *Node, key crypto.Signer) []byte {
	t.Helper()
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		Subject:     pkix.Name{CommonName: "system:node:" + n.Name, Organization: []string{"system:nodes"}},
		IPAddresses: []net.IP{n.Addr.AsSlice()},
	}, key)
	if err != nil {
		t.Fatal(err)
	}
	return der
}

// badSignature is der with its signature's last byte flipped, which keeps the DER well formed.
func badSignature(der []byte) []byte {
	der = bytes.Clone(der)
	der[len(der)-1] ^= 1
	return der
}

func rsaKey(t *testing.T, bits int) crypto.Signer {
	t.Helper()
	k, err := rsa.GenerateKey(rand.Reader, bits)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func ecKey(t *testing.T, c elliptic.Curve) crypto.Signer {
	t.Helper()
	k, err := ecdsa.GenerateKey(c, rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func ed25519Key(t *testing.T) crypto.Signer {
	t.Helper()
	_, k, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func csrFor(t *testing.T, cn string, org []string, ips []net.IP, dns []string) []byte {
	t.Helper()
	key, err := pki.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		Subject: pkix.Name{CommonName: cn, Organization: org}, IPAddresses: ips, DNSNames: dns,
	}, key)
	if err != nil {
		t.Fatal(err)
	}
	return der
}

func withPCR(p *policy.Policy, idx int, value byte) *policy.Policy {
	out := &policy.Policy{}
	for _, img := range p.Images {
		c := img
		c.PCRs = map[int][]byte{}
		for k, v := range img.PCRs {
			c.PCRs[k] = v
		}
		c.PCRs[idx] = bytes.Repeat([]byte{value}, 32)
		out.Images = append(out.Images, c)
	}
	return out
}

// TestMaliciousJoin sends the join service every kind of request a hostile or broken node could, and checks
// that each is refused with its own status code and that no answer carries a secret.
func TestMaliciousJoin(t *testing.T) {
	lab := New(t)
	worker := lab.AddNode("worker-1", metadata.RoleWorker)
	other := lab.AddNode("worker-2", metadata.RoleWorker)
	cp := lab.AddNode("cp-1", metadata.RoleControlPlane)
	stranger := lab.AddUnlistedNode("stranger")
	foreignCA := swtpmtest.NewCA(t)
	foreignTPM := lab.addForeignNode(t, foreignCA, "worker-foreign")
	// The connection attacks come from an address of their own: worker-1's last exchanges above may still
	// hold its two connections for their linger when they start, and the service would rightly refuse a third.
	connAttacker := lab.AddNode("worker-conn", metadata.RoleWorker)

	// A disk that worker-2 joined with for real: it belongs to worker-2's TPM from now on.
	claimed := newUUID(t)
	if msg, err := (attack{node: other, disk: claimed}).run(t, lab); err != nil || msg.GetJoinTicket() == nil {
		t.Fatalf("honest join of worker-2: %v", err)
	}

	zero := clustertest.ZeroPolicy("swtpm-zero", metadata.RoleControlPlane, metadata.RoleWorker)
	past := time.Now().Add(-time.Hour)
	expired := clustertest.ZeroPolicy("swtpm-zero-old", metadata.RoleControlPlane, metadata.RoleWorker)
	expired.Images[0].Expires = &past
	garbage := func(t *testing.T, _ *berthv1.ActivationChallenge) []byte { return bytes.Repeat([]byte{7}, 32) }
	tls12, err := rpc.PinnedTLS(pki.SPKIPin(lab.JoinCA.Cert), nil)
	if err != nil {
		t.Fatal(err)
	}
	tls12.MinVersion, tls12.MaxVersion = tls.VersionTLS12, tls.VersionTLS12

	cases := []struct {
		name    string
		attack  attack
		policy  *policy.Policy
		code    codes.Code
		message string
	}{
		{name: "PCR differs from every allowed image", attack: attack{node: worker}, policy: withPCR(zero, 9, 0xab),
			code: codes.PermissionDenied, message: "PCR 9"},
		{name: "image not allowed for the role", attack: attack{node: worker},
			policy: clustertest.ZeroPolicy("cp-only", metadata.RoleControlPlane), code: codes.PermissionDenied, message: "worker"},
		{name: "policy entry expired", attack: attack{node: worker}, policy: expired, code: codes.PermissionDenied, message: "expired"},
		{name: "empty policy", attack: attack{node: worker}, policy: &policy.Policy{}, code: codes.PermissionDenied},
		{name: "quote relayed from another connection", code: codes.Unauthenticated, message: "nonce",
			attack: attack{node: worker, evidence: func(t *testing.T, _ []byte) *berthv1.Evidence {
				// The evidence is made for a connection that is open at the same time, as a relaying party would.
				ctx, cancel := context.WithCancel(context.Background())
				t.Cleanup(cancel)
				st, err := openStream(t, ctx, lab, worker, callJoin, nil)
				if err != nil {
					t.Fatal(err)
				}
				return evidenceOn(t, worker, st)
			}}},
		{name: "stale quote replayed from a closed connection", code: codes.Unauthenticated, message: "nonce",
			attack: attack{node: worker, evidence: func(t *testing.T, _ []byte) *berthv1.Evidence {
				ctx, cancel := context.WithCancel(context.Background())
				st, err := openStream(t, ctx, lab, worker, callJoin, nil)
				if err != nil {
					t.Fatal(err)
				}
				ev := evidenceOn(t, worker, st)
				cancel()
				return ev
			}}},
		{name: "attestation key not in the EK's TPM", code: codes.Unauthenticated, message: "credential activation",
			attack: attack{node: worker, evidence: func(t *testing.T, nonce []byte) *berthv1.Evidence {
				ev, err := worker.Prover.Evidence(nonce, clustertest.QuotedPCRs)
				if err != nil {
					t.Fatal(err)
				}
				donor, err := other.Prover.Evidence(nonce, clustertest.QuotedPCRs)
				if err != nil {
					t.Fatal(err)
				}
				ev.EkCertificate = donor.EkCertificate
				return ev
			}, proof: func(t *testing.T, c *berthv1.ActivationChallenge) []byte {
				// Neither TPM holds both keys: whatever either recovers is not the secret.
				if s, err := worker.Prover.Activate(c); err == nil {
					return s
				}
				if s, err := other.Prover.Activate(c); err == nil {
					return s
				}
				return bytes.Repeat([]byte{1}, 32)
			}}},
		{name: "wrong activation proof", attack: attack{node: worker, proof: garbage}, code: codes.Unauthenticated, message: "credential activation"},
		{name: "EK certificate from an unknown CA", attack: attack{node: foreignTPM}, code: codes.Unauthenticated, message: "EK root"},
		{name: "quote signature forged", code: codes.Unauthenticated, message: "quote",
			attack: attack{node: worker, evidence: func(t *testing.T, nonce []byte) *berthv1.Evidence {
				ev, err := worker.Prover.Evidence(nonce, clustertest.QuotedPCRs)
				if err != nil {
					t.Fatal(err)
				}
				ev.QuoteSignature = bytes.Clone(ev.QuoteSignature)
				ev.QuoteSignature[len(ev.QuoteSignature)-1] ^= 1
				return ev
			}}},
		// Refused before its TLS handshake: the stranger's connection is closed unread.
		{name: "no instance record for the address", attack: attack{node: stranger}, code: codes.Unavailable},
		{name: "node that says it is another node (a source-NAT load balancer)", attack: attack{node: worker, name: "worker-2"},
			code: codes.PermissionDenied, message: "load balancer"},
		{name: "rejoin as a control-plane node", attack: attack{node: worker, rejoin: true, role: "control-plane"},
			code: codes.PermissionDenied, message: "instance record says \"worker\""},
		{name: "renewal in a control-plane node's name", attack: attack{node: worker, renew: true, name: "cp-1"},
			code: codes.PermissionDenied, message: "load balancer"},
		{name: "CSR with an oversized RSA key", attack: attack{node: worker, csr: csrWithKey(t, worker, rsaKey(t, 4104))},
			code: codes.InvalidArgument, message: "RSA key of 4104 bits"},
		{name: "CSR with an RSA key too small", attack: attack{node: worker, csr: csrWithKey(t, worker, rsaKey(t, 1024))},
			code: codes.InvalidArgument, message: "RSA key of 1024 bits"},
		{name: "CSR with an Ed25519 key", attack: attack{node: worker, csr: csrWithKey(t, worker, ed25519Key(t))},
			code: codes.InvalidArgument, message: "ed25519"},
		{name: "CSR on the P-224 curve", attack: attack{node: worker, csr: csrWithKey(t, worker, ecKey(t, elliptic.P224()))},
			code: codes.InvalidArgument, message: "P-224"},
		{name: "CSR whose signature does not verify", attack: attack{node: worker, csr: badSignature(honestCSR(t, worker))},
			code: codes.PermissionDenied, message: "signature"},
		{name: "CSR for another node's name", code: codes.PermissionDenied, message: "CN",
			attack: attack{node: worker, csr: csrFor(t, "system:node:worker-2", []string{"system:nodes"}, []net.IP{worker.Addr.AsSlice()}, nil)}},
		{name: "CSR with an extra DNS SAN", code: codes.PermissionDenied, message: "DNS",
			attack: attack{node: worker, csr: csrFor(t, "system:node:worker-1", []string{"system:nodes"}, []net.IP{worker.Addr.AsSlice()}, []string{"kubernetes.default"})}},
		{name: "CSR with an extra IP SAN", code: codes.PermissionDenied, message: "IP SANs",
			attack: attack{node: worker, csr: csrFor(t, "system:node:worker-1", []string{"system:nodes"}, []net.IP{worker.Addr.AsSlice(), net.IPv4(10, 0, 0, 1)}, nil)}},
		{name: "CSR asking for system:masters", code: codes.PermissionDenied, message: "system:masters",
			attack: attack{node: worker, csr: csrFor(t, "system:node:worker-1", []string{"system:nodes", "system:masters"}, []net.IP{worker.Addr.AsSlice()}, nil)}},
		{name: "CSR that does not parse", attack: attack{node: worker, csr: []byte("not a CSR")}, code: codes.InvalidArgument, message: "CSR"},
		{name: "worker asking for control-plane material", attack: attack{node: worker, role: "control-plane"},
			code: codes.PermissionDenied, message: "instance record says \"worker\""},
		{name: "disk id that is not a UUID", attack: attack{node: worker, disk: "not-a-uuid"}, code: codes.InvalidArgument, message: "disk id"},
		{name: "disk id aiming at another key label", attack: attack{node: worker, disk: "../measurement-secret"}, code: codes.InvalidArgument, message: "disk id"},
		{name: "disk id in a non-canonical form", attack: attack{node: worker, disk: strings.ToUpper(newUUID(t))}, code: codes.InvalidArgument, message: "disk id"},
		{name: "join with a disk keyed to another TPM", attack: attack{node: worker, disk: claimed}, code: codes.PermissionDenied, message: "another TPM"},
		{name: "rejoin for a disk first keyed to another TPM", attack: attack{node: worker, rejoin: true, disk: claimed},
			code: codes.PermissionDenied, message: "another TPM"},
		{name: "rejoin for a disk that never joined", attack: attack{node: worker, rejoin: true}, code: codes.FailedPrecondition, message: "never joined"},
		{name: "rejoin request on the join call", code: codes.InvalidArgument, message: "join request",
			attack: attack{node: worker, first: func(ev *berthv1.Evidence) *berthv1.JoinClientMessage {
				return &berthv1.JoinClientMessage{Msg: &berthv1.JoinClientMessage_Rejoin{Rejoin: &berthv1.RejoinRequest{
					Evidence: ev, DiskUuid: claimed, Role: "worker", NodeName: worker.Name}}}
			}}},
		{name: "request without evidence", code: codes.InvalidArgument, message: "no evidence",
			attack: attack{node: worker, first: func(*berthv1.Evidence) *berthv1.JoinClientMessage {
				return &berthv1.JoinClientMessage{Msg: &berthv1.JoinClientMessage_Join{Join: &berthv1.JoinRequest{
					DiskUuid: newUUID(t), KubeletCsr: honestCSR(t, worker), Role: "worker", NodeName: worker.Name}}}
			}}},
		{name: "oversized message", code: codes.ResourceExhausted,
			attack: attack{node: worker, csr: bytes.Repeat([]byte{0x30}, rpc.MaxMessageSize+1), unboundedSend: true}},
		{name: "TLS 1.2 client", attack: attack{node: worker, tls: tls12}, code: codes.Unavailable, message: "protocol version"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if tc.policy != nil {
				lab.Policy.Set(tc.policy)
				defer lab.Policy.Set(zero)
			}
			msg, err := tc.attack.run(t, lab)
			if err == nil {
				t.Fatalf("accepted: %v", msg)
			}
			st := status.Convert(err)
			if st.Code() != tc.code || !strings.Contains(st.Message(), tc.message) {
				t.Fatal(lab.Logs.Logf("refused with %s %q, want %s containing %q", st.Code(), st.Message(), tc.code, tc.message))
			}
			lab.assertNoSecret(t, st.Message())
		})
	}

	t.Run("repeated join with a fresh disk replaces the first", func(t *testing.T) {
		first, second := newUUID(t), newUUID(t)
		for _, disk := range []string{first, second} {
			if msg, err := (attack{node: worker, disk: disk}).run(t, lab); err != nil || msg.GetJoinTicket() == nil {
				t.Fatalf("join with disk %s: %v", disk, err)
			}
		}
		_, err := (attack{node: worker, rejoin: true, disk: first}).run(t, lab)
		if st := status.Convert(err); st.Code() != codes.FailedPrecondition || !strings.Contains(st.Message(), "never joined") {
			t.Fatalf("rejoin for the replaced disk: %v, want it unknown", err)
		}
		if msg, err := (attack{node: worker, rejoin: true, disk: second}).run(t, lab); err != nil || msg.GetRejoinTicket() == nil {
			t.Fatalf("rejoin for the current disk: %v", err)
		}
		ctx := context.Background()
		disks, err := lab.Kube.CoreV1().ConfigMaps(joinservice.Namespace).List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		tokens, err := lab.Kube.CoreV1().Secrets(joinservice.Namespace).List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for what, n := range map[string]int{"disk records": countFor(disks.Items, worker.Name), "bootstrap tokens": countFor(tokens.Items, worker.Name)} {
			if n != 1 {
				t.Errorf("worker-1 has %d %s after joining again, want 1", n, what)
			}
		}
	})
	lab.connectionAttacks(t, connAttacker)
	lab.ticketAttacks(t)
	lab.initAttacks(t)

	t.Run("control-plane files go only to control-plane nodes", func(t *testing.T) {
		msg, err := (attack{node: cp}).run(t, lab)
		if err != nil || len(msg.GetJoinTicket().GetControlPlaneFiles()) == 0 {
			t.Fatalf("control-plane join: files %v, err %v", msg.GetJoinTicket().GetControlPlaneFiles(), err)
		}
		if s := msg.GetJoinTicket().GetClusterSecrets(); s == nil || !bytes.Equal(s.MasterSecret, lab.Master) {
			t.Fatal("a control-plane ticket lacks the cluster secrets its join service needs")
		}
		msg, err = (attack{node: worker}).run(t, lab)
		if err != nil || msg.GetJoinTicket() == nil || len(msg.GetJoinTicket().ControlPlaneFiles) != 0 {
			t.Fatalf("worker join: %v, %v", msg, err)
		}
		if msg.GetJoinTicket().GetClusterSecrets() != nil {
			t.Fatal("a worker received the cluster secrets")
		}
	})

	t.Run("agent refuses a join service not signed by the pinned CA", func(t *testing.T) {
		impostor := newImpostor(t, lab)
		n := lab.AddNode("worker-3", metadata.RoleWorker)
		logs := &clustertest.SafeBuffer{}
		client := joinclient.New(joinclient.Config{
			Metadata: impostor.metadataFor(n), Prover: n.Prover, Disk: n.Disk, Lock: &nodestate.Lock{},
			Kubeadm: &Kubeadm{}, Paths: n.Paths, LocalAddr: n.Addr,
			Backoff: backoff.Policy{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond},
			Logger:  slog.New(slog.NewTextHandler(logs, nil)),
		})
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, err := client.Join(ctx, statedisk.Prepared{UUID: newUUID(t), Fresh: true, InitialKey: make([]byte, 32)})
		if err == nil {
			t.Fatal("joined an impostor")
		}
		if !strings.Contains(logs.String(), "not signed by the pinned join CA") {
			t.Fatalf("the agent does not say why it refused the service: %v\n%s", err, logs.String())
		}
		if impostor.requests() != 0 {
			t.Fatal("the agent sent a request to the impostor")
		}
	})
}

// assertNoSecret fails when text contains the master secret, the salt, the CA key or any derived disk key
// in any encoding the service could have used.
func (l *Lab) assertNoSecret(t *testing.T, text string) {
	t.Helper()
	secrets := [][]byte{l.Master, l.Salt}
	if key, err := l.KubeCA.KeyPEM(); err == nil {
		secrets = append(secrets, key)
	}
	for _, s := range secrets {
		for _, enc := range []string{string(s), hex.EncodeToString(s), base64.StdEncoding.EncodeToString(s), base64.RawURLEncoding.EncodeToString(s)} {
			if len(enc) > 0 && strings.Contains(text, enc) {
				t.Fatalf("answer leaks a secret: %q", text)
			}
		}
	}
	if strings.Contains(text, "PRIVATE KEY") {
		t.Fatalf("answer leaks a key: %q", text)
	}
}

func (l *Lab) addForeignNode(t testing.TB, other *swtpmtest.CA, name string) *Node {
	t.Helper()
	saved := l.EKCA
	l.EKCA = other
	defer func() { l.EKCA = saved }()
	return l.AddNode(name, metadata.RoleWorker)
}

// countFor counts the objects that name node as their instance.
func countFor[T any, P interface {
	*T
	GetAnnotations() map[string]string
}](items []T, node string) int {
	n := 0
	for i := range items {
		if P(&items[i]).GetAnnotations()["berth.dev/instance-name"] == node {
			n++
		}
	}
	return n
}
