// Package backoff retries an operation with capped exponential backoff and full jitter.
//
// Nodes retry the join service, the metadata server and the cloud API while they boot; full
// jitter (a delay drawn uniformly from [0, ceiling]) keeps a fleet started by one autoscaling
// event from hammering the service in lockstep. Backing off is for a server that answered and
// could not serve: a try that nothing answered (a refused connection: no process listens yet)
// cost the server nothing, so it is repeated soon, and does not grow the backoff. The sleeper and
// the random source are passed in so that the retry logic can be tested without waiting.
package backoff

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"
)

const (
	defaultInitial = 250 * time.Millisecond
	defaultMax     = 5 * time.Second
)

// Policy sets the delay ceiling of the first retry (Initial) and of all later ones (Max). A zero
// or negative field takes its default: Initial 250ms, Max 5s.
type Policy struct {
	Initial, Max time.Duration
}

func (p Policy) withDefaults() Policy {
	if p.Initial <= 0 {
		p.Initial = defaultInitial
	}
	if p.Max <= 0 {
		p.Max = defaultMax
	}
	return p
}

// ceiling returns min(Max, Initial*2^(attempt-1)) for attempt >= 1 without overflowing.
func (p Policy) ceiling(attempt int) time.Duration {
	shift := attempt - 1
	if shift >= 63 || p.Initial > p.Max>>shift {
		return p.Max
	}
	return min(p.Max, p.Initial<<shift)
}

// Delay returns how long to wait before the next try after attempt failed tries. Attempt 0 (the
// first try) waits nothing; attempt n >= 1 waits a uniform draw from [0, min(Max, Initial*2^(n-1))].
// rnd must return values in [0, 1), like math/rand/v2.Float64, which is used when rnd is nil.
func (p Policy) Delay(attempt int, rnd func() float64) time.Duration {
	if attempt <= 0 {
		return 0
	}
	if rnd == nil {
		rnd = rand.Float64
	}
	c := p.withDefaults().ceiling(attempt)
	r := rnd()
	if !(r > 0) { // also catches NaN from a broken source
		return 0
	}
	f := r * float64(c)
	if f >= float64(c) {
		return c
	}
	return time.Duration(f)
}

// Soon returns how long to wait after a try that nothing answered: a draw from [Initial/2,
// Initial], so that a fleet waiting for a server that is not up yet finds it within Initial of its
// start, without all of it trying in the same instant. rnd is as for Delay.
func (p Policy) Soon(rnd func() float64) time.Duration {
	initial := p.withDefaults().Initial
	return initial/2 + time.Duration(jitter(rnd)*float64(initial/2))
}

// Sleeper waits for d or until ctx ends, whichever comes first; it returns ctx.Err() when ctx
// ended first.
type Sleeper func(ctx context.Context, d time.Duration) error

// Sleep is the Sleeper that uses a real timer.
func Sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// Retry calls op until it returns nil or a Permanent error, or until ctx ends. After each failure
// it calls notify (when not nil) with the number of tries so far (from 1), the error and the delay
// before the next try. The first try runs at once. A try whose error is Unanswered is repeated
// after Soon, and only the other failures count towards the backoff's growth. A try whose error
// carries After(d) waits a draw from [d, 1.5d) when that is longer than the backoff's.
//
// When ctx ends, the returned error wraps both ctx's error and the last error from op, so
// errors.Is matches either. A Permanent error is returned as it is. A nil sleep means Sleep; a
// nil rnd means math/rand/v2.Float64.
func Retry(ctx context.Context, p Policy, sleep Sleeper, rnd func() float64, op func(ctx context.Context) error, notify func(attempt int, err error, next time.Duration)) error {
	if sleep == nil {
		sleep = Sleep
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	answered := 0
	for attempt := 1; ; attempt++ {
		err := op(ctx)
		if err == nil {
			return nil
		}
		if IsPermanent(err) {
			return err
		}
		var next time.Duration
		if IsUnanswered(err) {
			next = p.Soon(rnd)
		} else {
			answered++
			next = p.Delay(answered, rnd)
		}
		if d, ok := afterOf(err); ok {
			next = max(next, d+time.Duration(jitter(rnd)*float64(d/2)))
		}
		if notify != nil {
			notify(attempt, err, next)
		}
		if serr := sleep(ctx, next); serr != nil {
			return fmt.Errorf("giving up after %d tries: %w; last error: %w", attempt, serr, err)
		}
		if cerr := ctx.Err(); cerr != nil {
			return fmt.Errorf("giving up after %d tries: %w; last error: %w", attempt, cerr, err)
		}
	}
}

// jitter draws from [0, 1) with rnd, or math/rand/v2.Float64 when rnd is nil, clamping what a broken
// source returns.
func jitter(rnd func() float64) float64 {
	if rnd == nil {
		rnd = rand.Float64
	}
	r := rnd()
	if !(r > 0) {
		return 0
	}
	return min(r, 1)
}

type afterError struct {
	err error
	d   time.Duration
}

func (e *afterError) Error() string { return e.err.Error() }
func (e *afterError) Unwrap() error { return e.err }

// After marks err as an answer that asked to be tried again no sooner than d, such as a server's
// hint that what the caller waits for takes that long: Retry waits at least d, spread over half of
// it again so that a fleet told the same does not come back in one instant. After(nil, d) is nil.
func After(err error, d time.Duration) error {
	if err == nil {
		return nil
	}
	return &afterError{err: err, d: d}
}

// afterOf returns the delay of the After mark on err, or any error it wraps.
func afterOf(err error) (time.Duration, bool) {
	var a *afterError
	if errors.As(err, &a) {
		return a.d, true
	}
	return 0, false
}

type permanentError struct {
	err error
}

func (e *permanentError) Error() string { return e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// Permanent marks err as not worth retrying: Retry returns it at once. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err: err}
}

type unansweredError struct {
	err error
}

func (e *unansweredError) Error() string { return e.err.Error() }
func (e *unansweredError) Unwrap() error { return e.err }

// Unanswered marks err as a try that reached no server at all, such as a refused connection:
// Retry repeats it soon, without backing off. Unanswered(nil) is nil.
func Unanswered(err error) error {
	if err == nil {
		return nil
	}
	return &unansweredError{err: err}
}

// IsUnanswered reports whether err, or any error it wraps, was marked by Unanswered.
func IsUnanswered(err error) bool {
	var u *unansweredError
	return errors.As(err, &u)
}

// IsPermanent reports whether err, or any error it wraps, was marked by Permanent.
func IsPermanent(err error) bool {
	var p *permanentError
	return errors.As(err, &p)
}
