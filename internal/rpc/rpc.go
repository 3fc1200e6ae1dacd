// Package rpc holds what every Berth gRPC endpoint shares: TLS 1.3 only, bounded message sizes and times,
// the attestation nonce of a stream's connection, and receiving with a deadline.
package rpc

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/pki"
)

// MaxMessageSize bounds every message either way. The largest legitimate one is a join ticket with the
// control-plane files (a few tens of KiB) or init progress; 256 KiB leaves room without inviting abuse.
const MaxMessageSize = 256 << 10

// MaxHeaderListSize bounds a request's headers. Berth's clients send a few hundred bytes (method, content
// type, deadline, user agent); gRPC's default of 16 MiB would let a handful of unauthenticated streams
// hold hundreds of MiB of the server's memory.
const MaxHeaderListSize = 16 << 10

// connBufferSize is each served connection's read and write buffer: Berth's messages are a few KiB, and
// the largest (a ticket, 256 KiB at most) takes a few more reads.
const connBufferSize = 8 << 10

// ServerOptions are the options of every Berth gRPC server: TLS 1.3 with cert, bounded messages,
// a handshake timeout, few streams per connection, and idle connections closed soon: nodes open one
// connection per exchange, so an idle one only holds a slot of an AdmitListener.
func ServerOptions(cert tls.Certificate) []grpc.ServerOption {
	cfg := &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{cert},
	}
	return []grpc.ServerOption{
		grpc.Creds(credentials.NewTLS(cfg)),
		grpc.MaxRecvMsgSize(MaxMessageSize),
		grpc.MaxSendMsgSize(MaxMessageSize),
		grpc.MaxHeaderListSize(MaxHeaderListSize),
		grpc.ConnectionTimeout(10 * time.Second),
		grpc.MaxConcurrentStreams(8),
		// A connection's buffers are most of what it costs while its peer is silent; gRPC's defaults (32 KiB
		// each way, the write buffer kept between writes) are sized for streams of large messages.
		grpc.ReadBufferSize(connBufferSize),
		grpc.WriteBufferSize(connBufferSize),
		grpc.SharedWriteBuffer(true),
		grpc.KeepaliveParams(keepalive.ServerParameters{MaxConnectionIdle: 15 * time.Second, MaxConnectionAge: 10 * time.Minute}),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second}),
	}
}

// StopGracefully stops s, letting running calls finish for at most d.
func StopGracefully(s *grpc.Server, d time.Duration) {
	done := make(chan struct{})
	go func() {
		s.GracefulStop()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(d):
		s.Stop()
	}
}

// PinnedTLS is the client side towards a join service: TLS 1.3, and the server's chain must contain a CA
// whose SubjectPublicKeyInfo hashes to pin. Names are not checked: nodes reach the service by address or
// through a load balancer, and only join services ever receive certificates from the join CA.
func PinnedTLS(pin string, now func() time.Time) (*tls.Config, error) {
	if _, err := pki.ParsePin(pin); err != nil {
		return nil, fmt.Errorf("join CA pin: %w", err)
	}
	if now == nil {
		now = time.Now
	}
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		// Verification is not skipped: VerifyPeerCertificate verifies the whole chain against the pinned CA.
		InsecureSkipVerify: true,
		VerifyPeerCertificate: func(raw [][]byte, _ [][]*x509.Certificate) error {
			return pki.VerifyPinnedChain(pin, raw, "", now())
		},
	}, nil
}

// DialOptions are the client options matching ServerOptions, with a dialer that can bind a source address
// (several lab nodes share one host's loopback) and tls for transport security.
func DialOptions(tlsCfg *tls.Config, localAddr netip.Addr) []grpc.DialOption {
	return ObservedDialOptions(tlsCfg, localAddr, nil)
}

// ObservedDialOptions are DialOptions whose dialer tells dialed (when not nil) the outcome of each TCP
// connection attempt, before gRPC sees it: a client can tell a server that refused the connection (nothing
// listens) from one that answered, which gRPC's status does not say in a form one can test.
func ObservedDialOptions(tlsCfg *tls.Config, localAddr netip.Addr, dialed func(error)) []grpc.DialOption {
	d := &net.Dialer{Timeout: 10 * time.Second}
	if localAddr.IsValid() {
		d.LocalAddr = &net.TCPAddr{IP: localAddr.AsSlice()}
	}
	return []grpc.DialOption{
		grpc.WithTransportCredentials(credentials.NewTLS(tlsCfg)),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			conn, err := d.DialContext(ctx, "tcp", addr)
			if dialed != nil {
				dialed(err)
			}
			return conn, err
		}),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(MaxMessageSize), grpc.MaxCallSendMsgSize(MaxMessageSize)),
	}
}

// StreamNonce is the attestation nonce of the connection a stream runs on; it works on either end.
func StreamNonce(ctx context.Context) ([]byte, error) {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return nil, errors.New("no peer on the stream")
	}
	info, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok {
		return nil, errors.New("stream is not on a TLS connection")
	}
	return attest.Nonce(&info.State)
}

// PeerAddr is the remote address of a stream's connection, with IPv4-mapped IPv6 addresses unmapped.
func PeerAddr(ctx context.Context) (netip.Addr, error) {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return netip.Addr{}, errors.New("no peer on the stream")
	}
	ap, err := netip.ParseAddrPort(p.Addr.String())
	if err != nil {
		return netip.Addr{}, fmt.Errorf("peer address %q: %w", p.Addr, err)
	}
	return ap.Addr().Unmap(), nil
}

// FirstMessageTimeout is how long a server waits for a stream's first message: a node sends it once its
// TPM has quoted, which a slow discrete TPM takes a second or two for, more under load. A peer that holds a
// stream silent holds a connection slot this long and no longer.
const FirstMessageTimeout = 10 * time.Second

// RecvWithin receives one message within d (and within ctx).
func RecvWithin[T any](ctx context.Context, s Receiver[T], d time.Duration) (*T, error) {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	return Recv(ctx, s)
}

// Receiver is the receiving half of a gRPC stream.
type Receiver[T any] interface {
	Recv() (*T, error)
}

// Recv receives one message or fails when ctx ends first. gRPC's Recv blocks without a deadline of its own;
// the goroutine left behind ends when the handler returns and gRPC cancels the stream.
func Recv[T any](ctx context.Context, s Receiver[T]) (*T, error) {
	type result struct {
		msg *T
		err error
	}
	ch := make(chan result, 1)
	go func() {
		m, err := s.Recv()
		ch <- result{m, err}
	}()
	select {
	case r := <-ch:
		return r.msg, r.err
	case <-ctx.Done():
		return nil, status.FromContextError(ctx.Err()).Err()
	}
}

// StepTimeout bounds each later message of an exchange whose every step is computed at once from the one
// before: a peer slower than this holds what the exchange holds without working.
const StepTimeout = 10 * time.Second

// ErrBusy is a server's answer when its one exchange slot stayed taken: the client may ask again.
var ErrBusy = status.Error(codes.Unavailable, "busy")

// IsBusy reports whether err, however wrapped, is a server's ErrBusy.
func IsBusy(err error) bool {
	var se interface{ GRPCStatus() *status.Status }
	if !errors.As(err, &se) {
		return false
	}
	st := se.GRPCStatus()
	return st.Code() == codes.Unavailable && st.Message() == "busy"
}

// Slot lets one exchange run at a time, for work a node can do only once at a time (its TPM, 64 MiB of
// argon2id, its disk key).
type Slot chan struct{}

// NewSlot returns a free slot.
func NewSlot() Slot { return make(Slot, 1) }

// Take waits up to wait for the slot; on true the caller must Release it. Waiters are served in order.
func (s Slot) Take(ctx context.Context, wait time.Duration) bool {
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case s <- struct{}{}:
		return true
	case <-t.C:
		return false
	case <-ctx.Done():
		return false
	}
}

// Release frees the slot.
func (s Slot) Release() { <-s }

// Waits between attempts of RetryBusy: a busy server's slot is held for seconds, or for as long as another
// client keeps its exchange going.
const (
	busyRetryBase = 500 * time.Millisecond
	busyRetryMax  = 5 * time.Second
)

// RetryBusy runs attempt until it ends with anything but ErrBusy or ctx ends, waiting longer after each busy
// answer (up to five seconds). busy, if set, hears of each busy answer before the wait. When ctx ends first,
// the error is the last busy answer, also when ctx ended during an attempt that followed one: the server
// was busy all along, and saying only "deadline exceeded" would hide why.
func RetryBusy[T any](ctx context.Context, attempt func() (T, error), busy func(attempt int, wait time.Duration)) (T, error) {
	wait := busyRetryBase
	var lastBusy error
	for n := 1; ; n++ {
		res, err := attempt()
		if !IsBusy(err) {
			if err != nil && lastBusy != nil && ctx.Err() != nil {
				return res, fmt.Errorf("%w (asked %d times; the last attempt ran out of time: %w)", lastBusy, n, err)
			}
			return res, err
		}
		lastBusy = err
		if busy != nil {
			busy(n, wait)
		}
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return res, fmt.Errorf("%w (asked %d times)", err, n)
		}
		wait = min(2*wait, busyRetryMax)
	}
}
