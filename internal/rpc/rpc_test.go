package rpc_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/rpc"
)

// joinCA is a join CA with a server certificate, the way a join service presents it (leaf and CA).
type joinCA struct {
	ca   *pki.CA
	cert tls.Certificate
}

func newJoinCA(t *testing.T) joinCA {
	t.Helper()
	now := time.Now()
	ca, err := pki.NewCA("test-join-ca", now, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	key, err := pki.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := ca.IssueServer(key.Public(), nil, []net.IP{net.IPv4(127, 0, 0, 1)}, now, 30*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	return joinCA{ca: ca, cert: tls.Certificate{Certificate: [][]byte{leaf.Raw, ca.Cert.Raw}, PrivateKey: key, Leaf: leaf}}
}

// handshake runs a TLS handshake over net.Pipe and returns both ends' connection states.
func handshake(t *testing.T, clientCfg, serverCfg *tls.Config) (client, server tls.ConnectionState, err error) {
	t.Helper()
	c, s := net.Pipe()
	t.Cleanup(func() { c.Close(); s.Close() })
	cc, sc := tls.Client(c, clientCfg), tls.Server(s, serverCfg)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	serr := make(chan error, 1)
	go func() {
		err := sc.HandshakeContext(ctx)
		if err != nil {
			// Unblock the client, which may be waiting for a message the server will never send.
			s.Close()
		}
		serr <- err
	}()
	cerr := cc.HandshakeContext(ctx)
	if cerr != nil {
		c.Close()
	}
	if err := errors.Join(cerr, <-serr); err != nil {
		return tls.ConnectionState{}, tls.ConnectionState{}, err
	}
	return cc.ConnectionState(), sc.ConnectionState(), nil
}

func pinnedPair(t *testing.T, j joinCA) (clientCfg, serverCfg *tls.Config) {
	t.Helper()
	clientCfg, err := rpc.PinnedTLS(pki.SPKIPin(j.ca.Cert), nil)
	if err != nil {
		t.Fatal(err)
	}
	return clientCfg, &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{j.cert}}
}

func TestNonceIsSharedByBothEndsOfOneConnection(t *testing.T) {
	j := newJoinCA(t)
	clientCfg, serverCfg := pinnedPair(t, j)

	c1, s1, err := handshake(t, clientCfg, serverCfg)
	if err != nil {
		t.Fatal(err)
	}
	if c1.Version != tls.VersionTLS13 {
		t.Fatalf("negotiated %#04x, want TLS 1.3", c1.Version)
	}
	cn1, err := attest.Nonce(&c1)
	if err != nil {
		t.Fatal(err)
	}
	sn1, err := attest.Nonce(&s1)
	if err != nil {
		t.Fatal(err)
	}
	if len(cn1) != attest.NonceSize {
		t.Errorf("nonce has %d bytes, want %d", len(cn1), attest.NonceSize)
	}
	if !bytes.Equal(cn1, sn1) {
		t.Errorf("client nonce %x, server nonce %x: want equal", cn1, sn1)
	}
	if bytes.Equal(cn1, make([]byte, attest.NonceSize)) {
		t.Error("nonce is all zero")
	}

	c2, s2, err := handshake(t, clientCfg, serverCfg)
	if err != nil {
		t.Fatal(err)
	}
	cn2, err := attest.Nonce(&c2)
	if err != nil {
		t.Fatal(err)
	}
	sn2, err := attest.Nonce(&s2)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(cn2, sn2) {
		t.Errorf("second connection: client nonce %x, server nonce %x: want equal", cn2, sn2)
	}
	if bytes.Equal(cn1, cn2) {
		t.Errorf("two connections share the nonce %x", cn1)
	}

	// The exporter label is Berth's own: the same connection's exporter under another label is unrelated.
	other, err := c1.ExportKeyingMaterial("EXPORTER-some-other-protocol", nil, attest.NonceSize)
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Equal(other, cn1) {
		t.Error("nonce equals the exporter value of another label")
	}
}

func TestStreamNonceMatchesConnectionNonce(t *testing.T) {
	j := newJoinCA(t)
	clientCfg, serverCfg := pinnedPair(t, j)
	c, s, err := handshake(t, clientCfg, serverCfg)
	if err != nil {
		t.Fatal(err)
	}
	addr := &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 4000}
	onStream := func(cs tls.ConnectionState) []byte {
		t.Helper()
		ctx := peer.NewContext(context.Background(), &peer.Peer{Addr: addr, AuthInfo: credentials.TLSInfo{State: cs}})
		n, err := rpc.StreamNonce(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	want, err := attest.Nonce(&c)
	if err != nil {
		t.Fatal(err)
	}
	if got := onStream(c); !bytes.Equal(got, want) {
		t.Errorf("client stream nonce %x, connection nonce %x", got, want)
	}
	if got := onStream(s); !bytes.Equal(got, want) {
		t.Errorf("server stream nonce %x, connection nonce %x", got, want)
	}
}

func TestStreamNonceRefusals(t *testing.T) {
	addr := &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 4000}
	tests := []struct {
		name    string
		ctx     context.Context
		wantErr string
	}{
		{name: "no peer", ctx: context.Background(), wantErr: "no peer"},
		{name: "no TLS", ctx: peer.NewContext(context.Background(), &peer.Peer{Addr: addr}), wantErr: "not on a TLS connection"},
		{name: "TLS 1.2 state", ctx: peer.NewContext(context.Background(), &peer.Peer{Addr: addr,
			AuthInfo: credentials.TLSInfo{State: tls.ConnectionState{Version: tls.VersionTLS12}}}), wantErr: "TLS 1.3"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			n, err := rpc.StreamNonce(tt.ctx)
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("StreamNonce = %x, %v; want an error containing %q", n, err, tt.wantErr)
			}
		})
	}
}

func TestNonceRefusesTLS12Connection(t *testing.T) {
	j := newJoinCA(t)
	// A real TLS 1.2 connection can export keying material (extended master secret), so only the version
	// check keeps it from yielding a nonce.
	c, s, err := handshake(t,
		&tls.Config{InsecureSkipVerify: true, MaxVersion: tls.VersionTLS12},
		&tls.Config{MaxVersion: tls.VersionTLS12, Certificates: []tls.Certificate{j.cert}})
	if err != nil {
		t.Fatal(err)
	}
	if c.Version != tls.VersionTLS12 {
		t.Fatalf("negotiated %#04x, want TLS 1.2", c.Version)
	}
	if _, err := c.ExportKeyingMaterial(attest.ExporterLabel, nil, attest.NonceSize); err != nil {
		t.Fatalf("TLS 1.2 exporter unavailable, the test proves nothing: %v", err)
	}
	for name, cs := range map[string]*tls.ConnectionState{"client": &c, "server": &s, "nil": nil} {
		if n, err := attest.Nonce(cs); err == nil {
			t.Errorf("%s: Nonce = %x, want an error", name, n)
		}
	}
	if _, err := attest.Nonce(&c); err == nil || !strings.Contains(err.Error(), "TLS 1.3") {
		t.Errorf("Nonce error %v does not say that TLS 1.3 is needed", err)
	}
}

func TestPinnedTLSRefusesTLS12Server(t *testing.T) {
	j := newJoinCA(t)
	clientCfg, _ := pinnedPair(t, j)
	_, _, err := handshake(t, clientCfg, &tls.Config{MaxVersion: tls.VersionTLS12, Certificates: []tls.Certificate{j.cert}})
	if err == nil {
		t.Fatal("handshake with a TLS 1.2-only server succeeded")
	}
}

func TestPinnedTLSChecksThePin(t *testing.T) {
	j, other := newJoinCA(t), newJoinCA(t)
	clientCfg, err := rpc.PinnedTLS(pki.SPKIPin(other.ca.Cert), nil)
	if err != nil {
		t.Fatal(err)
	}
	_, serverCfg := pinnedPair(t, j)
	if _, _, err := handshake(t, clientCfg, serverCfg); err == nil {
		t.Fatal("handshake with a server of another join CA succeeded")
	}
}

func TestPinnedTLSRefusesMalformedPin(t *testing.T) {
	good := pki.SPKIPin(newJoinCA(t).ca.Cert)
	for _, pin := range []string{
		"",
		strings.TrimPrefix(good, "sha256:"),
		"sha1:" + strings.TrimPrefix(good, "sha256:"),
		good[:len(good)-1],
		good + "0",
		strings.ToUpper(good[:7]) + good[7:],
		"sha256:" + strings.ToUpper(strings.TrimPrefix(good, "sha256:")),
		"sha256:" + strings.Repeat("g", 64),
	} {
		cfg, err := rpc.PinnedTLS(pin, nil)
		if err == nil {
			t.Errorf("PinnedTLS(%q) = %v, want an error", pin, cfg)
			continue
		}
		if !strings.Contains(err.Error(), "join CA pin") {
			t.Errorf("PinnedTLS(%q) error %q does not name the join CA pin", pin, err)
		}
	}
	cfg, err := rpc.PinnedTLS(good, nil)
	if err != nil {
		t.Fatalf("PinnedTLS(%q): %v", good, err)
	}
	if cfg.MinVersion != tls.VersionTLS13 || cfg.VerifyPeerCertificate == nil {
		t.Errorf("config MinVersion %#04x, VerifyPeerCertificate set %v; want TLS 1.3 and a verifier",
			cfg.MinVersion, cfg.VerifyPeerCertificate != nil)
	}
}

// fakeAddr is a net.Addr with any text, as a transport other than net's TCP might report it.
type fakeAddr string

func (a fakeAddr) Network() string { return "tcp" }
func (a fakeAddr) String() string  { return string(a) }

func TestPeerAddr(t *testing.T) {
	tests := []struct {
		name    string
		addr    net.Addr
		want    netip.Addr
		wantErr string
	}{
		{name: "IPv4", addr: &net.TCPAddr{IP: net.IPv4(10, 0, 0, 7), Port: 5000}, want: netip.MustParseAddr("10.0.0.7")},
		{name: "IPv4-mapped IPv6 text", addr: fakeAddr("[::ffff:10.0.0.7]:5000"), want: netip.MustParseAddr("10.0.0.7")},
		{name: "IPv4-mapped IPv6 TCPAddr", addr: net.TCPAddrFromAddrPort(netip.MustParseAddrPort("[::ffff:10.0.0.7]:5000")),
			want: netip.MustParseAddr("10.0.0.7")},
		{name: "IPv6", addr: &net.TCPAddr{IP: net.ParseIP("fd00::7"), Port: 5000}, want: netip.MustParseAddr("fd00::7")},
		{name: "not host:port", addr: &net.UnixAddr{Name: "/run/berth.sock", Net: "unix"}, wantErr: "peer address"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := rpc.PeerAddr(peer.NewContext(context.Background(), &peer.Peer{Addr: tt.addr}))
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("PeerAddr = %v, %v; want an error containing %q", got, err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got != tt.want {
				t.Errorf("PeerAddr = %v, want %v", got, tt.want)
			}
			if got.Is4In6() {
				t.Errorf("PeerAddr = %v is still IPv4-mapped", got)
			}
		})
	}
	if a, err := rpc.PeerAddr(context.Background()); err == nil {
		t.Errorf("PeerAddr without a peer = %v, want an error", a)
	}
}

type msg struct{ text string }

// chanReceiver is a stream whose Recv returns what the test sends, when it sends it.
type chanReceiver struct {
	msgs chan *msg
	errs chan error
}

func newChanReceiver() *chanReceiver {
	return &chanReceiver{msgs: make(chan *msg, 1), errs: make(chan error, 1)}
}

func (r *chanReceiver) Recv() (*msg, error) {
	select {
	case m := <-r.msgs:
		return m, nil
	case err := <-r.errs:
		return nil, err
	}
}

func TestRecvReturnsMessageWhenItArrives(t *testing.T) {
	r := newChanReceiver()
	go func() { r.msgs <- &msg{text: "hello"} }()
	got, err := rpc.Recv(context.Background(), r)
	if err != nil {
		t.Fatal(err)
	}
	if got == nil || got.text != "hello" {
		t.Errorf("Recv = %+v, want hello", got)
	}
}

func TestRecvReturnsStreamError(t *testing.T) {
	r := newChanReceiver()
	want := status.Error(codes.PermissionDenied, "go away")
	r.errs <- want
	got, err := rpc.Recv(context.Background(), r)
	if got != nil || !errors.Is(err, want) {
		t.Errorf("Recv = %v, %v; want nil, %v", got, err, want)
	}
}

func TestRecvEndsWithContext(t *testing.T) {
	tests := []struct {
		name string
		ctx  func() (context.Context, context.CancelFunc)
		want codes.Code
	}{
		{name: "deadline", want: codes.DeadlineExceeded, ctx: func() (context.Context, context.CancelFunc) {
			return context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
		}},
		{name: "canceled", want: codes.Canceled, ctx: func() (context.Context, context.CancelFunc) {
			ctx, cancel := context.WithCancel(context.Background())
			cancel()
			return ctx, cancel
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := newChanReceiver()
			ctx, cancel := tt.ctx()
			defer cancel()
			got, err := rpc.Recv(ctx, r)
			if got != nil || status.Code(err) != tt.want {
				t.Errorf("Recv = %v, %v; want nil and code %v", got, err, tt.want)
			}
			// The stream's Recv is still blocked; ending it lets the goroutine Recv left behind finish.
			r.errs <- errors.New("stream closed")
		})
	}
}

func TestRecvCanceledWhileWaiting(t *testing.T) {
	r := newChanReceiver()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := rpc.Recv(ctx, r)
		done <- err
	}()
	cancel()
	if err := <-done; status.Code(err) != codes.Canceled {
		t.Errorf("Recv after cancel: %v, want code Canceled", err)
	}
	r.errs <- errors.New("stream closed")
}

func TestRetryBusyReportsBusyWhenTimeRunsOutInAnAttempt(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 700*time.Millisecond)
	defer cancel()
	attempts := 0
	_, err := rpc.RetryBusy(ctx, func() (int, error) {
		attempts++
		if attempts == 1 {
			return 0, rpc.ErrBusy
		}
		// The second attempt waits for a slot the way a busy server makes it wait, past the deadline.
		<-ctx.Done()
		return 0, status.FromContextError(ctx.Err()).Err()
	}, nil)
	if !rpc.IsBusy(err) {
		t.Fatalf("error %v, want busy", err)
	}
	if attempts != 2 || !strings.Contains(err.Error(), "asked 2 times") || !strings.Contains(err.Error(), "deadline exceeded") {
		t.Errorf("error %q after %d attempts, want the busy answer, the count and the cut-off attempt", err, attempts)
	}
}

func TestRetryBusyKeepsOtherErrors(t *testing.T) {
	refused := status.Error(codes.PermissionDenied, "refused")
	attempts := 0
	_, err := rpc.RetryBusy(t.Context(), func() (int, error) {
		attempts++
		if attempts == 1 {
			return 0, rpc.ErrBusy
		}
		return 0, refused
	}, nil)
	if !errors.Is(err, refused) || rpc.IsBusy(err) {
		t.Errorf("error %v, want the refusal as it was", err)
	}
}
