// Package rpctest drives a gRPC streaming handler without gRPC, for fuzzing and logic tests: a stream
// whose messages come from the test, with a peer that has a real TLS 1.3 connection state, so that the
// handler's address and attestation-nonce code runs as it does under gRPC.
package rpctest

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"

	"github.com/berthlabs/berth/internal/pki"
)

// PeerContext is a context whose peer is from, on a TLS 1.3 connection made for it (both ends in memory).
func PeerContext(t testing.TB, from netip.Addr) context.Context {
	t.Helper()
	now := time.Now()
	ca, err := pki.NewCA("rpctest", now, 2*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	key, err := pki.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := ca.IssueServer(key.Public(), []string{"rpctest"}, nil, now, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	c, s := net.Pipe()
	t.Cleanup(func() { c.Close(); s.Close() })
	server := tls.Server(s, &tls.Config{MinVersion: tls.VersionTLS13,
		Certificates: []tls.Certificate{{Certificate: [][]byte{leaf.Raw}, PrivateKey: key}}})
	client := tls.Client(c, &tls.Config{MinVersion: tls.VersionTLS13, InsecureSkipVerify: true})
	done := make(chan error, 1)
	go func() { done <- client.Handshake() }()
	if err := errors.Join(server.Handshake(), <-done); err != nil {
		t.Fatal(err)
	}
	return peer.NewContext(context.Background(), &peer.Peer{
		Addr:     net.TCPAddrFromAddrPort(netip.AddrPortFrom(from, 40000)),
		AuthInfo: credentials.TLSInfo{State: server.ConnectionState()},
	})
}

// Stream is the server side of a bidirectional stream: Recv hands out In in order and then io.EOF; Send
// appends to Out.
type Stream[Req, Resp any] struct {
	grpc.ServerStream
	Ctx context.Context

	mu  sync.Mutex
	In  []*Req
	Out []*Resp
}

var _ grpc.BidiStreamingServer[int, int] = (*Stream[int, int])(nil)

// Context is the stream's context.
func (s *Stream[Req, Resp]) Context() context.Context { return s.Ctx }

// Recv returns the next message of In, or io.EOF.
func (s *Stream[Req, Resp]) Recv() (*Req, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.In) == 0 {
		return nil, io.EOF
	}
	m := s.In[0]
	s.In = s.In[1:]
	return m, nil
}

// Send records m.
func (s *Stream[Req, Resp]) Send(m *Resp) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.Out = append(s.Out, m)
	return nil
}
