// Package instancecache puts a short-lived cache in front of an instance lookup.
//
// A join service looks up the connecting address twice per exchange (once to admit the connection, once
// for the attestation's role), and a storm or an attacker's flood asks about the same addresses many times a
// second. Behind it sits a cloud API with rate limits or the lab's metadata service: the cache answers
// repeated questions from memory, merges concurrent questions about one address into one call, and
// remembers "no such instance" too, so a flood from addresses without a record costs one call per address
// and expiry.
//
// Answers are kept for a few seconds only: an instance record can change (an address given to a new
// instance), and a node whose record appears moments after its first attempt must not wait long.
package instancecache

import (
	"context"
	"errors"
	"net/netip"
	"sync"
	"time"

	"golang.org/x/sync/singleflight"

	"github.com/berthlabs/berth/internal/metadata"
)

// Lookup is the instance lookup the cache stands in front of.
type Lookup interface {
	InstanceByAddress(ctx context.Context, addr netip.Addr) (*metadata.Instance, error)
}

// Defaults of Config.
const (
	DefaultTTL        = 5 * time.Second
	DefaultMaxEntries = 16384
)

// Config configures a Cache; every field but Lookup has a default.
type Config struct {
	Lookup Lookup
	// TTL is how long an answer, found or not found, is kept.
	TTL time.Duration
	// MaxEntries bounds the memory of the cache: a flood from many addresses (an IPv6 prefix) must not grow
	// it without limit. When full, expired entries are dropped; if none are, new answers are not kept.
	MaxEntries int
	Clock      func() time.Time
}

// Cache is a Lookup that remembers answers for TTL. Errors other than metadata.ErrNotFound (the service
// unreachable, a timeout) are never kept.
type Cache struct {
	cfg    Config
	flight singleflight.Group

	mu      sync.Mutex
	entries map[netip.Addr]entry
}

type entry struct {
	inst    *metadata.Instance
	err     error
	expires time.Time
}

// New returns a cache in front of cfg.Lookup.
func New(cfg Config) *Cache {
	if cfg.TTL <= 0 {
		cfg.TTL = DefaultTTL
	}
	if cfg.MaxEntries <= 0 {
		cfg.MaxEntries = DefaultMaxEntries
	}
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	return &Cache{cfg: cfg, entries: map[netip.Addr]entry{}}
}

// InstanceByAddress answers from the cache, or asks the lookup once for all callers asking about addr at
// that moment. Each caller gets its own copy of the record.
func (c *Cache) InstanceByAddress(ctx context.Context, addr netip.Addr) (*metadata.Instance, error) {
	addr = addr.Unmap().WithZone("")
	if e, ok := c.get(addr); ok {
		return copyOf(e.inst), e.err
	}
	// The call runs on the first caller's context; a caller whose context ends first stops waiting for it.
	ch := c.flight.DoChan(addr.String(), func() (any, error) {
		// A caller that missed the cache just before the previous flight stored its answer would otherwise
		// start a second call as soon as that flight ends.
		if e, ok := c.get(addr); ok {
			return e.inst, e.err
		}
		inst, err := c.cfg.Lookup.InstanceByAddress(context.WithoutCancel(ctx), addr)
		if err == nil || errors.Is(err, metadata.ErrNotFound) {
			c.put(addr, entry{inst: inst, err: err, expires: c.cfg.Clock().Add(c.cfg.TTL)})
		}
		return inst, err
	})
	select {
	case r := <-ch:
		inst, _ := r.Val.(*metadata.Instance)
		return copyOf(inst), r.Err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (c *Cache) get(addr netip.Addr) (entry, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.entries[addr]
	if !ok || !c.cfg.Clock().Before(e.expires) {
		return entry{}, false
	}
	return e, true
}

func (c *Cache) put(addr netip.Addr, e entry) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.entries) >= c.cfg.MaxEntries {
		now := c.cfg.Clock()
		for a, old := range c.entries {
			if !now.Before(old.expires) {
				delete(c.entries, a)
			}
		}
		if len(c.entries) >= c.cfg.MaxEntries {
			return
		}
	}
	c.entries[addr] = e
}

// copyOf keeps callers from changing each other's record.
func copyOf(inst *metadata.Instance) *metadata.Instance {
	if inst == nil {
		return nil
	}
	c := *inst
	c.Addresses = append([]netip.Addr(nil), inst.Addresses...)
	return &c
}
