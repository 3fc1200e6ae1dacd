package joinlab

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/initclient"
	"github.com/berthlabs/berth/internal/initsecret"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/repotest"
	"github.com/berthlabs/berth/internal/rpc"
	"github.com/berthlabs/berth/nodeagent/internal/initserver"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
	"github.com/berthlabs/berth/test/clustertest"
)

// initTarget is a fresh control-plane node of the lab running its init server.
type initTarget struct {
	addr    string
	secret  string
	logs    *clustertest.SafeBuffer
	kubeadm *Kubeadm
}

func (l *Lab) startInitServer(t *testing.T, name string) *initTarget {
	t.Helper()
	n := l.AddNode(name, metadata.RoleControlPlane)
	prepared, err := n.Disk.Prepare(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	secret, err := initsecret.NewSecret()
	if err != nil {
		t.Fatal(err)
	}
	hash, err := initsecret.Hash([]byte(secret))
	if err != nil {
		t.Fatal(err)
	}
	it := &initTarget{secret: secret, logs: &clustertest.SafeBuffer{}, kubeadm: &Kubeadm{KubernetesDir: n.Paths.KubernetesDir}}
	srv, err := initserver.New(initserver.Config{
		Prover: n.Prover, Lock: &nodestate.Lock{}, Disk: n.Disk, Prepared: prepared,
		Self: &metadata.Self{Instance: metadata.Instance{Name: n.Name, Role: n.Role, Addresses: []netip.Addr{n.Addr}},
			UserData: metadata.UserData{ClusterName: "lab", JoinPort: 1, JoinCAPin: pki.SPKIPin(l.JoinCA.Cert), InitSecretHash: hash}},
		Kubeadm: it.kubeadm, Recorder: it.kubeadm, Paths: n.Paths, Logger: slog.New(slog.NewTextHandler(it.logs, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	cert, err := initserver.ServerCredentials()
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", net.JoinHostPort(n.Addr.String(), "0"))
	if err != nil {
		t.Fatal(err)
	}
	// The init port's listener and limits, as the agent serves it.
	gs := grpc.NewServer(append(rpc.ServerOptions(cert), rpc.OneExchange())...)
	berthv1.RegisterInitServiceServer(gs, srv)
	go gs.Serve(initserver.Listen(lis, time.Minute, slog.New(slog.DiscardHandler)))
	t.Cleanup(gs.Stop)
	it.addr = lis.Addr().String()
	return it
}

// initWith runs the attested init client against the target with secret.
func (l *Lab) initWith(t *testing.T, it *initTarget, secret string) (*berthv1.InitResult, error) {
	t.Helper()
	kubeKey, err := l.KubeCA.KeyPEM()
	if err != nil {
		t.Fatal(err)
	}
	joinKey, err := l.JoinCA.KeyPEM()
	if err != nil {
		t.Fatal(err)
	}
	expected := map[int][]byte{}
	for _, i := range clustertest.QuotedPCRs {
		expected[i] = make([]byte, 32)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return initclient.Init(ctx, initclient.Config{
		Endpoint:     it.addr,
		Verifier:     attest.NewVerifier(attest.NewCertChain(l.EKCA.Roots(), l.EKCA.Intermediates(), nil)),
		ExpectedPCRs: expected,
		Request: &berthv1.InitRequest{
			InitSecret: []byte(secret), MasterSecret: l.Master, Salt: l.Salt,
			KubernetesCaCertificate: l.KubeCA.CertPEM(), KubernetesCaKey: kubeKey,
			JoinCaCertificate: l.JoinCA.CertPEM(), JoinCaKey: joinKey,
			ClusterName: "lab", KubernetesVersion: repotest.KubernetesVersion,
		},
	})
}

// serverStatus is the status the server sent, beneath the client's wrapping.
func serverStatus(t *testing.T, err error) *status.Status {
	t.Helper()
	var se interface{ GRPCStatus() *status.Status }
	if !errors.As(err, &se) {
		t.Fatalf("error without a gRPC status: %v", err)
	}
	return se.GRPCStatus()
}

// initAttacks are the init server's cases of TestMaliciousJoin.
func (l *Lab) initAttacks(t *testing.T) {
	it := l.startInitServer(t, "cp-init")
	t.Run("init with a wrong secret", func(t *testing.T) {
		_, err := l.initWith(t, it, it.secret+"x")
		if st := serverStatus(t, err); st.Code() != codes.PermissionDenied || st.Message() != "init refused" {
			t.Fatalf("refused with %s %q, want PermissionDenied \"init refused\" and no detail", st.Code(), st.Message())
		}
		if logs := it.logs.String(); logs != "" {
			t.Fatalf("the init server logged before the secret was checked:\n%s", logs)
		}
		if it.kubeadm.Inits != 0 {
			t.Fatal("kubeadm init ran for a wrong secret")
		}
	})
	t.Run("init while strangers hold silent streams and TLS connections", func(t *testing.T) {
		// Three addresses, each at the init port's limit of two connections.
		for i := range 3 {
			from := l.AddUnlistedNode(fmt.Sprintf("init-attacker-%d", i))
			silentInitStream(t, it.addr, from.Addr)
			idleTLS(t, it.addr, from.Addr)
		}
		if _, err := l.initWith(t, it, it.secret); err != nil {
			t.Fatalf("init with the right secret while strangers hold the port: %v", err)
		}
	})
	t.Run("second init after the lock", func(t *testing.T) {
		_, err := l.initWith(t, it, it.secret)
		st := serverStatus(t, err)
		if st.Code() != codes.FailedPrecondition {
			t.Fatalf("second init: %s %q, want FailedPrecondition", st.Code(), st.Message())
		}
		l.assertNoSecret(t, st.Message())
		if it.kubeadm.Inits != 1 {
			t.Fatalf("kubeadm init ran %d times, want once", it.kubeadm.Inits)
		}
	})
}

// silentInitStream opens an init stream from the loopback address from and sends nothing on it.
func silentInitStream(t *testing.T, addr string, from netip.Addr) {
	t.Helper()
	conn, err := grpc.NewClient(addr, rpc.DialOptions(&tls.Config{MinVersion: tls.VersionTLS13, InsecureSkipVerify: true}, from)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	if _, err := berthv1.NewInitServiceClient(conn).Init(ctx); err != nil {
		t.Fatal(err)
	}
}

// idleTLS completes a TLS handshake with addr from the loopback address from and then sends nothing.
func idleTLS(t *testing.T, addr string, from netip.Addr) {
	t.Helper()
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: from.AsSlice()}, Timeout: 5 * time.Second}
	c, err := tls.DialWithDialer(d, "tcp", addr, &tls.Config{MinVersion: tls.VersionTLS13, InsecureSkipVerify: true, NextProtos: []string{"h2"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
}
