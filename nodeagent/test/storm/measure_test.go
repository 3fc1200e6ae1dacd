package storm

import (
	"net"
	"net/netip"
	"testing"
)

// Five connections to a listener that accepted one: five established, four in its accept queue.
func TestCountConnections(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	addr := netip.MustParseAddrPort(l.Addr().String())
	var conns []net.Conn
	for range 5 {
		c, err := net.Dial("tcp", addr.String())
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	a, _ := l.Accept()
	defer a.Close()
	n, ok := countConnections(addr)
	if !ok || n.Established != 5 || n.AcceptQueue != 4 {
		t.Fatalf("countConnections = %+v, %v; want 5 established, 4 waiting to be accepted", n, ok)
	}
	for _, c := range conns {
		c.Close()
	}
}
