package instancecache_test

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/instancecache"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/test/clocktest"
)

// countingLookup knows one instance and counts the calls per address; release, if set, holds every call
// until it is closed.
type countingLookup struct {
	mu      sync.Mutex
	calls   map[netip.Addr]int
	known   netip.Addr
	fail    error
	release chan struct{}
}

func (l *countingLookup) InstanceByAddress(_ context.Context, addr netip.Addr) (*metadata.Instance, error) {
	l.mu.Lock()
	if l.calls == nil {
		l.calls = map[netip.Addr]int{}
	}
	l.calls[addr]++
	fail := l.fail
	l.mu.Unlock()
	if l.release != nil {
		<-l.release
	}
	switch {
	case fail != nil:
		return nil, fail
	case addr != l.known:
		return nil, fmt.Errorf("%w: %s", metadata.ErrNotFound, addr)
	}
	return &metadata.Instance{Name: "worker-0", Role: metadata.RoleWorker, Addresses: []netip.Addr{addr}}, nil
}

func (l *countingLookup) count(addr netip.Addr) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.calls[addr]
}

var (
	known   = netip.MustParseAddr("10.0.0.11")
	unknown = netip.MustParseAddr("10.0.0.66")
)

func TestCacheKeepsAnswersForTTL(t *testing.T) {
	ctx := context.Background()
	lookup := &countingLookup{known: known}
	clock := clocktest.New(time.Unix(1e9, 0))
	c := instancecache.New(instancecache.Config{Lookup: lookup, TTL: 5 * time.Second, Clock: clock.Now})

	for range 3 {
		inst, err := c.InstanceByAddress(ctx, known)
		if err != nil || inst.Name != "worker-0" {
			t.Fatalf("known address: %v, %v", inst, err)
		}
		if _, err := c.InstanceByAddress(ctx, unknown); !errors.Is(err, metadata.ErrNotFound) {
			t.Fatalf("unknown address: %v, want ErrNotFound", err)
		}
	}
	if n, m := lookup.count(known), lookup.count(unknown); n != 1 || m != 1 {
		t.Fatalf("lookups within the TTL: %d for the known address, %d for the unknown one; want 1 each", n, m)
	}
	// An IPv4-mapped address is the same address.
	if _, err := c.InstanceByAddress(ctx, netip.AddrFrom16(known.As16())); err != nil || lookup.count(known) != 1 {
		t.Fatalf("mapped address: %v, %d lookups; want the cached answer", err, lookup.count(known))
	}

	clock.Advance(5 * time.Second)
	if _, err := c.InstanceByAddress(ctx, known); err != nil || lookup.count(known) != 2 {
		t.Fatalf("after the TTL: %v, %d lookups; want a second lookup", err, lookup.count(known))
	}
}

func TestCacheDoesNotKeepFailures(t *testing.T) {
	lookup := &countingLookup{known: known, fail: errors.New("metadata service unreachable")}
	c := instancecache.New(instancecache.Config{Lookup: lookup})
	for i := range 2 {
		if _, err := c.InstanceByAddress(context.Background(), known); err == nil || errors.Is(err, metadata.ErrNotFound) {
			t.Fatalf("call %d: %v, want the lookup's failure", i, err)
		}
	}
	if n := lookup.count(known); n != 2 {
		t.Fatalf("%d lookups, want 2: a failure is not an answer", n)
	}
}

func TestCacheMergesConcurrentLookups(t *testing.T) {
	lookup := &countingLookup{known: known, release: make(chan struct{})}
	c := instancecache.New(instancecache.Config{Lookup: lookup})
	var wg sync.WaitGroup
	var found atomic.Int32
	for range 50 {
		wg.Go(func() {
			if inst, err := c.InstanceByAddress(context.Background(), known); err == nil && inst.Name == "worker-0" {
				found.Add(1)
			}
		})
	}
	for lookup.count(known) == 0 {
		time.Sleep(time.Millisecond)
	}
	close(lookup.release)
	wg.Wait()
	if n := lookup.count(known); n != 1 || found.Load() != 50 {
		t.Fatalf("%d lookups for 50 concurrent callers (%d got the record), want 1", n, found.Load())
	}
}

func TestCacheCallerStopsWaiting(t *testing.T) {
	lookup := &countingLookup{known: known, release: make(chan struct{})}
	defer close(lookup.release)
	c := instancecache.New(instancecache.Config{Lookup: lookup})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	if _, err := c.InstanceByAddress(ctx, known); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("%v, want the caller's deadline", err)
	}
}

func TestCacheIsBounded(t *testing.T) {
	lookup := &countingLookup{known: known}
	clock := clocktest.New(time.Unix(1e9, 0))
	c := instancecache.New(instancecache.Config{Lookup: lookup, MaxEntries: 4, Clock: clock.Now})
	ctx := context.Background()
	for i := range 4 {
		c.InstanceByAddress(ctx, netip.AddrFrom4([4]byte{10, 1, 0, byte(i)}))
	}
	// Full: the fifth answer is not kept, so asking again asks the lookup again.
	fifth := netip.MustParseAddr("10.1.0.9")
	c.InstanceByAddress(ctx, fifth)
	c.InstanceByAddress(ctx, fifth)
	if n := lookup.count(fifth); n != 2 {
		t.Fatalf("a full cache kept a new answer (%d lookups, want 2)", n)
	}
	// Once the old answers expired they make room.
	clock.Advance(instancecache.DefaultTTL)
	c.InstanceByAddress(ctx, fifth)
	c.InstanceByAddress(ctx, fifth)
	if n := lookup.count(fifth); n != 3 {
		t.Fatalf("expired entries were not dropped for a new one (%d lookups, want 3)", n)
	}
}

func TestCacheCopiesRecords(t *testing.T) {
	c := instancecache.New(instancecache.Config{Lookup: &countingLookup{known: known}})
	a, _ := c.InstanceByAddress(context.Background(), known)
	a.Addresses[0] = unknown
	a.Name = "changed"
	if b, _ := c.InstanceByAddress(context.Background(), known); b.Name != "worker-0" || b.Addresses[0] != known {
		t.Fatalf("a caller's change reached the cache: %+v", b)
	}
}
