// Package clocktest is a clock that a test moves by hand, for code that takes its time from a func() time.Time.
package clocktest

import (
	"sync"
	"time"
)

// Clock is safe for concurrent use: the code under test reads it while the test advances it.
type Clock struct {
	mu  sync.Mutex
	now time.Time
}

// New returns a clock standing at start.
func New(start time.Time) *Clock { return &Clock{now: start} }

// Now is the clock's time.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// Advance moves the clock forward by d.
func (c *Clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}
