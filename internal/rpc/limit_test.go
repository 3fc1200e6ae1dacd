package rpc

import (
	"errors"
	"net"
	"testing"
	"time"
)

// TestLimitListener holds two connections to a listener limited to two: a third waits until one closes,
// and Close of the listener ends an Accept that waits for a slot.
func TestLimitListener(t *testing.T) {
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := LimitListener(inner, 2)
	accepted := make(chan net.Conn, 3)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				close(accepted)
				return
			}
			accepted <- c
		}
	}()
	for range 3 {
		c, err := net.Dial("tcp", inner.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
	}
	first, second := <-accepted, <-accepted
	select {
	case <-accepted:
		t.Fatal("a third connection was accepted while two were open")
	case <-time.After(200 * time.Millisecond):
	}
	first.Close()
	first.Close() // a second Close must not free a second slot
	select {
	case c := <-accepted:
		defer c.Close()
	case <-time.After(5 * time.Second):
		t.Fatal("closing a connection did not let the waiting one in")
	}
	fourth, err := net.Dial("tcp", inner.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer fourth.Close()
	select {
	case <-accepted:
		t.Fatal("a fourth connection was accepted: closing one connection twice freed two slots")
	case <-time.After(200 * time.Millisecond):
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case _, ok := <-accepted:
		if ok {
			t.Fatal("accepted a connection after Close")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Accept still waits for a slot after Close")
	}
	second.Close()
	if _, err := l.Accept(); !errors.Is(err, net.ErrClosed) {
		t.Errorf("Accept after Close = %v, want net.ErrClosed", err)
	}
}
