package backoff

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"testing"
	"time"
)

func half() float64 { return 0.5 }

// almostOne is the largest value a [0, 1) source returns.
func almostOne() float64 { return math.Nextafter(1, 0) }

func TestDelay(t *testing.T) {
	p := Policy{Initial: 100 * time.Millisecond, Max: time.Second}
	tests := []struct {
		name    string
		p       Policy
		attempt int
		rnd     func() float64
		want    time.Duration
	}{
		{"first try at once", p, 0, half, 0},
		{"negative attempt", p, -5, half, 0},
		{"attempt 1", p, 1, half, 50 * time.Millisecond},
		{"attempt 2", p, 2, half, 100 * time.Millisecond},
		{"attempt 3", p, 3, half, 200 * time.Millisecond},
		{"attempt 4", p, 4, half, 400 * time.Millisecond},
		{"attempt 5 capped", p, 5, half, 500 * time.Millisecond},
		{"attempt 6 capped", p, 6, half, 500 * time.Millisecond},
		{"zero draw", p, 4, func() float64 { return 0 }, 0},
		{"defaults attempt 1", Policy{}, 1, half, 125 * time.Millisecond},
		{"defaults capped", Policy{}, 10, half, 2500 * time.Millisecond},
		{"negative fields take defaults", Policy{Initial: -1, Max: -1}, 1, half, 125 * time.Millisecond},
		{"only initial set", Policy{Initial: time.Second}, 10, half, 2500 * time.Millisecond},
		{"initial above max", Policy{Initial: 10 * time.Second, Max: time.Second}, 1, half, 500 * time.Millisecond},
		{"huge attempt", p, math.MaxInt, half, 500 * time.Millisecond},
		{"attempt 63", p, 63, half, 500 * time.Millisecond},
		{"attempt 64", p, 64, half, 500 * time.Millisecond},
		{"huge max no overflow", Policy{Initial: time.Second, Max: math.MaxInt64}, 200, func() float64 { return 1 }, math.MaxInt64},
		{"draw of 1 clamps to ceiling", p, 2, func() float64 { return 1 }, 200 * time.Millisecond},
		{"draw above 1 clamps to ceiling", p, 2, func() float64 { return 7 }, 200 * time.Millisecond},
		{"negative draw clamps to 0", p, 2, func() float64 { return -1 }, 0},
		{"NaN draw is 0", p, 2, math.NaN, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.p.Delay(tt.attempt, tt.rnd); got != tt.want {
				t.Fatalf("Delay(%d) = %v, want %v", tt.attempt, got, tt.want)
			}
		})
	}
}

func TestDelayStaysWithinCeiling(t *testing.T) {
	p := Policy{Initial: 3 * time.Millisecond, Max: 7 * time.Second}
	for attempt := 1; attempt < 200; attempt++ {
		ceiling := min(p.Max, p.Initial*time.Duration(math.Pow(2, float64(min(attempt-1, 40)))))
		if got := p.Delay(attempt, almostOne); got < 0 || got > ceiling || ceiling-got > time.Microsecond {
			t.Fatalf("Delay(%d) with draw ~1 = %v, want just under %v", attempt, got, ceiling)
		}
	}
}

func TestDelayNilRandIsBounded(t *testing.T) {
	p := Policy{Initial: time.Millisecond, Max: 4 * time.Millisecond}
	for attempt := 1; attempt < 50; attempt++ {
		if got := p.Delay(attempt, nil); got < 0 || got > p.Max {
			t.Fatalf("Delay(%d, nil) = %v, want within [0, %v]", attempt, got, p.Max)
		}
	}
}

type recorder struct {
	delays []time.Duration
	onCall func(n int)
}

func (r *recorder) sleep(ctx context.Context, d time.Duration) error {
	r.delays = append(r.delays, d)
	if r.onCall != nil {
		r.onCall(len(r.delays))
	}
	return ctx.Err()
}

func TestRetrySucceedsFirstTryWithoutSleeping(t *testing.T) {
	var rec recorder
	calls := 0
	err := Retry(context.Background(), Policy{}, rec.sleep, half, func(context.Context) error {
		calls++
		return nil
	}, func(int, error, time.Duration) { t.Fatal("notify called without a failure") })
	if err != nil {
		t.Fatalf("Retry: %v", err)
	}
	if calls != 1 || len(rec.delays) != 0 {
		t.Fatalf("calls = %d, sleeps = %v; want 1 call, no sleep", calls, rec.delays)
	}
}

func TestRetryGrowsAndCaps(t *testing.T) {
	var rec recorder
	p := Policy{Initial: 100 * time.Millisecond, Max: time.Second}
	errFlaky := errors.New("flaky")
	type note struct {
		attempt int
		err     error
		next    time.Duration
	}
	var notes []note
	calls := 0
	err := Retry(context.Background(), p, rec.sleep, half, func(context.Context) error {
		calls++
		if calls < 7 {
			return errFlaky
		}
		return nil
	}, func(attempt int, err error, next time.Duration) {
		notes = append(notes, note{attempt, err, next})
	})
	if err != nil {
		t.Fatalf("Retry: %v", err)
	}
	want := []time.Duration{50, 100, 200, 400, 500, 500}
	for i := range want {
		want[i] *= time.Millisecond
	}
	if calls != 7 {
		t.Fatalf("op called %d times, want 7", calls)
	}
	if len(rec.delays) != len(want) {
		t.Fatalf("sleeps = %v, want %v", rec.delays, want)
	}
	for i := range want {
		if rec.delays[i] != want[i] {
			t.Fatalf("sleep %d = %v, want %v (all: %v)", i, rec.delays[i], want[i], rec.delays)
		}
		if n := notes[i]; n.attempt != i+1 || n.next != want[i] || !errors.Is(n.err, errFlaky) {
			t.Fatalf("notify %d = %+v, want attempt %d, next %v, err %v", i, n, i+1, want[i], errFlaky)
		}
	}
	if len(notes) != len(want) {
		t.Fatalf("notify called %d times, want %d", len(notes), len(want))
	}
}

func TestRetryPermanentStops(t *testing.T) {
	var rec recorder
	errDenied := errors.New("denied by policy")
	calls := 0
	err := Retry(context.Background(), Policy{}, rec.sleep, half, func(context.Context) error {
		calls++
		if calls == 3 {
			return Permanent(errDenied)
		}
		return errors.New("transient")
	}, nil)
	if !errors.Is(err, errDenied) {
		t.Fatalf("Retry error = %v, want %v", err, errDenied)
	}
	if !IsPermanent(err) {
		t.Fatal("returned error lost its permanent mark")
	}
	if err.Error() != errDenied.Error() {
		t.Fatalf("error text = %q, want %q", err, errDenied)
	}
	if calls != 3 || len(rec.delays) != 2 {
		t.Fatalf("calls = %d, sleeps = %d; want 3 calls, 2 sleeps", calls, len(rec.delays))
	}
}

func TestRetryCancelDuringSleep(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errDown := errors.New("service down")
	rec := recorder{onCall: func(n int) {
		if n == 2 {
			cancel()
		}
	}}
	calls := 0
	err := Retry(ctx, Policy{}, rec.sleep, half, func(context.Context) error {
		calls++
		return errDown
	}, nil)
	if !errors.Is(err, context.Canceled) || !errors.Is(err, errDown) {
		t.Fatalf("Retry error = %v, want both %v and %v", err, context.Canceled, errDown)
	}
	if calls != 2 {
		t.Fatalf("op called %d times after cancel, want 2", calls)
	}
}

// A sleeper that ignores cancellation must not make Retry call op with a dead context.
func TestRetryChecksContextAfterSleep(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errDown := errors.New("service down")
	calls := 0
	err := Retry(ctx, Policy{}, func(context.Context, time.Duration) error { return nil }, half,
		func(context.Context) error {
			calls++
			cancel()
			return errDown
		}, nil)
	if !errors.Is(err, context.Canceled) || !errors.Is(err, errDown) {
		t.Fatalf("Retry error = %v, want both %v and %v", err, context.Canceled, errDown)
	}
	if calls != 1 {
		t.Fatalf("op called %d times, want 1", calls)
	}
}

func TestRetryContextDoneBeforeStart(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err := Retry(ctx, Policy{}, nil, half, func(context.Context) error {
		t.Fatal("op called with a cancelled context")
		return nil
	}, nil)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Retry error = %v, want %v", err, context.Canceled)
	}
}

// With the real Sleep and hour-long delays, Retry can only return if cancellation interrupts the
// sleep; a regression makes this test hang until the test binary's timeout.
func TestRetryRealSleepCancelReturnsAtOnce(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errDown := errors.New("service down")
	err := Retry(ctx, Policy{Initial: time.Hour, Max: time.Hour}, nil, almostOne,
		func(context.Context) error { return errDown },
		func(attempt int, err error, next time.Duration) {
			if next < 59*time.Minute {
				t.Errorf("next delay %v, want about an hour", next)
			}
			cancel()
		})
	if !errors.Is(err, context.Canceled) || !errors.Is(err, errDown) {
		t.Fatalf("Retry error = %v, want both %v and %v", err, context.Canceled, errDown)
	}
}

func TestRetryDeadlineExceeded(t *testing.T) {
	ctx, cancel := context.WithDeadline(context.Background(), time.Unix(0, 0))
	defer cancel()
	err := Retry(ctx, Policy{}, nil, half, func(context.Context) error { return nil }, nil)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Retry error = %v, want %v", err, context.DeadlineExceeded)
	}
}

func TestSleep(t *testing.T) {
	if err := Sleep(context.Background(), time.Nanosecond); err != nil {
		t.Fatalf("Sleep(1ns) = %v", err)
	}
	if err := Sleep(context.Background(), 0); err != nil {
		t.Fatalf("Sleep(0) = %v", err)
	}
	if err := Sleep(context.Background(), -time.Second); err != nil {
		t.Fatalf("Sleep(-1s) = %v", err)
	}

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := Sleep(ctx, time.Hour); !errors.Is(err, context.Canceled) {
		t.Fatalf("Sleep on cancelled context = %v, want %v", err, context.Canceled)
	}
	if err := Sleep(ctx, 0); !errors.Is(err, context.Canceled) {
		t.Fatalf("Sleep(0) on cancelled context = %v, want %v", err, context.Canceled)
	}

	ctx2, cancel2 := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- Sleep(ctx2, time.Hour) }()
	cancel2()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("Sleep cancelled while waiting = %v, want %v", err, context.Canceled)
	}
}

func TestPermanent(t *testing.T) {
	if Permanent(nil) != nil {
		t.Fatal("Permanent(nil) != nil")
	}
	base := errors.New("bad request")
	p := Permanent(base)
	if !IsPermanent(p) || !errors.Is(p, base) || p.Error() != "bad request" {
		t.Fatalf("Permanent(%v) = %v: IsPermanent %v, Is %v", base, p, IsPermanent(p), errors.Is(p, base))
	}
	wrapped := errors.Join(errors.New("context"), p)
	if !IsPermanent(wrapped) {
		t.Fatal("IsPermanent does not see through wrapping")
	}
	if IsPermanent(base) || IsPermanent(nil) {
		t.Fatal("IsPermanent true for an unmarked error")
	}
}

func TestSoon(t *testing.T) {
	p := Policy{Initial: 200 * time.Millisecond, Max: time.Minute}
	for _, tt := range []struct {
		name string
		p    Policy
		rnd  func() float64
		want time.Duration
	}{
		{"zero draw is half of initial", p, func() float64 { return 0 }, 100 * time.Millisecond},
		{"half draw", p, half, 150 * time.Millisecond},
		{"draw of 1 is initial", p, func() float64 { return 1 }, 200 * time.Millisecond},
		{"draw above 1 clamps", p, func() float64 { return 9 }, 200 * time.Millisecond},
		{"NaN draw is half of initial", p, math.NaN, 100 * time.Millisecond},
		{"defaults", Policy{}, half, 187500 * time.Microsecond},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.p.Soon(tt.rnd); got != tt.want {
				t.Fatalf("Soon = %v, want %v", got, tt.want)
			}
		})
	}
	for range 100 {
		if got := p.Soon(nil); got < 100*time.Millisecond || got > 200*time.Millisecond {
			t.Fatalf("Soon(nil) = %v, want within [100ms, 200ms]", got)
		}
	}
}

// Tries that nothing answered are repeated soon and leave the backoff where the answered failures put it.
func TestRetryUnansweredDoesNotBackOff(t *testing.T) {
	var rec recorder
	p := Policy{Initial: 100 * time.Millisecond, Max: time.Second}
	errRefused := errors.New("connection refused")
	errBusy := errors.New("unavailable")
	outcomes := []error{Unanswered(errRefused), Unanswered(errRefused), Unanswered(errRefused), errBusy, errBusy,
		Unanswered(errRefused), errBusy, nil}
	var attempts []int
	calls := 0
	err := Retry(context.Background(), p, rec.sleep, half, func(context.Context) error {
		calls++
		return outcomes[calls-1]
	}, func(attempt int, err error, next time.Duration) {
		attempts = append(attempts, attempt)
		if IsUnanswered(err) != errors.Is(err, errRefused) {
			t.Errorf("try %d: notify got %v, unanswered %v", attempt, err, IsUnanswered(err))
		}
	})
	if err != nil {
		t.Fatalf("Retry: %v", err)
	}
	soon := 75 * time.Millisecond
	want := []time.Duration{soon, soon, soon, 50 * time.Millisecond, 100 * time.Millisecond, soon, 200 * time.Millisecond}
	if !slices.Equal(rec.delays, want) {
		t.Fatalf("sleeps = %v, want %v", rec.delays, want)
	}
	if !slices.Equal(attempts, []int{1, 2, 3, 4, 5, 6, 7}) {
		t.Fatalf("notify attempts = %v, want every try counted", attempts)
	}
}

func TestUnanswered(t *testing.T) {
	if Unanswered(nil) != nil {
		t.Fatal("Unanswered(nil) != nil")
	}
	base := errors.New("connection refused")
	u := Unanswered(base)
	if !IsUnanswered(u) || !errors.Is(u, base) || u.Error() != base.Error() || IsPermanent(u) {
		t.Fatalf("Unanswered(%v) = %v: IsUnanswered %v, Is %v, IsPermanent %v", base, u, IsUnanswered(u), errors.Is(u, base), IsPermanent(u))
	}
	if !IsUnanswered(fmt.Errorf("endpoint a: %w", u)) || IsUnanswered(base) {
		t.Fatal("IsUnanswered does not follow wrapping, or marks an unmarked error")
	}
}

// TestRetryAfter: a try whose error carries After(d) waits from d to 1.5d, however short the backoff is,
// and still counts towards its growth; a longer backoff wins.
func TestRetryAfter(t *testing.T) {
	var rec recorder
	p := Policy{Initial: 100 * time.Millisecond, Max: 20 * time.Second}
	errHeld := errors.New("held back")
	outcomes := []error{After(errHeld, 2*time.Second), After(errHeld, 2*time.Second), errors.New("busy"),
		After(errHeld, 10*time.Millisecond), nil}
	calls := 0
	err := Retry(context.Background(), p, rec.sleep, half, func(context.Context) error {
		calls++
		return outcomes[calls-1]
	}, func(attempt int, err error, next time.Duration) {
		if _, ok := afterOf(err); ok != errors.Is(err, errHeld) {
			t.Errorf("try %d: notify got %v", attempt, err)
		}
	})
	if err != nil {
		t.Fatalf("Retry: %v", err)
	}
	// half draws the middle: 2s+0.5s twice; then the backoff of the third and fourth answered tries, 200ms and
	// 400ms, the fourth above its own 10ms hint.
	want := []time.Duration{2500 * time.Millisecond, 2500 * time.Millisecond, 200 * time.Millisecond, 400 * time.Millisecond}
	if !slices.Equal(rec.delays, want) {
		t.Fatalf("sleeps = %v, want %v", rec.delays, want)
	}
	if After(nil, time.Second) != nil {
		t.Error("After(nil) != nil")
	}
	if a := After(errHeld, time.Second); !errors.Is(a, errHeld) || a.Error() != errHeld.Error() || IsPermanent(a) || IsUnanswered(a) {
		t.Errorf("After(%v) = %v", errHeld, a)
	}
}
