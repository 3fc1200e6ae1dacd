package rpc_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/rpc"
)

// holdService answers a join request with a challenge, or, for disk "hold", holds the stream until its
// client or server ends it. started receives the disk of every request it read.
type holdService struct {
	berthv1.UnimplementedJoinServiceServer
	started chan string
}

func (s *holdService) IssueJoinTicket(st berthv1.JoinService_IssueJoinTicketServer) error {
	m, err := st.Recv()
	if err != nil {
		return err
	}
	disk := m.GetJoin().GetDiskUuid()
	s.started <- disk
	if disk == "hold" {
		<-st.Context().Done()
		return st.Context().Err()
	}
	return st.Send(&berthv1.JoinServerMessage{Msg: &berthv1.JoinServerMessage_Challenge{Challenge: &berthv1.ActivationChallenge{}}})
}

type admitServer struct {
	lis  *rpc.AdmitListener
	addr string
	pin  string
	svc  *holdService
}

// serveAdmitted serves holdService behind an AdmitListener with cfg, as a join service does.
func serveAdmitted(t *testing.T, cfg rpc.AdmitConfig) *admitServer {
	t.Helper()
	j := newJoinCA(t)
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	lis := rpc.Admit(inner, cfg)
	gs := grpc.NewServer(append(rpc.ServerOptions(j.cert), rpc.OneExchange())...)
	svc := &holdService{started: make(chan string, 16)}
	berthv1.RegisterJoinServiceServer(gs, svc)
	go gs.Serve(lis)
	t.Cleanup(gs.Stop)
	return &admitServer{lis: lis, addr: inner.Addr().String(), pin: pki.SPKIPin(j.ca.Cert), svc: svc}
}

// client is a gRPC client of s from the loopback address from.
func (s *admitServer) client(t *testing.T, from string) berthv1.JoinServiceClient {
	t.Helper()
	tlsCfg, err := rpc.PinnedTLS(s.pin, nil)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := grpc.NewClient(s.addr, rpc.DialOptions(tlsCfg, netip.MustParseAddr(from))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return berthv1.NewJoinServiceClient(conn)
}

// exchange runs one join request with disk on c and returns the stream's end.
func exchange(ctx context.Context, c berthv1.JoinServiceClient, disk string) error {
	st, err := c.IssueJoinTicket(ctx)
	if err != nil {
		return err
	}
	// A server that refused the stream at once may have closed it before the request went out: the refusal
	// is then Recv's, as gRPC has it.
	if err := st.Send(&berthv1.JoinClientMessage{Msg: &berthv1.JoinClientMessage_Join{Join: &berthv1.JoinRequest{DiskUuid: disk}}}); err != nil && !errors.Is(err, io.EOF) {
		return err
	}
	_, err = st.Recv()
	return err
}

// rawConn is a TCP connection to addr from the loopback address from, that sends nothing.
func rawConn(t *testing.T, addr, from string) net.Conn {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}, Timeout: 5 * time.Second}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// closedByServer fails unless the server closes c within wait, before sending it anything.
func closedByServer(t *testing.T, c net.Conn, wait time.Duration) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(wait))
	n, err := c.Read(make([]byte, 1))
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		t.Fatalf("the server kept the connection from %s open for %s", c.LocalAddr(), wait)
	}
	if n != 0 || err == nil {
		t.Fatalf("the server sent %d bytes (%v), want the connection closed", n, err)
	}
}

func waitRefused(t *testing.T, l *rpc.AdmitListener, reason string, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for l.Refused()[reason] < n {
		if time.Now().After(deadline) {
			t.Fatalf("refusals %v, want %d for %s", l.Refused(), n, reason)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestAdmitRefusesBeforeTheHandshake(t *testing.T) {
	s := serveAdmitted(t, rpc.AdmitConfig{Slots: 4, Admit: func(_ context.Context, a netip.Addr) error {
		if a != netip.MustParseAddr("127.0.0.2") {
			return fmt.Errorf("%w: no instance record for %s", rpc.ErrNotAdmitted, a)
		}
		return nil
	}})
	closedByServer(t, rawConn(t, s.addr, "127.0.0.3"), 10*time.Second)
	waitRefused(t, s.lis, rpc.RefusedNotAdmitted, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := exchange(ctx, s.client(t, "127.0.0.2"), "disk"); err != nil {
		t.Fatalf("an admitted peer: %v", err)
	}
}

func TestAdmitCountsFailedChecksApart(t *testing.T) {
	s := serveAdmitted(t, rpc.AdmitConfig{Slots: 4, Admit: func(context.Context, netip.Addr) error {
		return errors.New("metadata service unreachable")
	}})
	closedByServer(t, rawConn(t, s.addr, "127.0.0.2"), 10*time.Second)
	waitRefused(t, s.lis, rpc.RefusedAdmitFailed, 1)
	if n := s.lis.Refused()[rpc.RefusedNotAdmitted]; n != 0 {
		t.Fatalf("a failed check counted as %d refusals of a stranger", n)
	}
}

func TestAdmitBoundsConnectionsPerAddress(t *testing.T) {
	s := serveAdmitted(t, rpc.AdmitConfig{Slots: 8, PerAddress: 2, FirstStream: time.Minute})
	// The listener admits connections concurrently, so which of three arrives last is its choice: exactly
	// one is closed, and the other two stay.
	conns := []net.Conn{rawConn(t, s.addr, "127.0.0.4"), rawConn(t, s.addr, "127.0.0.4"), rawConn(t, s.addr, "127.0.0.4")}
	waitRefused(t, s.lis, rpc.RefusedAddressLimit, 1)
	var held []net.Conn
	for _, c := range conns {
		c.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
		_, err := c.Read(make([]byte, 1))
		if ne := net.Error(nil); errors.As(err, &ne) && ne.Timeout() {
			held = append(held, c)
		}
	}
	if len(held) != 2 {
		t.Fatalf("%d of three connections from one address stayed open, want 2", len(held))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := exchange(ctx, s.client(t, "127.0.0.5"), "disk"); err != nil {
		t.Fatalf("another address while one is at its limit: %v", err)
	}
	// Closing one frees its place.
	held[0].Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		c := rawConn(t, s.addr, "127.0.0.4")
		c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		_, err := c.Read(make([]byte, 1))
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("closing a connection did not free its address's place: %v", err)
		}
	}
}

func TestAdmitClosesSilentConnections(t *testing.T) {
	s := serveAdmitted(t, rpc.AdmitConfig{Slots: 2, FirstStream: 200 * time.Millisecond})
	closedByServer(t, rawConn(t, s.addr, "127.0.0.6"), 10*time.Second)
	closedByServer(t, rawConn(t, s.addr, "127.0.0.6"), 10*time.Second)
	// Both slots are free again.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, from := range []string{"127.0.0.7", "127.0.0.8"} {
		if err := exchange(ctx, s.client(t, from), "disk"); err != nil {
			t.Fatalf("after silent connections: %v", err)
		}
	}
}

func TestAdmitBoundsTheExchange(t *testing.T) {
	s := serveAdmitted(t, rpc.AdmitConfig{Slots: 2, Exchange: 300 * time.Millisecond})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := exchange(ctx, s.client(t, "127.0.0.9"), "hold")
	if code := status.Code(err); code != codes.Unavailable && code != codes.Canceled {
		t.Fatalf("a held exchange ended with %v, want its connection closed (Unavailable)", err)
	}
	if ctx.Err() != nil {
		t.Fatal("the held exchange ran into the test's deadline, not the listener's")
	}
}

func TestOneExchangePerConnection(t *testing.T) {
	s := serveAdmitted(t, rpc.AdmitConfig{Slots: 2})
	c := s.client(t, "127.0.0.10")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	first, err := c.IssueJoinTicket(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := first.Send(&berthv1.JoinClientMessage{Msg: &berthv1.JoinClientMessage_Join{Join: &berthv1.JoinRequest{DiskUuid: "hold"}}}); err != nil {
		t.Fatal(err)
	}
	<-s.svc.started
	err = exchange(ctx, c, "second")
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a second stream on the connection: %v, want ResourceExhausted", err)
	}
}

func TestAdmitWaitsForASlot(t *testing.T) {
	s := serveAdmitted(t, rpc.AdmitConfig{Slots: 1})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	holdCtx, release := context.WithCancel(ctx)
	held := make(chan error, 1)
	go func() { held <- exchange(holdCtx, s.client(t, "127.0.0.11"), "hold") }()
	if d := <-s.svc.started; d != "hold" {
		t.Fatalf("first exchange %q", d)
	}
	second := make(chan error, 1)
	go func() { second <- exchange(ctx, s.client(t, "127.0.0.12"), "second") }()
	select {
	case d := <-s.svc.started:
		t.Fatalf("exchange %q served while the only slot was taken", d)
	case <-time.After(300 * time.Millisecond):
	}
	release()
	<-held
	if err := <-second; err != nil {
		t.Fatalf("the waiting exchange after the slot freed: %v", err)
	}
}

// A connection that finds no slot within SlotWait is closed before its handshake, not left waiting behind
// whoever holds the slots.
func TestAdmitBoundsTheWaitForASlot(t *testing.T) {
	s := serveAdmitted(t, rpc.AdmitConfig{Slots: 1, SlotWait: 200 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go exchange(ctx, s.client(t, "127.0.0.11"), "hold")
	if d := <-s.svc.started; d != "hold" {
		t.Fatalf("first exchange %q", d)
	}
	closedByServer(t, rawConn(t, s.addr, "127.0.0.12"), 5*time.Second)
	waitRefused(t, s.lis, rpc.RefusedNoSlot, 1)
}

func TestAdmitListenerClose(t *testing.T) {
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := rpc.Admit(inner, rpc.AdmitConfig{Slots: 1})
	accepted := make(chan error, 1)
	go func() {
		_, err := l.Accept()
		accepted <- err
	}()
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-accepted; !errors.Is(err, net.ErrClosed) {
		t.Fatalf("Accept after Close: %v, want net.ErrClosed", err)
	}
	if _, err := net.DialTimeout("tcp", inner.Addr().String(), time.Second); err == nil {
		t.Fatal("the listener still accepts after Close")
	}
}

// failingListener fails its first Accepts as a process out of file descriptors does.
type failingListener struct {
	net.Listener
	mu    sync.Mutex
	fails int
}

func (l *failingListener) Accept() (net.Conn, error) {
	l.mu.Lock()
	fail := l.fails > 0
	l.fails--
	l.mu.Unlock()
	if fail {
		return nil, &net.OpError{Op: "accept", Net: "tcp", Err: syscall.EMFILE}
	}
	return l.Listener.Accept()
}

// TestAdmitSurvivesAcceptErrors: a listener that fails to accept for a while (file descriptors exhausted by
// a flood) is not given up; the connection waiting behind the failures is served.
func TestAdmitSurvivesAcceptErrors(t *testing.T) {
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	lis := rpc.Admit(&failingListener{Listener: inner, fails: 5}, rpc.AdmitConfig{Slots: 2})
	defer lis.Close()
	c, err := net.Dial("tcp", inner.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		if a, err := lis.Accept(); err == nil {
			accepted <- a
		}
	}()
	select {
	case a := <-accepted:
		a.Close()
	case <-time.After(30 * time.Second):
		t.Fatal("the listener stopped accepting after five failed accepts")
	}
}
