package joinclient

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/backoff"
	"github.com/berthlabs/berth/internal/luks"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/rpc"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
	"github.com/berthlabs/berth/nodeagent/internal/statedisk"
)

// hostileService is a buggy or compromised join service: it runs the exchange's steps (challenge, proof)
// without checking anything and answers with a ticket issued for the node's own CSR, changed by change.
type hostileService struct {
	berthv1.UnimplementedJoinServiceServer
	kubeCA *pki.CA
	inst   metadata.Instance
	change func(*berthv1.JoinTicket)
}

func (s *hostileService) IssueJoinTicket(st grpc.BidiStreamingServer[berthv1.JoinClientMessage, berthv1.JoinServerMessage]) error {
	first, err := st.Recv()
	if err != nil {
		return err
	}
	req := first.GetJoin()
	if req == nil {
		return errors.New("no join request")
	}
	ticket, err := ticketForCSR(s.kubeCA, s.inst, req.KubeletCsr)
	if err != nil {
		return err
	}
	s.change(ticket)
	if err := st.Send(&berthv1.JoinServerMessage{Msg: &berthv1.JoinServerMessage_Challenge{Challenge: &berthv1.ActivationChallenge{}}}); err != nil {
		return err
	}
	if _, err := st.Recv(); err != nil {
		return err
	}
	return st.Send(&berthv1.JoinServerMessage{Msg: &berthv1.JoinServerMessage_JoinTicket{JoinTicket: ticket}})
}

// serveHostile serves svc over TLS with a certificate of a new join CA on loopback; it returns the
// endpoint and the CA's pin.
func serveHostile(t *testing.T, svc *hostileService) (endpoint, pin string) {
	t.Helper()
	joinCA, err := pki.NewCA("join", time.Now(), 2*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	key, err := pki.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	cert, err := joinCA.IssueServer(key.Public(), nil, []net.IP{net.IPv4(127, 0, 0, 1)}, time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(rpc.ServerOptions(tls.Certificate{Certificate: [][]byte{cert.Raw, joinCA.Cert.Raw}, PrivateKey: key})...)
	berthv1.RegisterJoinServiceServer(srv, svc)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(l)
	t.Cleanup(srv.Stop)
	return l.Addr().String(), pki.SPKIPin(joinCA.Cert)
}

// readVolume is the whole state volume's image, to tell whether anything wrote to it.
func readVolume(t *testing.T, path string) []byte {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// TestJoinRefusesHostileTicketBeforeTouchingAnything joins a real LUKS2 state volume (cryptsetup on an image
// file) through a join service that sends a malformed ticket: the node refuses it naming the field, holds no
// node lock, has written no file, and its volume is byte for byte as it was, so its initial key still opens
// it and a later, good ticket can still key it. The honest ticket shows the harness does reach the disk.
func TestJoinRefusesHostileTicketBeforeTouchingAnything(t *testing.T) {
	if testing.Short() {
		t.Skip("needs cryptsetup (make deps)")
	}
	if _, err := exec.LookPath("cryptsetup"); err != nil {
		t.Fatalf("cryptsetup not found: run make deps (%v)", err)
	}
	garbage := bytes.Repeat([]byte("not a policy "), 200<<10/13)
	for _, tc := range []struct {
		name   string
		change func(*berthv1.JoinTicket)
		want   string // "" for the honest ticket
	}{
		{"honest ticket", func(*berthv1.JoinTicket) {}, ""},
		{"malformed bootstrap token", func(tk *berthv1.JoinTicket) { tk.BootstrapToken = "not-a-token" }, "bootstrap token"},
		{"malformed CA hash", func(tk *berthv1.JoinTicket) { tk.DiscoveryCaCertHashes = []string{"sha256:xyz"} }, "CA certificate hash 0"},
		{"short disk key", func(tk *berthv1.JoinTicket) { tk.DiskKey = tk.DiskKey[:20] }, "disk key is 20 bytes"},
		{"garbage unlock policy of 200 KiB", func(tk *berthv1.JoinTicket) { tk.UnlockPolicy = garbage }, "unlock policy"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			image := filepath.Join(t.TempDir(), "state.img")
			if err := os.WriteFile(image, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Truncate(image, 32<<20); err != nil {
				t.Fatal(err)
			}
			disk := statedisk.New(luks.New(image, nil), nil)
			prepared, err := disk.Prepare(ctx)
			if err != nil {
				t.Fatal(err)
			}
			before := readVolume(t, image)

			self := metadata.Self{Instance: metadata.Instance{Name: "w-0", Role: metadata.RoleWorker, Addresses: addrs("10.0.0.20")}}
			endpoint, pin := serveHostile(t, &hostileService{kubeCA: newKubeCA(t), inst: self.Instance, change: tc.change})
			self.UserData = metadata.UserData{ClusterName: "lab", JoinEndpoints: []string{endpoint}, JoinPort: 9000, JoinCAPin: pin}
			lock, paths := &nodestate.Lock{}, testPaths(t)
			c := New(Config{
				Metadata: &fakeMetadata{self: self}, Prover: fakeProver{}, Disk: disk, Lock: lock, Kubeadm: fakeKubeadm{},
				Paths: paths, Backoff: backoff.Policy{Initial: 10 * time.Millisecond, Max: 100 * time.Millisecond},
				RequestTimeout: 10 * time.Second, Sleep: backoff.Sleep, Rand: func() float64 { return 0 },
			})
			_, err = c.Join(ctx, prepared)

			if tc.want == "" {
				// kubeadm join is not here: the join stops there, after the lock and the key.
				if err == nil || !strings.Contains(err.Error(), "kubeadm join") {
					t.Fatalf("honest join: %v, want it to reach kubeadm join", err)
				}
				if changed := !bytes.Equal(readVolume(t, image), before); lock.Owner() != nodestate.OwnerJoin || !changed {
					t.Fatalf("honest join: lock owner %q, volume changed %v: the harness does not reach the disk", lock.Owner(), changed)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), "join ticket refused") || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Join: %v, want the ticket refused naming %q", err, tc.want)
			}
			if owner := lock.Owner(); owner != "" {
				t.Errorf("node lock held by %q after a refused ticket", owner)
			}
			if !bytes.Equal(readVolume(t, image), before) {
				t.Error("the state volume changed for a refused ticket")
			}
			if err := disk.SetKey(ctx, prepared.InitialKey, bytes.Repeat([]byte{7}, 32)); err != nil {
				t.Errorf("the volume cannot be keyed after a refused ticket: %v", err)
			}
			for _, dir := range []string{paths.State, paths.KubernetesDir, paths.KubeletDir} {
				if _, err := os.Stat(dir); err == nil {
					t.Errorf("%s was written for a refused ticket", dir)
				}
			}
		})
	}
}
