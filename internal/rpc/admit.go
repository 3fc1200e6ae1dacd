package rpc

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
)

// Defaults of AdmitConfig.
const (
	// DefaultPerAddress lets a node hold one exchange and the one its retry opens while the first closes.
	DefaultPerAddress = 2
	// DefaultFirstStream covers a TLS 1.3 handshake and the first request's headers, which a node sends
	// at once after connecting: a peer that has done neither by then is not a node at work.
	DefaultFirstStream = 5 * time.Second
	// DefaultAdmitTimeout bounds the admission check (an instance lookup, usually answered from a cache).
	DefaultAdmitTimeout = 3 * time.Second
	// refusalLogInterval is how often refused connections are summed up in the log: one line per refusal
	// would let a flood write the operator's disk full.
	refusalLogInterval = 30 * time.Second
	// lingerAfterExchange gives the last frames of an exchange (the status trailer) time to reach the
	// peer before the connection is closed.
	lingerAfterExchange = 2 * time.Second
)

// Reasons a connection is refused before its TLS handshake, as the refusal summaries count them.
const (
	RefusedAddressLimit = "address_limit"
	RefusedNotAdmitted  = "not_admitted"
	RefusedAdmitFailed  = "admission_failed"
	RefusedBadAddress   = "bad_address"
	RefusedNoSlot       = "no_slot"
)

// ErrNotAdmitted is what an Admit function returns (wrapped) for a peer that may not connect, as opposed to
// a check that could not be made.
var ErrNotAdmitted = errors.New("not admitted")

// AdmitConfig bounds what peers can make a server spend before they proved anything. All fields but
// Slots have defaults.
type AdmitConfig struct {
	// Slots bounds the connections being served at once. Admitted connections beyond it wait for a slot,
	// up to SlotWait, and connections beyond four times it wait unaccepted in the kernel's listen queue.
	Slots int
	// SlotWait is how long an admitted connection waits for a slot before it is closed; FirstStream if
	// zero. Its client connects again later: a wait without end would let whoever holds the slots keep a
	// queue of genuine peers behind them, each unaware that it is not being served.
	SlotWait time.Duration
	// PerAddress bounds one remote address's connections, admitted, waiting or being checked.
	PerAddress int
	// Admit, if set, decides from the remote address alone whether a connection may be served, before
	// the server spends a TLS handshake on it. It must answer fast (a cached instance lookup): it runs for
	// every connection, with at most four times Slots checks at once. An error wrapping ErrNotAdmitted
	// refuses the peer; any other error is a failed check, and refuses it too.
	Admit func(ctx context.Context, addr netip.Addr) error
	// AdmitTimeout bounds one Admit call.
	AdmitTimeout time.Duration
	// FirstStream is how long a served connection has for its TLS handshake and its first request.
	FirstStream time.Duration
	// Exchange bounds a connection's life from its first request on: the handler's own timeout, the
	// longest legitimate exchange. The connection closes a moment after that, or after the handler ends.
	Exchange time.Duration
	Logger   *slog.Logger
}

// AdmitListener is a listener that admits before it serves: a connection is refused before its TLS
// handshake when its address has too many connections already or Admit says no; the connections it hands
// out take one of Slots, carry deadlines for their first request and their exchange, and, with
// OneExchange, serve a single stream.
type AdmitListener struct {
	inner    net.Listener
	cfg      AdmitConfig
	checking chan struct{}
	slots    chan struct{}
	conns    chan net.Conn
	done     chan struct{}
	stop     sync.Once
	loops    sync.WaitGroup

	mu        sync.Mutex
	perAddr   map[netip.Addr]int
	refused   map[string]int
	window    map[string]int
	windowIPs map[netip.Addr]struct{}
}

// Admit wraps inner; the listener accepts on inner from now on, until Close.
func Admit(inner net.Listener, cfg AdmitConfig) *AdmitListener {
	cfg.Slots = max(cfg.Slots, 1)
	cfg.PerAddress = cmp.Or(cfg.PerAddress, DefaultPerAddress)
	cfg.AdmitTimeout = cmp.Or(cfg.AdmitTimeout, DefaultAdmitTimeout)
	cfg.FirstStream = cmp.Or(cfg.FirstStream, DefaultFirstStream)
	cfg.SlotWait = cmp.Or(cfg.SlotWait, cfg.FirstStream)
	cfg.Exchange = cmp.Or(cfg.Exchange, time.Minute)
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	l := &AdmitListener{
		inner: inner, cfg: cfg,
		checking: make(chan struct{}, 4*cfg.Slots),
		slots:    make(chan struct{}, cfg.Slots),
		conns:    make(chan net.Conn),
		done:     make(chan struct{}),
		perAddr:  map[netip.Addr]int{}, refused: map[string]int{}, window: map[string]int{}, windowIPs: map[netip.Addr]struct{}{},
	}
	l.loops.Add(2)
	go l.acceptLoop()
	go l.logRefusals()
	return l
}

// Accept returns the next admitted connection, once it has a slot.
func (l *AdmitListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

// Close stops accepting; connections already handed out stay open until their server closes them.
func (l *AdmitListener) Close() error {
	err := l.inner.Close()
	l.stop.Do(func() { close(l.done) })
	l.loops.Wait()
	return err
}

// Addr is the inner listener's address.
func (l *AdmitListener) Addr() net.Addr { return l.inner.Addr() }

// Refused is how many connections were refused since the start, by reason.
func (l *AdmitListener) Refused() map[string]int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return maps.Clone(l.refused)
}

func (l *AdmitListener) acceptLoop() {
	defer l.loops.Done()
	var delay time.Duration
	for {
		select {
		case l.checking <- struct{}{}:
		case <-l.done:
			return
		}
		c, err := l.inner.Accept()
		if err != nil {
			<-l.checking
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of file descriptors, say, under a flood: the listener is still good, and the service
			// must not stop serving for good because of it. Wait a little, as net/http's server does.
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			l.cfg.Logger.Error("accepting connections; trying again", "error", err, "retry_in", delay)
			select {
			case <-time.After(delay):
				continue
			case <-l.done:
				return
			}
		}
		delay = 0
		go l.admit(c)
	}
}

// admit runs the checks for c, cheapest first, and hands it to Accept once it has a slot.
func (l *AdmitListener) admit(c net.Conn) {
	released := false
	releaseChecking := func() {
		if !released {
			released = true
			<-l.checking
		}
	}
	defer releaseChecking()
	addr, err := remoteAddr(c)
	if err != nil {
		l.refuse(c, addr, RefusedBadAddress, err)
		return
	}
	if !l.takeAddress(addr) {
		l.refuse(c, addr, RefusedAddressLimit, fmt.Errorf("%d connections from this address already", l.cfg.PerAddress))
		return
	}
	if l.cfg.Admit != nil {
		ctx, cancel := context.WithTimeout(context.Background(), l.cfg.AdmitTimeout)
		err := l.cfg.Admit(ctx, addr)
		cancel()
		if err != nil {
			reason := RefusedAdmitFailed
			if errors.Is(err, ErrNotAdmitted) {
				reason = RefusedNotAdmitted
			}
			l.releaseAddress(addr)
			l.refuse(c, addr, reason, err)
			return
		}
	}
	releaseChecking()
	wait := time.NewTimer(l.cfg.SlotWait)
	defer wait.Stop()
	select {
	case l.slots <- struct{}{}:
	case <-wait.C:
		l.releaseAddress(addr)
		l.refuse(c, addr, RefusedNoSlot, fmt.Errorf("no free slot of %d within %s", l.cfg.Slots, l.cfg.SlotWait))
		return
	case <-l.done:
		l.releaseAddress(addr)
		c.Close()
		return
	}
	ac := &admittedConn{Conn: c, exchange: l.cfg.Exchange}
	ac.release = func() {
		<-l.slots
		l.releaseAddress(addr)
	}
	ac.addr = &admittedAddr{Addr: c.RemoteAddr(), conn: ac}
	// A timer, not a deadline: gRPC clears the connection's deadlines after its handshake. Closing the
	// connection under gRPC fails its transport, which then closes it as usual.
	ac.resetTimer(l.cfg.FirstStream)
	select {
	case l.conns <- ac:
	case <-l.done:
		ac.Close()
	}
}

func (l *AdmitListener) takeAddress(addr netip.Addr) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.perAddr[addr] >= l.cfg.PerAddress {
		return false
	}
	l.perAddr[addr]++
	return true
}

func (l *AdmitListener) releaseAddress(addr netip.Addr) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.perAddr[addr]--; l.perAddr[addr] <= 0 {
		delete(l.perAddr, addr)
	}
}

// refuse closes c and counts why; the reason reaches the log in the next summary (and at debug level now).
func (l *AdmitListener) refuse(c net.Conn, addr netip.Addr, reason string, err error) {
	c.Close()
	l.mu.Lock()
	l.refused[reason]++
	l.window[reason]++
	if len(l.windowIPs) < 1024 {
		l.windowIPs[addr] = struct{}{}
	}
	l.mu.Unlock()
	l.cfg.Logger.Debug("connection refused", "peer", addr.String(), "reason", reason, "error", err)
}

func (l *AdmitListener) logRefusals() {
	defer l.loops.Done()
	t := time.NewTicker(refusalLogInterval)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			l.flushRefusals()
		case <-l.done:
			l.flushRefusals()
			return
		}
	}
}

// flushRefusals logs the refusals since the last summary, if there were any.
func (l *AdmitListener) flushRefusals() {
	l.mu.Lock()
	window, addrs := l.window, len(l.windowIPs)
	var example string
	for a := range l.windowIPs {
		example = a.String()
		break
	}
	l.window, l.windowIPs = map[string]int{}, map[netip.Addr]struct{}{}
	l.mu.Unlock()
	if len(window) == 0 {
		return
	}
	attrs := []any{"addresses", addrs, "example_peer", example}
	total := 0
	for reason, n := range window {
		attrs = append(attrs, reason, n)
		total += n
	}
	l.cfg.Logger.Warn("connections refused before their TLS handshake", append([]any{"count", total}, attrs...)...)
}

func remoteAddr(c net.Conn) (netip.Addr, error) {
	ap, err := netip.ParseAddrPort(c.RemoteAddr().String())
	if err != nil {
		return netip.Addr{}, fmt.Errorf("remote address %q: %w", c.RemoteAddr(), err)
	}
	return ap.Addr().Unmap(), nil
}

// admittedConn is a served connection: it holds a slot until closed and allows one stream.
type admittedConn struct {
	net.Conn
	addr     *admittedAddr
	exchange time.Duration
	streams  atomic.Int32
	once     sync.Once
	release  func()

	mu sync.Mutex
	// timer closes the connection: at first when no stream began in time, then when the exchange is over.
	timer *time.Timer
}

// resetTimer closes the connection after d from now.
func (c *admittedConn) resetTimer(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.timer == nil {
		c.timer = time.AfterFunc(d, func() { c.Close() })
		return
	}
	c.timer.Reset(d)
}

// RemoteAddr carries the connection to OneExchange: gRPC puts it in every stream's peer.
func (c *admittedConn) RemoteAddr() net.Addr { return c.addr }

func (c *admittedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() {
		c.mu.Lock()
		c.timer.Stop()
		c.mu.Unlock()
		c.release()
	})
	return err
}

type admittedAddr struct {
	net.Addr
	conn *admittedConn
}

// OneExchange is the server option that goes with an AdmitListener: a connection serves one stream, which
// must end within the listener's Exchange, and the connection closes soon after it. A peer that wants
// another exchange connects again and is admitted again.
func OneExchange() grpc.ServerOption {
	return grpc.ChainStreamInterceptor(func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		p, ok := peer.FromContext(ss.Context())
		if !ok {
			return handler(srv, ss)
		}
		a, ok := p.Addr.(*admittedAddr)
		if !ok {
			return handler(srv, ss)
		}
		c := a.conn
		if c.streams.Add(1) > 1 {
			return status.Error(codes.ResourceExhausted, "one exchange per connection: connect again")
		}
		c.resetTimer(c.exchange + lingerAfterExchange)
		defer c.resetTimer(lingerAfterExchange)
		return handler(srv, ss)
	})
}
