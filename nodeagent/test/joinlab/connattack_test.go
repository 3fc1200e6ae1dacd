package joinlab

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/rpc"
)

// connectionAttacks are the attacks on the service's connections rather than its checks, from n's address:
// each is refused with its own code and the service goes on serving n.
func (l *Lab) connectionAttacks(t *testing.T, n *Node) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dial := func(t *testing.T) berthv1.JoinServiceClient {
		tlsCfg, err := rpc.PinnedTLS(pki.SPKIPin(l.JoinCA.Cert), nil)
		if err != nil {
			t.Fatal(err)
		}
		conn, err := grpc.NewClient(l.JoinAddr, rpc.DialOptions(tlsCfg, n.Addr)...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return berthv1.NewJoinServiceClient(conn)
	}
	check := func(t *testing.T, err error, code codes.Code, message string) {
		t.Helper()
		st := status.Convert(err)
		if st.Code() != code || !strings.Contains(st.Message(), message) {
			t.Fatal(l.Logs.Logf("refused with %s %q, want %s containing %q", st.Code(), st.Message(), code, message))
		}
		l.assertNoSecret(t, st.Message())
	}

	t.Run("second exchange on one connection", func(t *testing.T) {
		c := dial(t)
		first, err := c.IssueJoinTicket(ctx)
		if err != nil {
			t.Fatal(err)
		}
		// The first exchange runs to its end (a refusal); the connection is still open for a moment.
		if err := first.Send(&berthv1.JoinClientMessage{}); err != nil {
			t.Fatal(err)
		}
		_, err = first.Recv()
		check(t, err, codes.InvalidArgument, "first message must be a join request")
		second, err := c.IssueRejoinTicket(ctx)
		if err != nil {
			t.Fatal(err)
		}
		_, err = second.Recv()
		check(t, err, codes.ResourceExhausted, "one exchange per connection")
	})

	t.Run("stream that never sends its request", func(t *testing.T) {
		st, err := dial(t).IssueJoinTicket(ctx)
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		_, err = st.Recv()
		check(t, err, codes.DeadlineExceeded, "")
		t.Logf("a silent stream was ended after %.1fs", time.Since(start).Seconds())
	})

	t.Run("header flood", func(t *testing.T) {
		flood := metadata.Pairs("x-flood", strings.Repeat("a", 2*rpc.MaxHeaderListSize))
		st, err := dial(t).IssueJoinTicket(metadata.NewOutgoingContext(ctx, flood))
		if err == nil {
			_, err = st.Recv()
		}
		// gRPC's client itself keeps to the limit the server announced; internal/rpc's header test shows
		// the server's refusal to a client that does not.
		check(t, err, codes.Internal, "header list size")
	})

	t.Run("the service still serves the node", func(t *testing.T) {
		if msg, err := (attack{node: n}).run(t, l); err != nil || msg.GetJoinTicket() == nil {
			t.Fatalf("honest join after the connection attacks: %v", err)
		}
	})
}
