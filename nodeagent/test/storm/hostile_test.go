package storm

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/backoff"
	"github.com/berthlabs/berth/internal/initclient"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/repotest"
	"github.com/berthlabs/berth/internal/rpc"
	"github.com/berthlabs/berth/nodeagent/internal/joinclient"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
	"github.com/berthlabs/berth/test/clustertest"
	"github.com/berthlabs/berth/test/kubetest"
)

// Sizes of TestHostileNetwork: the service process runs with GOMAXPROCS 2 on this machine, so it serves 64
// connections at once; the attackers hold three times that.
const (
	hostileStrangers = 192
	hostileGenuine   = 40
)

// TestHostileNetwork runs the real join service process while attackers on the nodes' network (addresses
// without an instance record) keep opening idle TCP connections, TLS connections and silent gRPC streams,
// three times the service's connection slots, and a compromised worker (an address with a record) opens
// twenty silent streams. Meanwhile genuine agents join and a joined node rejoins, as after a reboot. Every
// genuine node gets its ticket, every attacker's connection is closed by the service, the service's live
// heap stays within a few MiB of what it was, and its log sums the refusals up by reason.
func TestHostileNetwork(t *testing.T) {
	h := NewHost(t, 4)
	svc := h.StartService()
	heapBefore, err := svc.HeapInUse()
	if err != nil {
		t.Fatal(err)
	}
	addr := h.JoinAddr
	tlsCfg, err := rpc.PinnedTLS(pki.SPKIPin(h.JoinCA.Cert), nil)
	if err != nil {
		t.Fatal(err)
	}

	// Two genuine nodes join before the attack: the first rejoins during it, as after a reboot; root on
	// the second is the compromised worker.
	before := h.AddWorkers(2)
	bo := backoff.Policy{Max: time.Second}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	joined := h.Storm(ctx, before, bo, nil)
	for _, a := range joined {
		if a.Err != nil {
			t.Fatalf("join before the attack: %v", a.Err)
		}
	}

	// Each attacker's connection ends when the service closes it or, failing that, after a minute.
	hold := func(from netip.Addr, kind int) error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		return holdConnection(ctx, addr, from, kind, tlsCfg)
	}
	attackCtx, stopAttack := context.WithCancel(ctx)
	var strangers, compromised sync.WaitGroup
	var opened, closedByService atomic.Int64
	for i := range hostileStrangers {
		from := netip.AddrFrom4([4]byte{127, 2, byte(i / 250), byte(1 + i%250)})
		strangers.Go(func() {
			for attackCtx.Err() == nil {
				opened.Add(1)
				if hold(from, i%3) == errClosedByService {
					closedByService.Add(1)
				}
				time.Sleep(50 * time.Millisecond)
			}
		})
	}
	var workerClosed atomic.Int64
	for range 20 {
		compromised.Go(func() {
			if hold(before[1].Addresses[0], 2) == errClosedByService {
				workerClosed.Add(1)
			}
		})
	}

	genuine := h.AddWorkers(hostileGenuine)
	agents := h.Storm(ctx, genuine, bo, nil)
	rejoinErr := h.rejoin(ctx, 0, before[0], joined[0].Disk, bo)
	heapDuring, err := svc.HeapInUse()
	if err != nil {
		t.Fatal(err)
	}
	stopAttack()
	strangers.Wait()
	compromised.Wait()

	for _, a := range agents {
		if a.Err != nil {
			t.Errorf("%s did not get its ticket while under attack: %v", a.Name, a.Err)
		}
	}
	if rejoinErr != nil {
		t.Errorf("the rebooted node did not get its rejoin ticket while under attack: %v", rejoinErr)
	}
	t.Logf("strangers opened %d connections; the service closed %d of them", opened.Load(), closedByService.Load())
	if closedByService.Load() != opened.Load() {
		t.Errorf("the service kept %d of the strangers' %d connections open for a minute", opened.Load()-closedByService.Load(), opened.Load())
	}
	if workerClosed.Load() != 20 {
		t.Errorf("the compromised worker kept %d of its 20 silent connections open for a minute", 20-workerClosed.Load())
	}
	t.Logf("join service live heap: %d KiB before, %d KiB under attack", heapBefore>>10, heapDuring>>10)
	if heapDuring > heapBefore+32<<20 {
		t.Errorf("the join service's live heap grew by %d MiB under attack", (heapDuring-heapBefore)>>20)
	}

	t.Run("init server", func(t *testing.T) { h.initUnderAttack(t) })

	// The refusals reach the operator as summaries, by reason.
	deadline := time.Now().Add(40 * time.Second)
	for !strings.Contains(svc.Log(), `"msg":"connections refused before their TLS handshake"`) {
		if time.Now().After(deadline) {
			t.Fatalf("no summary of refused connections in the service's log:\n%s", tail(svc.Log(), 20))
		}
		time.Sleep(100 * time.Millisecond)
	}
	for _, reason := range []string{`"not_admitted":`, `"address_limit":`} {
		if !strings.Contains(svc.Log(), reason) {
			t.Errorf("the refusal summaries do not count %s:\n%s", reason, tail(svc.Log(), 20))
		}
	}
}

var (
	errClosedByService = errors.New("closed by the service")
	errStillOpen       = errors.New("still open")
)

// holdConnection connects to addr from the loopback address from and holds the connection without asking
// anything: kind 0 idle TCP, 1 a TLS handshake then nothing, 2 a gRPC stream that sends nothing. It returns
// errClosedByService when the service closed it, errStillOpen when ctx ended first.
func holdConnection(ctx context.Context, addr string, from netip.Addr, kind int, tlsCfg *tls.Config) error {
	switch kind {
	case 0, 1:
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: from.AsSlice()}}
		c, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			return err
		}
		defer c.Close()
		stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Now()) })
		defer stop()
		if kind == 1 {
			if err := tls.Client(c, tlsCfg).HandshakeContext(ctx); err != nil {
				return closedOr(ctx)
			}
		}
		_, err = c.Read(make([]byte, 1))
		if err != nil {
			return closedOr(ctx)
		}
		return errors.New("the service sent something")
	default:
		conn, err := grpc.NewClient(addr, rpc.DialOptions(tlsCfg, from)...)
		if err != nil {
			return err
		}
		defer conn.Close()
		st, err := berthv1.NewJoinServiceClient(conn).IssueJoinTicket(ctx)
		if err != nil {
			return closedOr(ctx)
		}
		_, err = st.Recv()
		if err != nil {
			return closedOr(ctx)
		}
		return errors.New("the service answered a silent stream")
	}
}

// closedOr tells the service's close from the attacker's own end.
func closedOr(ctx context.Context) error {
	if ctx.Err() != nil {
		return errStillOpen
	}
	return errClosedByService
}

// rejoin asks for the rejoin ticket of disk as worker i (its TPM from the pool), as its agent does after a
// reboot.
func (h *Host) rejoin(ctx context.Context, i int, w metadata.Instance, disk string, bo backoff.Policy) error {
	dir := filepath.Join(h.agentsDir, w.Name)
	jc := joinclient.New(joinclient.Config{
		Metadata: h.Metadata(w.Addresses[0]), Prover: h.provers[i%len(h.provers)], Disk: &keyRecorder{},
		Lock: &nodestate.Lock{}, Kubeadm: noKubeadm{},
		Paths: nodestate.Paths{State: filepath.Join(dir, "state"), KubernetesDir: filepath.Join(dir, "kubernetes"),
			KubeletDir: filepath.Join(dir, "kubelet")},
		PCRs: clustertest.QuotedPCRs, LocalAddr: w.Addresses[0], Backoff: bo,
	})
	_, err := jc.Rejoin(ctx, disk)
	return err
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// initStrangers is the number of stranger addresses on the init port during the attacked init.
const initStrangers = 8

// initUnderAttack initializes two fresh control-plane nodes, each a real agent process, with berth_cluster's
// client: the first unattacked, the second while strangers on initStrangers addresses each hold a stalling
// exchange (a hello, then nothing) and an idle TLS connection to its init port, two connections per address,
// the most an address may hold. The attacked init must take at most twice the unattacked one.
func (h *Host) initUnderAttack(t *testing.T) {
	repotest.NeedsRoot(t, "the init node's agent formats and keys a LUKS2 state disk")
	unattacked := h.initNode(t, 0, 0)
	attacked := h.initNode(t, 1, initStrangers)
	t.Logf("init: %.2f s unattacked, %.2f s with %d stranger addresses on the init port (%.1f×)",
		unattacked.Seconds(), attacked.Seconds(), initStrangers, attacked.Seconds()/unattacked.Seconds())
	if attacked > 2*unattacked && attacked > unattacked+time.Second {
		t.Errorf("strangers on the init port slowed a genuine init from %s to %s", unattacked, attacked)
	}
}

// initNode starts fresh control-plane node k and initializes it while strangers from that many addresses
// stall on its init port; it returns how long the init took.
func (h *Host) initNode(t *testing.T, k, strangers int) time.Duration {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cp := metadata.Instance{Name: fmt.Sprintf("cp-init-%d", k), Role: metadata.RoleControlPlane,
		Addresses: []netip.Addr{netip.AddrFrom4([4]byte{127, 3, 0, byte(1 + k)})}}
	h.AddInstances(cp)
	initAddr := netip.AddrPortFrom(cp.Addresses[0], uint16(kubetest.FreePort(t))).String()
	if err := h.StartInitNode(ctx, cp, h.EKCA.NewTPM(t), initAddr); err != nil {
		t.Fatal(err)
	}
	anyCert := &tls.Config{MinVersion: tls.VersionTLS13, InsecureSkipVerify: true, NextProtos: []string{"h2"}}
	for i := range strangers {
		from := netip.AddrFrom4([4]byte{127, 4, byte(k), byte(1 + i)})
		conn, err := grpc.NewClient(initAddr, rpc.DialOptions(anyCert, from)...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		st, err := berthv1.NewInitServiceClient(conn).Init(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := st.Send(&berthv1.InitClientMessage{Msg: &berthv1.InitClientMessage_Hello{Hello: &berthv1.InitHello{Pcrs: []uint32{7}}}}); err != nil {
			t.Fatal(err)
		}
		d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: from.AsSlice()}}
		c, err := tls.DialWithDialer(d, "tcp", initAddr, anyCert)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
	}

	kubeKey, err := h.API.CA.KeyPEM()
	if err != nil {
		t.Fatal(err)
	}
	joinKey, err := h.JoinCA.KeyPEM()
	if err != nil {
		t.Fatal(err)
	}
	expected := map[int][]byte{}
	for _, i := range clustertest.QuotedPCRs {
		expected[i] = make([]byte, 32)
	}
	start := time.Now()
	res, err := initclient.Init(ctx, initclient.Config{
		Endpoint: initAddr, Verifier: attest.NewVerifier(attest.NewCertChain(h.EKCA.Roots(), h.EKCA.Intermediates(), nil)), ExpectedPCRs: expected,
		Request: &berthv1.InitRequest{
			InitSecret: h.InitSecret, MasterSecret: h.Master, Salt: h.Salt,
			KubernetesCaCertificate: h.API.CA.CertPEM(), KubernetesCaKey: kubeKey,
			JoinCaCertificate: h.JoinCA.CertPEM(), JoinCaKey: joinKey,
			ClusterName: "storm", KubernetesVersion: repotest.KubernetesVersion,
		},
		Busy: func(attempt int, wait time.Duration) { t.Logf("the init server was busy (attempt %d)", attempt) },
	})
	took := time.Since(start)
	if err != nil {
		t.Fatalf("init of %s with %d strangers on its port: %v", cp.Name, strangers, err)
	}
	if len(res.Kubeconfig) == 0 {
		t.Fatal("the init result has no kubeconfig")
	}
	return took
}
