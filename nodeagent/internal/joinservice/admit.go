package joinservice

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/rpc"
)

// DefaultTimeout bounds one exchange when Config.Timeout is zero: slow TPMs included.
const DefaultTimeout = 30 * time.Second

// Listen wraps inner in the admission every join service needs (see docs/agent.md, "Limits"): a connection
// from an address without an instance record is closed before its TLS handshake; an address holds at most
// perAddress connections (rpc.DefaultPerAddress if zero); at most slots are served at once; each serves one
// exchange, whose first request must come within rpc.DefaultFirstStream and which ends within the service's
// Timeout.
func (s *Server) Listen(inner net.Listener, slots, perAddress int) *Listener {
	l := &Listener{slots: max(slots, 1)}
	l.AdmitListener = rpc.Admit(&countedListener{Listener: inner, open: &l.open}, rpc.AdmitConfig{
		Slots: slots, PerAddress: perAddress, Admit: s.admit, Exchange: s.cfg.Timeout, Logger: s.cfg.Logger,
	})
	return l
}

// Listener is the join service's admitting listener, which also keeps count of its connections for the
// metrics: two atomic additions per connection, off the admission's checks.
type Listener struct {
	*rpc.AdmitListener
	slots int
	// open are the connections accepted from the kernel and not yet closed; serving those of them handed
	// to the server (each holding a slot).
	open, serving atomic.Int64
}

// Accept returns the next admitted connection, counted as serving until closed.
func (l *Listener) Accept() (net.Conn, error) {
	c, err := l.AdmitListener.Accept()
	if err != nil {
		return nil, err
	}
	l.serving.Add(1)
	return &countedConn{Conn: c, count: &l.serving}, nil
}

// Connections are the connections being served, those accepted but not served yet (being admitted or
// waiting for a slot), and how many may be served at once.
func (l *Listener) Connections() (serving, waiting, slots int) {
	// Read serving first: a connection counted in serving is already in open, so waiting never counts a
	// served one, though a connection closing between the two reads may make it negative.
	serving = int(l.serving.Load())
	open := int(l.open.Load())
	return serving, max(open-serving, 0), l.slots
}

// countedListener counts the connections its Accept returned until each is closed.
type countedListener struct {
	net.Listener
	open *atomic.Int64
}

func (l *countedListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	l.open.Add(1)
	return &countedConn{Conn: c, count: l.open}, nil
}

// countedConn takes itself off count once, at its first Close; the admission and gRPC may both close it.
type countedConn struct {
	net.Conn
	count *atomic.Int64
	once  sync.Once
}

func (c *countedConn) Close() error {
	c.once.Do(func() { c.count.Add(-1) })
	return c.Conn.Close()
}

// admit lets in an address that has an instance record: a node's attestation is checked against that record,
// so an address without one could only ever be refused, after a TLS handshake and an EK chain's worth of CPU.
func (s *Server) admit(ctx context.Context, addr netip.Addr) error {
	_, err := s.cfg.Instances.InstanceByAddress(ctx, addr)
	if errors.Is(err, metadata.ErrNotFound) {
		return fmt.Errorf("%w: %w", rpc.ErrNotAdmitted, err)
	}
	return err
}
