// Package ttlcache keeps what a cloud API says about an instance that does not change while the instance
// lives (an EC2 instance's EK, a Compute Engine instance's vTPM identity): a bounded number of answers for a
// fixed time, and one call per key however many callers wait for it.
package ttlcache

import (
	"context"
	"sync"
	"time"

	"golang.org/x/sync/singleflight"
)

// Cache holds up to Size values for TTL each. It is safe for concurrent use.
type Cache[V any] struct {
	clock func() time.Time
	ttl   time.Duration
	size  int

	flight  singleflight.Group
	mu      sync.Mutex
	entries map[string]entry[V]
}

type entry[V any] struct {
	value   V
	expires time.Time
}

// New returns a cache of at most size values, each kept for ttl by clock.
func New[V any](clock func() time.Time, ttl time.Duration, size int) *Cache[V] {
	return &Cache[V]{clock: clock, ttl: ttl, size: size, entries: map[string]entry[V]{}}
}

// Get returns key's value: from memory while it lives, else from fetch, which concurrent callers of one key
// share. fetch runs apart from the caller's context (one caller giving up must not fail the others) but
// within timeout; its error is returned as it is, and nothing is kept of it. A caller whose ctx ends first
// gets context.Cause(ctx) and stopped reports true.
func (c *Cache[V]) Get(ctx context.Context, key string, timeout time.Duration, fetch func(context.Context) (V, error)) (v V, stopped bool, err error) {
	if v, ok := c.cached(key); ok {
		return v, false, nil
	}
	ch := c.flight.DoChan(key, func() (any, error) {
		// A call for this key may have ended, storing its value, between the look into the cache above and
		// this flight's start: that value serves without a second call.
		if v, ok := c.cached(key); ok {
			return v, nil
		}
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), timeout)
		defer cancel()
		v, err := fetch(cctx)
		if err != nil {
			return nil, err
		}
		c.store(key, v)
		return v, nil
	})
	select {
	case r := <-ch:
		if r.Err != nil {
			return v, false, r.Err
		}
		return r.Val.(V), false, nil
	case <-ctx.Done():
		return v, true, context.Cause(ctx)
	}
}

// Len is how many values the cache holds, live or not yet dropped.
func (c *Cache[V]) Len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.entries)
}

func (c *Cache[V]) cached(key string) (V, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.entries[key]
	if !ok {
		var zero V
		return zero, false
	}
	if !c.clock().Before(e.expires) {
		delete(c.entries, key)
		var zero V
		return zero, false
	}
	return e.value, true
}

func (c *Cache[V]) store(key string, v V) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.clock()
	if len(c.entries) >= c.size {
		for other, e := range c.entries {
			if !now.Before(e.expires) {
				delete(c.entries, other)
			}
		}
	}
	// Still full of live values: drop any one. Losing it costs a call, keeping all would cost unbounded
	// memory.
	for other := range c.entries {
		if len(c.entries) < c.size {
			break
		}
		delete(c.entries, other)
	}
	c.entries[key] = entry[V]{value: v, expires: now.Add(c.ttl)}
}
