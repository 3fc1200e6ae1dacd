package joinlab

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/backoff"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/rpc"
	"github.com/berthlabs/berth/nodeagent/internal/joinclient"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
	"github.com/berthlabs/berth/test/clustertest"
)

// tamperingService serves the lab's real join service with a certificate of the pinned join CA, and changes
// every join ticket with tamper on its way out: a join service on a compromised control-plane node.
func tamperingService(t *testing.T, lab *Lab, tamper func(*berthv1.JoinTicket)) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	intercept := grpc.StreamInterceptor(func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
		return h(srv, tamperingStream{ServerStream: ss, tamper: tamper})
	})
	srv := grpc.NewServer(append(rpc.ServerOptions(lab.ServerCert(lab.JoinCA)), intercept)...)
	berthv1.RegisterJoinServiceServer(srv, lab.Service)
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	return lis.Addr().String()
}

type tamperingStream struct {
	grpc.ServerStream
	tamper func(*berthv1.JoinTicket)
}

func (s tamperingStream) SendMsg(m any) error {
	if msg, ok := m.(*berthv1.JoinServerMessage); ok && msg.GetJoinTicket() != nil {
		s.tamper(msg.GetJoinTicket())
	}
	return s.ServerStream.SendMsg(m)
}

// ticketAttacks are TestMaliciousJoin's cases against the agent: a worker joins through a join service that
// hands out tickets a worker must never act on. The agent refuses each before it takes its node lock or
// touches its disk, and says why.
func (l *Lab) ticketAttacks(t *testing.T) {
	for i, tc := range []struct {
		name   string
		tamper func(*berthv1.JoinTicket)
		reason string
	}{
		{"control-plane files for a worker", func(tk *berthv1.JoinTicket) {
			tk.ControlPlaneFiles = []*berthv1.File{{Path: "ca.key", Content: []byte("a CA key"), Mode: 0o600}}
		}, "control-plane material (1 files"},
		{"cluster secrets for a worker", func(tk *berthv1.JoinTicket) {
			tk.ClusterSecrets = &berthv1.ClusterSecrets{MasterSecret: make([]byte, 32), Salt: make([]byte, 32)}
		}, "cluster secrets: true"},
		{"another node's name", func(tk *berthv1.JoinTicket) { tk.NodeName = "cp-0" }, `the ticket is for node "cp-0"`},
		{"an API server endpoint that is a URL", func(tk *berthv1.JoinTicket) {
			tk.ApiServerEndpoint = "https://evil.example.com:6443/path"
		}, "API server endpoint"},
	} {
		t.Run("agent refuses a ticket with "+tc.name, func(t *testing.T) {
			addr := tamperingService(t, l, tc.tamper)
			n := l.AddNode(fmt.Sprintf("worker-%d", 10+i), metadata.RoleWorker)
			logs := &clustertest.SafeBuffer{}
			lock := &nodestate.Lock{}
			client := joinclient.New(joinclient.Config{
				Metadata: metadataPointingTo(l, n, addr), Prover: n.Prover, Disk: n.Disk, Lock: lock,
				Kubeadm: &Kubeadm{}, Paths: n.Paths, LocalAddr: n.Addr,
				Backoff: backoff.Policy{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond},
				Logger:  slog.New(slog.NewTextHandler(logs, nil)),
			})
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			prepared, err := n.Disk.Prepare(ctx)
			if err != nil {
				t.Fatal(err)
			}
			_, err = client.Join(ctx, prepared)
			if err == nil || !strings.Contains(err.Error(), tc.reason) {
				t.Fatalf("join with a tampered ticket: %v, want a refusal naming %q\n%s", err, tc.reason, logs)
			}
			if o := lock.Owner(); o != "" {
				t.Errorf("the agent took its node lock (%s) for a ticket it refused", o)
			}
			if _, err := n.Volume.KeySlot(ctx, prepared.InitialKey); err != nil {
				t.Errorf("the state disk no longer opens with its initial key: %v", err)
			}
			for _, f := range []string{filepath.Join(n.Paths.PKIDir(), "ca.key"), filepath.Join(n.Paths.KubernetesDir, "kubelet.conf")} {
				if _, err := os.Stat(f); err == nil {
					t.Errorf("the agent wrote %s from a ticket it refused", f)
				}
			}
		})
	}
}
