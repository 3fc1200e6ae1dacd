package joinclient

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/backoff"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
	"github.com/berthlabs/berth/nodeagent/internal/statedisk"
)

const testPin = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

// fakeMetadata serves a fixed Self and instance list; onInstances, when set, runs at every listing, which the
// join client does once per attempt.
type fakeMetadata struct {
	self         metadata.Self
	instances    []metadata.Instance
	instancesErr error
	onInstances  func()
}

func (m *fakeMetadata) Self(context.Context) (*metadata.Self, error) {
	s := m.self
	return &s, nil
}

func (m *fakeMetadata) ControlPlanes(context.Context) ([]metadata.Instance, error) {
	if m.onInstances != nil {
		m.onInstances()
	}
	return slices.Clone(m.instances), m.instancesErr
}

// fakeProver makes evidence no service would accept; the tests here never get as far as a service.
type fakeProver struct{}

func (fakeProver) Evidence([]byte, []int) (*berthv1.Evidence, error) {
	return &berthv1.Evidence{Quote: []byte("quote")}, nil
}

func (fakeProver) Activate(*berthv1.ActivationChallenge) ([]byte, error) {
	return []byte("secret"), nil
}

// fakeDisk and fakeLocker record whether the join got past the ticket, which none of these tests may.
type fakeDisk struct{ calls int }

func (d *fakeDisk) SetKey(context.Context, []byte, []byte) error { d.calls++; return nil }

type fakeLocker struct{ calls int }

func (l *fakeLocker) TryLock(string) bool { l.calls++; return true }

type fakeKubeadm struct{}

func (fakeKubeadm) Join(context.Context, string, func(string)) error { return errors.New("not here") }
func (fakeKubeadm) Reset(context.Context, func(string)) error        { return errors.New("not here") }

func addrs(s ...string) []netip.Addr {
	a := make([]netip.Addr, len(s))
	for i, x := range s {
		a[i] = netip.MustParseAddr(x)
	}
	return a
}

func selfWith(endpoints ...string) metadata.Self {
	return metadata.Self{
		Instance: metadata.Instance{Name: "cp-0", Role: metadata.RoleControlPlane, Addresses: addrs("10.0.0.10")},
		UserData: metadata.UserData{ClusterName: "lab", JoinEndpoints: endpoints, JoinPort: 9000, JoinCAPin: testPin},
	}
}

func TestEndpoints(t *testing.T) {
	instances := []metadata.Instance{
		{Name: "cp-0", Role: metadata.RoleControlPlane, Addresses: addrs("10.0.0.10")},
		{Name: "cp-1", Role: metadata.RoleControlPlane, Addresses: addrs("10.0.0.11", "fd00::11")},
		{Name: "w-0", Role: metadata.RoleWorker, Addresses: addrs("10.0.0.20")},
		{Name: "cp-2", Role: metadata.RoleControlPlane, Addresses: addrs("fd00::12")},
		{Name: "cp-3", Role: metadata.RoleControlPlane},
	}
	tests := []struct {
		name         string
		lbs          []string
		instances    []metadata.Instance
		instancesErr error
		rand         float64
		want         []string
		wantErr      string
		wantLog      string
	}{
		{name: "load balancer first, then other control planes", lbs: []string{"lb.example.com:443"}, instances: instances,
			want: []string{"lb.example.com:443", "10.0.0.11:9000", "[fd00::12]:9000"}},
		{name: "no load balancer", instances: instances, want: []string{"10.0.0.11:9000", "[fd00::12]:9000"}},
		{name: "start spread by rand", lbs: []string{"lb.example.com:443"}, instances: instances, rand: 0.5,
			want: []string{"10.0.0.11:9000", "[fd00::12]:9000", "lb.example.com:443"}},
		{name: "rand just below 1", lbs: []string{"lb.example.com:443"}, instances: instances, rand: 0.9999,
			want: []string{"[fd00::12]:9000", "lb.example.com:443", "10.0.0.11:9000"}},
		{name: "instances fail: a warning", lbs: []string{"lb.example.com:443"}, instancesErr: errors.New("metadata down"),
			want: []string{"lb.example.com:443"}, wantLog: "metadata down"},
		{name: "instances fail and no load balancer", instancesErr: errors.New("metadata down"),
			wantErr: "no join endpoint", wantLog: "metadata down"},
		{name: "only self and workers", instances: instances[:1:1], wantErr: "no join endpoint"},
		{name: "nothing at all", wantErr: "user-data names no load balancer and metadata lists no other control-plane instance"},
		{name: "load balancer is a control plane", lbs: []string{"10.0.0.11:9000"}, instances: instances,
			want: []string{"10.0.0.11:9000", "[fd00::12]:9000"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var logs bytes.Buffer
			log := slog.New(slog.NewTextHandler(&logs, nil))
			self := selfWith(tt.lbs...)
			c := New(Config{
				Metadata: &fakeMetadata{self: self, instances: tt.instances, instancesErr: tt.instancesErr},
				Rand:     func() float64 { return tt.rand },
				Logger:   log,
			})
			got, err := c.endpoints(context.Background(), log, &self)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("endpoints = %v, %v; want an error containing %q", got, err, tt.wantErr)
				}
			} else if err != nil {
				t.Fatal(err)
			} else if !slices.Equal(got, tt.want) {
				t.Errorf("endpoints = %q, want %q", got, tt.want)
			}
			if tt.wantLog != "" && !strings.Contains(logs.String(), tt.wantLog) {
				t.Errorf("log %q does not mention %q", logs.String(), tt.wantLog)
			}
			if !slices.Equal(self.UserData.JoinEndpoints, tt.lbs) {
				t.Errorf("user-data endpoints changed to %q", self.UserData.JoinEndpoints)
			}
		})
	}
}

// TestEndpointsRemovesDuplicatesApart: user-data may name a control-plane node's own join address next to a
// load balancer; that node must still be tried once per attempt, not once per mention.
func TestEndpointsRemovesDuplicatesApart(t *testing.T) {
	self := selfWith("10.0.0.11:9000", "lb.example.com:443")
	log := slog.New(slog.DiscardHandler)
	c := New(Config{
		Metadata: &fakeMetadata{self: self, instances: []metadata.Instance{
			{Name: "cp-1", Role: metadata.RoleControlPlane, Addresses: addrs("10.0.0.11")},
			{Name: "cp-2", Role: metadata.RoleControlPlane, Addresses: addrs("10.0.0.12")},
		}},
		Rand:   func() float64 { return 0 },
		Logger: log,
	})
	got, err := c.endpoints(context.Background(), log, &self)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"10.0.0.11:9000", "lb.example.com:443", "10.0.0.12:9000"}; !slices.Equal(got, want) {
		t.Errorf("endpoints = %q, want %q", got, want)
	}
}

// freeAddr is a loopback address where nothing listens.
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

// closingEndpoint accepts connections and closes them at once, like a service that cannot serve.
func closingEndpoint(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	return l.Addr().String()
}

// hungEndpoint accepts connections and never answers, like a service stuck before its TLS handshake. It
// reports each accepted connection on the returned channel.
func hungEndpoint(t *testing.T) (string, <-chan struct{}) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	accepted := make(chan struct{}, 16)
	var mu sync.Mutex
	var conns []net.Conn
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			select {
			case accepted <- struct{}{}:
			default:
			}
		}
	}()
	t.Cleanup(func() {
		l.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	return l.Addr().String(), accepted
}

func newJoiner(t *testing.T, meta *fakeMetadata, sleep backoff.Sleeper, rnd func() float64) (*Client, *fakeDisk, *fakeLocker) {
	t.Helper()
	dir := t.TempDir()
	disk, lock := &fakeDisk{}, &fakeLocker{}
	return New(Config{
		Metadata: meta,
		Prover:   fakeProver{},
		Disk:     disk,
		Lock:     lock,
		Kubeadm:  fakeKubeadm{},
		Paths:    nodestate.Paths{State: dir + "/state", KubernetesDir: dir + "/etc", KubeletDir: dir + "/kubelet"},
		Backoff:  backoff.Policy{Initial: 100 * time.Millisecond, Max: time.Second},
		// Only Stop may end an attempt in these tests.
		RequestTimeout: time.Hour,
		Sleep:          sleep,
		Rand:           rnd,
	}), disk, lock
}

var testDisk = statedisk.Prepared{UUID: "0b2c5c36-7f1e-4a5e-9d8b-1f0e6a2b3c4d", Fresh: true, InitialKey: []byte("initial")}

// liveness bounds how long a stopped Join may take to return. It is far above what returning takes; it only
// keeps a broken Stop from hanging the test run.
const liveness = 5 * time.Second

func TestStopEndsJoinWaitingToRetry(t *testing.T) {
	sleeping := make(chan struct{}, 1)
	sleep := func(ctx context.Context, _ time.Duration) error {
		select {
		case sleeping <- struct{}{}:
		default:
		}
		<-ctx.Done()
		return ctx.Err()
	}
	c, disk, lock := newJoiner(t, &fakeMetadata{self: selfWith(freeAddr(t))}, sleep, nil)

	done := make(chan error, 1)
	go func() {
		_, err := c.Join(context.Background(), testDisk)
		done <- err
	}()
	select {
	case <-sleeping:
	case err := <-done:
		t.Fatalf("Join returned before it retried: %v", err)
	}
	c.Stop()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Errorf("Join after Stop: %v, want context.Canceled", err)
		}
		if !strings.Contains(err.Error(), "connection refused") {
			t.Errorf("Join after Stop: %v, want the last attempt's error too", err)
		}
	case <-time.After(liveness):
		t.Fatal("Join did not return after Stop")
	}
	if disk.calls+lock.calls != 0 {
		t.Errorf("a stopped join keyed the disk (%d) or took the lock (%d)", disk.calls, lock.calls)
	}
}

func TestStopEndsJoinInFlight(t *testing.T) {
	addr, accepted := hungEndpoint(t)
	sleep := func(ctx context.Context, _ time.Duration) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		return errors.New("an attempt failed before Stop")
	}
	c, _, _ := newJoiner(t, &fakeMetadata{self: selfWith(addr)}, sleep, nil)

	done := make(chan error, 1)
	go func() {
		_, err := c.Join(context.Background(), testDisk)
		done <- err
	}()
	select {
	case <-accepted:
	case err := <-done:
		t.Fatalf("Join returned before it reached the endpoint: %v", err)
	}
	c.Stop()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) || strings.Contains(err.Error(), "an attempt failed before Stop") {
			t.Errorf("Join after Stop: %v, want it to end on the stop", err)
		}
	case <-time.After(liveness):
		t.Fatal("Join did not return after Stop while an attempt was in flight")
	}
}

func TestStopEndsRejoin(t *testing.T) {
	sleeping := make(chan struct{}, 1)
	sleep := func(ctx context.Context, _ time.Duration) error {
		select {
		case sleeping <- struct{}{}:
		default:
		}
		<-ctx.Done()
		return ctx.Err()
	}
	c, _, _ := newJoiner(t, &fakeMetadata{self: selfWith(freeAddr(t))}, sleep, nil)
	done := make(chan error, 1)
	go func() {
		_, err := c.Rejoin(context.Background(), testDisk.UUID)
		done <- err
	}()
	<-sleeping
	c.Stop()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Errorf("Rejoin after Stop: %v, want context.Canceled", err)
		}
	case <-time.After(liveness):
		t.Fatal("Rejoin did not return after Stop")
	}
}

func TestStopWithoutJoin(t *testing.T) {
	New(Config{}).Stop()
}

// An endpoint that answers and fails (here: closes the connection before TLS) makes the node back off.
func TestJoinBackoff(t *testing.T) {
	const sleeps = 8
	var mu sync.Mutex
	var events []string
	var delays []time.Duration
	record := func(e string) {
		mu.Lock()
		defer mu.Unlock()
		events = append(events, e)
	}
	sleep := func(ctx context.Context, d time.Duration) error {
		record("sleep")
		mu.Lock()
		defer mu.Unlock()
		delays = append(delays, d)
		if len(delays) == sleeps {
			return context.Canceled
		}
		return nil
	}
	meta := &fakeMetadata{self: selfWith(closingEndpoint(t)), onInstances: func() { record("attempt") }}
	// A jitter draw just below 1 makes each delay its ceiling.
	c, _, _ := newJoiner(t, meta, sleep, func() float64 { return 0.999999 })

	_, err := c.Join(context.Background(), testDisk)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Join: %v, want the sleeper's context.Canceled", err)
	}
	want := make([]string, 0, 2*sleeps)
	for range sleeps {
		want = append(want, "attempt", "sleep")
	}
	if !slices.Equal(events, want) {
		t.Errorf("events %v, want attempts and sleeps alternating from an immediate first attempt", events)
	}
	max := time.Second
	for i, d := range delays {
		if d <= 0 || d > max {
			t.Errorf("delay %d is %v, want in (0, %v]", i, d, max)
		}
		if i > 0 && d < delays[i-1] {
			t.Errorf("delay %d (%v) is shorter than the one before (%v)", i, d, delays[i-1])
		}
	}
	if delays[1] <= delays[0] || delays[3] <= delays[2] {
		t.Errorf("delays %v do not grow", delays)
	}
	if last := delays[len(delays)-1]; last < max*99/100 {
		t.Errorf("delays %v never reach the cap %v", delays, max)
	}
	if !slices.Equal(delays[len(delays)-3:], []time.Duration{delays[len(delays)-1], delays[len(delays)-1], delays[len(delays)-1]}) {
		t.Errorf("delays %v do not stay at the cap", delays)
	}
}

// recordSleeps is a sleeper that records each delay and, at the n-th, ends the join as a cancellation would.
func recordSleeps(delays *[]time.Duration, n int) backoff.Sleeper {
	return func(_ context.Context, d time.Duration) error {
		*delays = append(*delays, d)
		if len(*delays) == n {
			return context.Canceled
		}
		return nil
	}
}

// Where nothing listens, a node tries again soon instead of backing off, and says so once, not at every try.
func TestJoinRefusedTriesSoon(t *testing.T) {
	const sleeps = 12
	var delays []time.Duration
	sleep := recordSleeps(&delays, sleeps)
	c, _, _ := newJoiner(t, &fakeMetadata{self: selfWith(freeAddr(t), freeAddr(t))}, sleep, func() float64 { return 0.999999 })
	var logs bytes.Buffer
	c.cfg.Logger = slog.New(slog.NewJSONHandler(&logs, nil))

	_, err := c.Join(context.Background(), testDisk)
	if !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), "connection refused") {
		t.Fatalf("Join: %v, want the sleeper's context.Canceled and the refusal", err)
	}
	for i, d := range delays {
		if d < 50*time.Millisecond || d > 100*time.Millisecond {
			t.Errorf("delay %d is %v, want within [50ms, 100ms] (Initial/2 to Initial) at every try: delays %v", i, d, delays)
		}
	}
	if n := strings.Count(logs.String(), "no join service listens yet"); n != 1 {
		t.Errorf("logged %d lines about no listening service in %d tries, want 1:\n%s", n, sleeps, logs.String())
	}
	if strings.Contains(logs.String(), `"msg":"requesting join ticket"`) {
		t.Errorf("every refused try logged a warning:\n%s", logs.String())
	}
}

// One endpoint that answers is enough to back off: the refused one may be a control-plane node that is down,
// while the service that answered is up and busy.
func TestJoinBacksOffWhenAnyEndpointAnswers(t *testing.T) {
	const sleeps = 6
	var delays []time.Duration
	sleep := recordSleeps(&delays, sleeps)
	c, _, _ := newJoiner(t, &fakeMetadata{self: selfWith(freeAddr(t), closingEndpoint(t))}, sleep, func() float64 { return 0.999999 })
	if _, err := c.Join(context.Background(), testDisk); !errors.Is(err, context.Canceled) {
		t.Fatalf("Join: %v, want the sleeper's context.Canceled", err)
	}
	want := []time.Duration{100, 200, 400, 800, 1000, 1000}
	for i := range want {
		if d := want[i] * time.Millisecond; delays[i] < d*99/100 || delays[i] > d {
			t.Fatalf("delays %v, want about %v ms: the backoff's ceilings", delays, want)
		}
	}
}

// TestRetryDelay reads the wait a join service asks for from its answers, as the client wraps them: the
// longest, capped at maxRetryDelay; answers without one, and malformed ones, ask for nothing.
func TestRetryDelay(t *testing.T) {
	withRetry := func(d *durationpb.Duration) error {
		st, err := status.New(codes.Unavailable, "held back").WithDetails(&errdetails.RetryInfo{RetryDelay: d})
		if err != nil {
			t.Fatal(err)
		}
		return fmt.Errorf("10.0.0.1:7452: %w", st.Err())
	}
	plain := fmt.Errorf("10.0.0.2:7452: %w", status.Error(codes.Unavailable, "join service failed; retry later"))
	for _, tt := range []struct {
		name string
		errs []error
		want time.Duration
		ok   bool
	}{
		{"none", []error{plain, errors.New("connection reset")}, 0, false},
		{"one", []error{plain, withRetry(durationpb.New(30 * time.Second))}, 30 * time.Second, true},
		{"the longest", []error{withRetry(durationpb.New(time.Second)), withRetry(durationpb.New(20 * time.Second))}, 20 * time.Second, true},
		{"capped", []error{withRetry(durationpb.New(24 * time.Hour))}, maxRetryDelay, true},
		{"malformed", []error{withRetry(&durationpb.Duration{Seconds: 1, Nanos: -1})}, 0, false},
	} {
		if got, ok := retryDelay(tt.errs); got != tt.want || ok != tt.ok {
			t.Errorf("%s: retryDelay = %v, %v; want %v, %v", tt.name, got, ok, tt.want, tt.ok)
		}
	}
}
