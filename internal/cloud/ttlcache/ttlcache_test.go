package ttlcache

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/berthlabs/berth/test/clocktest"
)

func TestGetKeepsAnswersForTheirTime(t *testing.T) {
	clock := clocktest.New(time.Date(2026, 11, 27, 0, 0, 0, 0, time.UTC))
	c := New[string](clock.Now, time.Minute, 10)
	var calls atomic.Int32
	fetch := func(context.Context) (string, error) { return fmt.Sprint("answer ", calls.Add(1)), nil }
	get := func() string {
		t.Helper()
		v, stopped, err := c.Get(t.Context(), "i-1", time.Second, fetch)
		if err != nil || stopped {
			t.Fatalf("Get: %q, %v, %v", v, stopped, err)
		}
		return v
	}
	if v := get(); v != "answer 1" {
		t.Fatalf("first Get = %q", v)
	}
	clock.Advance(59 * time.Second)
	if v := get(); v != "answer 1" {
		t.Fatalf("Get within the TTL = %q, want the kept answer", v)
	}
	clock.Advance(time.Second)
	if v := get(); v != "answer 2" {
		t.Fatalf("Get at the TTL = %q, want a new call", v)
	}
}

func TestGetKeepsNoError(t *testing.T) {
	c := New[int](time.Now, time.Hour, 10)
	calls := 0
	fetch := func(context.Context) (int, error) {
		calls++
		return 0, errors.New("throttled")
	}
	for range 2 {
		if _, _, err := c.Get(t.Context(), "k", time.Second, fetch); err == nil || err.Error() != "throttled" {
			t.Fatalf("Get = %v, want the fetch's error as it is", err)
		}
	}
	if calls != 2 {
		t.Errorf("%d calls, want 2: an error must not be kept", calls)
	}
}

func TestGetBounded(t *testing.T) {
	c := New[int](time.Now, time.Hour, 3)
	for i := range 5 {
		if _, _, err := c.Get(t.Context(), fmt.Sprint(i), time.Second, func(context.Context) (int, error) { return i, nil }); err != nil {
			t.Fatal(err)
		}
	}
	if n := c.Len(); n > 3 {
		t.Errorf("the cache holds %d values, bound is 3", n)
	}
}

// TestGetSharesOneCall: concurrent callers of one key share one fetch, and a caller who gives up gets its
// context's cause while the others get the answer.
func TestGetSharesOneCall(t *testing.T) {
	c := New[string](time.Now, time.Hour, 10)
	release := make(chan struct{})
	started := make(chan struct{})
	var calls atomic.Int32
	fetch := func(ctx context.Context) (string, error) {
		if calls.Add(1) == 1 {
			close(started)
		}
		select {
		case <-release:
			return "ek", nil
		case <-ctx.Done():
			return "", ctx.Err()
		}
	}
	ctx, cancel := context.WithCancelCause(t.Context())
	gaveUp := make(chan error, 1)
	go func() {
		_, stopped, err := c.Get(ctx, "i-1", time.Minute, fetch)
		if !stopped {
			err = fmt.Errorf("stopped = false, err %v", err)
		}
		gaveUp <- err
	}()
	<-started
	var wg sync.WaitGroup
	results := make([]string, 3)
	for i := range results {
		wg.Go(func() {
			v, _, err := c.Get(t.Context(), "i-1", time.Minute, fetch)
			if err != nil {
				v = err.Error()
			}
			results[i] = v
		})
	}
	cause := errors.New("the node hung up")
	cancel(cause)
	if err := <-gaveUp; !errors.Is(err, cause) {
		t.Errorf("the caller who gave up got %v, want its context's cause", err)
	}
	close(release)
	wg.Wait()
	for i, v := range results {
		if v != "ek" {
			t.Errorf("caller %d got %q", i, v)
		}
	}
	if n := calls.Load(); n != 1 {
		t.Errorf("%d fetches for one key, want 1", n)
	}
}
