package telemetry

import (
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"
)

// Connection bounds of the health and metrics port. Its clients are a Prometheus server or two, kubelet's and
// load balancers' probes, each from its own address with a connection or two at a time; anyone else who
// reaches the port is refused past these at once, at the cost of an accept and a close, instead of holding
// the process's memory and file descriptors with idle keep-alive connections.
const (
	maxConnsPerAddress = 8
	maxConns           = 256
	// refusalLogEvery is how often refused connections are summed up in the log.
	refusalLogEvery = 30 * time.Second
)

// limitListener closes, as soon as it accepts them, connections beyond perAddress from one address or
// beyond total in all.
type limitListener struct {
	net.Listener
	perAddress, total int
	log               *slog.Logger

	mu      sync.Mutex
	open    int
	perAddr map[netip.Addr]int
	refused atomic.Int64
	// logged is how many refusals the log has summed up so far; lastLog is when it last did.
	logged  int64
	lastLog time.Time
}

func newLimitListener(inner net.Listener, perAddress, total int, log *slog.Logger) *limitListener {
	return &limitListener{Listener: inner, perAddress: perAddress, total: total, log: log, perAddr: map[netip.Addr]int{}}
}

func (l *limitListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		ap, err := netip.ParseAddrPort(c.RemoteAddr().String())
		if err != nil {
			c.Close()
			l.refuse()
			continue
		}
		addr := ap.Addr().Unmap()
		if !l.take(addr) {
			c.Close()
			l.refuse()
			continue
		}
		return &limitedConn{Conn: c, release: func() { l.release(addr) }}, nil
	}
}

func (l *limitListener) take(addr netip.Addr) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.open >= l.total || l.perAddr[addr] >= l.perAddress {
		return false
	}
	l.open++
	l.perAddr[addr]++
	return true
}

func (l *limitListener) release(addr netip.Addr) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.open--
	if l.perAddr[addr]--; l.perAddr[addr] <= 0 {
		delete(l.perAddr, addr)
	}
}

// refuse counts a refusal and logs the count since the last line, at most every refusalLogEvery: a line per
// refusal would let a flood fill the disk. The first refusal after a quiet spell is logged at once.
func (l *limitListener) refuse() {
	n := l.refused.Add(1)
	l.mu.Lock()
	now := time.Now()
	due := now.Sub(l.lastLog) >= refusalLogEvery
	since := n - l.logged
	if due {
		l.logged, l.lastLog = n, now
	}
	l.mu.Unlock()
	if due {
		l.log.Warn("health and metrics connections refused", "count", since, "per_address_limit", l.perAddress, "limit", l.total)
	}
}

// limitedConn gives its place back once, at its first Close.
type limitedConn struct {
	net.Conn
	once    sync.Once
	release func()
}

func (c *limitedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.release)
	return err
}
