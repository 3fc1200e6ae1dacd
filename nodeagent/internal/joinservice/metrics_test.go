package joinservice

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/rpc"
)

// anyInstance admits every address.
type anyInstance struct{}

func (anyInstance) InstanceByAddress(_ context.Context, a netip.Addr) (*metadata.Instance, error) {
	return &metadata.Instance{Name: "node", Role: metadata.RoleWorker, Addresses: []netip.Addr{a}}, nil
}

// recorded is what a Metrics was told, one "result call reason" a line.
type recorded []string

func (r *recorded) TicketIssued(call string, _ time.Duration) { *r = append(*r, "issued "+call) }
func (r *recorded) TicketRefused(call, reason string, _ time.Duration) {
	*r = append(*r, "refused "+call+" "+reason)
}
func (r *recorded) ExchangeFailed(call, kind string, _ time.Duration) {
	*r = append(*r, "error "+call+" "+kind)
}

// TestExchangesCounted: an exchange's result reaches the metrics with the refusal's reason or the error's
// kind, and the node still gets the gRPC status it always did.
func TestExchangesCounted(t *testing.T) {
	rec := &recorded{}
	s := &Server{cfg: Config{Metrics: rec}}
	log := slog.New(slog.DiscardHandler)
	refused := s.refuse(log, RefusedMeasurements, codes.PermissionDenied, "measurements refused", errors.New("no image"))
	failed := s.fail(log, "issuing join ticket", errors.New("API server down"))
	for _, tc := range []struct {
		call string
		err  error
	}{
		{CallJoin, nil},
		{CallRejoin, fmt.Errorf("wrapped: %w", refused)},
		{CallRenew, failed},
		{CallJoin, status.Error(codes.Canceled, "receiving request: stream ended")},
	} {
		err := tc.err
		s.observe(tc.call, time.Now(), &err)
	}
	want := recorded{"issued join", "refused rejoin measurements", "error renew internal", "error join stream"}
	if !slices.Equal(*rec, want) {
		t.Errorf("counted %q, want %q", *rec, want)
	}
	if st := status.Convert(refused); st.Code() != codes.PermissionDenied || st.Message() != "measurements refused: no image" {
		t.Errorf("a refusal's status: %v %q", st.Code(), st.Message())
	}
	if st := status.Convert(failed); st.Code() != codes.Unavailable {
		t.Errorf("a failure's status: %v", st.Code())
	}
}

// TestListenerCountsConnections: a connection waits until the server accepts it, serves until closed, and
// leaves no count behind however often it is closed.
func TestListenerCountsConnections(t *testing.T) {
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &Server{cfg: Config{Instances: anyInstance{}, Timeout: time.Minute, Logger: slog.New(slog.DiscardHandler)}}
	l := s.Listen(inner, 3, 2)
	t.Cleanup(func() { l.Close() })
	c, err := net.Dial("tcp", inner.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	served, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	if serving, waiting, slots := l.Connections(); serving != 1 || waiting != 0 || slots != 3 {
		t.Errorf("one connection served: serving %d, waiting %d, slots %d", serving, waiting, slots)
	}
	served.Close()
	served.Close()
	if serving, waiting, _ := l.Connections(); serving != 0 || waiting != 0 {
		t.Errorf("after the connection closed twice: serving %d, waiting %d", serving, waiting)
	}
}

// BenchmarkAdmission is a connection's way through the admission, from the kernel's accept to the server's
// Accept and Close, with the service's connection counts (Listen) and without them (rpc.Admit alone): the
// counts must not slow the checks a storm of strangers runs into.
func BenchmarkAdmission(b *testing.B) {
	for _, counted := range []bool{false, true} {
		b.Run(fmt.Sprintf("counted=%v", counted), func(b *testing.B) {
			inner, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				b.Fatal(err)
			}
			s := &Server{cfg: Config{Instances: anyInstance{}, Timeout: time.Minute, Logger: slog.New(slog.DiscardHandler)}}
			var l net.Listener
			if counted {
				l = s.Listen(inner, 64, 2)
			} else {
				l = rpc.Admit(inner, rpc.AdmitConfig{Slots: 64, PerAddress: 2, Admit: s.admit, Exchange: time.Minute})
			}
			b.Cleanup(func() { l.Close() })
			for b.Loop() {
				c, err := net.Dial("tcp", inner.Addr().String())
				if err != nil {
					b.Fatal(err)
				}
				served, err := l.Accept()
				if err != nil {
					b.Fatal(err)
				}
				served.Close()
				c.Close()
			}
		})
	}
}
