package ec2instances

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/google/go-cmp/cmp"
	"golang.org/x/time/rate"

	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/cloud/aws/ec2instances/ec2test"
	"github.com/berthlabs/berth/internal/instancecache"
	"github.com/berthlabs/berth/internal/metadata"
)

const (
	testVPC   = "vpc-0a1b2c3d4e5f67890"
	otherVPC  = "vpc-0fedcba9876543210"
	cpGroup   = "berth-control-plane"
	workGroup = "berth-workers"
)

// Lookup is what the join service needs of a cloud: its instance lookup (behind instancecache) and the
// EK source of attest's EC2 trust.
var (
	_ instancecache.Lookup  = (*Lookup)(nil)
	_ attest.EKPublicSource = (*Lookup)(nil)
)

var testRoles = map[string]metadata.Role{cpGroup: metadata.RoleControlPlane, workGroup: metadata.RoleWorker}

// newClient is the official SDK client, pointed at srv, with static credentials and the package's retryer
// (backoff shortened so that throttling tests take milliseconds).
func newClient(srv *ec2test.Server) *ec2.Client {
	return ec2.NewFromConfig(aws.Config{
		Region:      srv.Region,
		Credentials: credentials.NewStaticCredentialsProvider("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", ""),
		Retryer:     newRetryer(time.Millisecond, 10*time.Millisecond),
	}, GuardBodies, func(o *ec2.Options) { o.BaseEndpoint = aws.String(srv.URL) })
}

func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type tWriter struct{ t *testing.T }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

func newLookup(t *testing.T, srv *ec2test.Server, mod func(*Config)) *Lookup {
	t.Helper()
	cfg := Config{API: newClient(srv), VPCID: testVPC, Roles: testRoles, Logger: testLogger(t)}
	if mod != nil {
		mod(&cfg)
	}
	l, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func instanceID(n int) string { return fmt.Sprintf("i-%017x", n) }

func addrs(s ...string) []netip.Addr {
	out := make([]netip.Addr, len(s))
	for i, a := range s {
		out[i] = netip.MustParseAddr(a)
	}
	return out
}

func node(n int, group string, nics ...[]netip.Addr) ec2test.Instance {
	tags := map[string]string{"Name": fmt.Sprintf("node-%d", n)}
	if group != "" {
		tags[GroupTag] = group
	}
	return ec2test.Instance{
		ID:             instanceID(n),
		ImageID:        "ami-0123456789abcdef0",
		VPCID:          testVPC,
		SubnetID:       "subnet-0123456789abcdef0",
		PrivateDNSName: fmt.Sprintf("ip-%d.eu-central-1.compute.internal", n),
		Interfaces:     nics,
		Tags:           tags,
	}
}

func TestLookupAdmitsInterfacesPrimaryAddressesOnly(t *testing.T) {
	srv := ec2test.New(t)
	cp := node(1, cpGroup, addrs("10.0.1.10", "10.0.1.11"))
	worker := node(2, workGroup, addrs("10.0.2.10", "10.0.2.11"), addrs("10.0.3.10", "10.0.3.11"))
	srv.Put(cp, worker)
	l := newLookup(t, srv, nil)

	wantCP := &metadata.Instance{
		Name: cp.PrivateDNSName, Role: metadata.RoleControlPlane, Addresses: addrs("10.0.1.10", "10.0.1.11"),
		ImageID: cp.ImageID, ID: cp.ID,
	}
	wantWorker := &metadata.Instance{
		Name: worker.PrivateDNSName, Role: metadata.RoleWorker,
		Addresses: addrs("10.0.2.10", "10.0.2.11", "10.0.3.10", "10.0.3.11"), ImageID: worker.ImageID, ID: worker.ID,
	}
	for _, tc := range []struct {
		addr string
		want *metadata.Instance
	}{
		{"10.0.1.10", wantCP},     // primary
		{"10.0.1.11", nil},        // secondary on the primary interface: a pod's
		{"10.0.2.10", wantWorker}, // primary
		{"10.0.2.11", nil},        // secondary
		{"10.0.3.10", wantWorker}, // primary address of the second interface
		{"10.0.3.11", nil},        // secondary address of the second interface
	} {
		got, err := l.InstanceByAddress(t.Context(), netip.MustParseAddr(tc.addr))
		if tc.want == nil {
			if !errors.Is(err, metadata.ErrNotFound) || !strings.Contains(err.Error(), "secondary address of instance") {
				t.Errorf("%s: %v, %v; want not found, as a secondary address", tc.addr, got, err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("%s: %v", tc.addr, err)
		}
		if diff := cmp.Diff(tc.want, got, cmp.Comparer(func(a, b netip.Addr) bool { return a == b })); diff != "" {
			t.Errorf("%s: record (-want +got):\n%s", tc.addr, diff)
		}
	}

	// The requests carry the filters: every address of a batch as values of one filter, running, the VPC.
	reqs := srv.Requests(ec2test.DescribeInstances)
	if len(reqs) == 0 {
		t.Fatal("no DescribeInstances request arrived")
	}
	r := reqs[0]
	names := map[string]string{}
	for i := 1; r.Get(fmt.Sprintf("Filter.%d.Name", i)) != ""; i++ {
		names[r.Get(fmt.Sprintf("Filter.%d.Name", i))] = r.Get(fmt.Sprintf("Filter.%d.Value.1", i))
	}
	want := map[string]string{filterAddress: "10.0.1.10", filterState: "running", filterVPC: testVPC}
	if diff := cmp.Diff(want, names); diff != "" {
		t.Errorf("filters of the first request (-want +got):\n%s", diff)
	}
	if r.Get("MaxResults") != "1000" {
		t.Errorf("MaxResults = %q, want 1000", r.Get("MaxResults"))
	}
}

func TestRefusals(t *testing.T) {
	srv := ec2test.New(t)
	stopped := node(10, workGroup, addrs("10.0.9.1"))
	stopped.State = "stopped"
	elsewhere := node(11, workGroup, addrs("10.0.9.2"))
	elsewhere.VPCID = otherVPC
	noGroup := node(12, "", addrs("10.0.9.3"))
	noGroup.Tags["role"] = "control-plane"
	noGroup.Tags["berth.io/role"] = "control-plane"
	unmapped := node(13, "someone-elses-group", addrs("10.0.9.4"))
	// A worker whose user-set tags claim the control plane: only the autoscaling group counts.
	claims := node(14, workGroup, addrs("10.0.9.5"))
	claims.Tags["role"] = "control-plane"
	claims.Tags["berth.io/role"] = "control-plane"
	claims.Tags["autoscaling:groupName"] = cpGroup
	claims.Tags["aws-autoscaling-groupName"] = cpGroup
	noName := node(15, workGroup, addrs("10.0.9.6"))
	noName.PrivateDNSName = ""
	srv.Put(stopped, elsewhere, noGroup, unmapped, claims, noName)
	l := newLookup(t, srv, nil)

	got, err := l.InstanceByAddress(t.Context(), netip.MustParseAddr("10.0.9.5"))
	if err != nil {
		t.Fatalf("worker with role-like user tags: %v", err)
	}
	if got.Role != metadata.RoleWorker {
		t.Errorf("worker with role-like user tags got role %q, want %q: a user tag was trusted", got.Role, metadata.RoleWorker)
	}

	for _, tc := range []struct {
		name, addr string
		want       []string
	}{
		{"stopped", "10.0.9.1", []string{"no running instance in " + testVPC, "10.0.9.1"}},
		{"other VPC", "10.0.9.2", []string{"no running instance in " + testVPC}},
		{"no autoscaling group", "10.0.9.3", []string{noGroup.ID, "no autoscaling group", GroupTag, cpGroup, workGroup}},
		{"unmapped group", "10.0.9.4", []string{unmapped.ID, `"someone-elses-group"`, "no role", cpGroup, workGroup}},
		{"no private DNS name", "10.0.9.6", []string{noName.ID, "name is empty"}},
		{"unknown address", "10.0.9.99", []string{"no running instance", "10.0.9.99"}},
		{"IPv6", "fd00::1", []string{"not an IPv4 address"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			inst, err := l.InstanceByAddress(t.Context(), netip.MustParseAddr(tc.addr))
			if err == nil {
				t.Fatalf("found %+v, want a refusal", inst)
			}
			if !errors.Is(err, metadata.ErrNotFound) {
				t.Errorf("error does not wrap metadata.ErrNotFound: %v", err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %q", err, w)
				}
			}
		})
	}
}

// TestBatching asks about 1,000 addresses at once. Batches are sent when full (BatchSize) or when their
// window ends; with a window far longer than the test, only the cap sends them, so the number of calls
// is exactly ceil(1000/BatchSize), whatever the scheduling.
func TestBatching(t *testing.T) {
	const n = 1000
	srv := ec2test.New(t)
	for i := range n {
		srv.Put(node(1000+i, workGroup, []netip.Addr{addrOf(i)}))
	}

	lookupAll := func(t *testing.T, l *Lookup) {
		t.Helper()
		var (
			wg   sync.WaitGroup
			mu   sync.Mutex
			errs []error
		)
		start := make(chan struct{})
		for i := range n {
			wg.Go(func() {
				<-start
				inst, err := l.InstanceByAddress(t.Context(), addrOf(i))
				if err == nil && inst.ID != instanceID(1000+i) {
					err = fmt.Errorf("%s: got instance %s, want %s", addrOf(i), inst.ID, instanceID(1000+i))
				}
				if err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
				}
			})
		}
		close(start)
		wg.Wait()
		if len(errs) > 0 {
			t.Fatalf("%d of %d lookups failed, first: %v", len(errs), n, errs[0])
		}
	}

	t.Run("cap", func(t *testing.T) {
		before := srv.Calls(ec2test.DescribeInstances)
		l := newLookup(t, srv, func(c *Config) { c.BatchWindow = time.Hour })
		lookupAll(t, l)
		calls := srv.Calls(ec2test.DescribeInstances) - before
		bound := (n + MaxBatchSize - 1) / MaxBatchSize
		t.Logf("%d concurrent lookups of different addresses: %d DescribeInstances calls (batch size %d)", n, calls, MaxBatchSize)
		if calls > bound {
			t.Errorf("%d DescribeInstances calls, want at most %d", calls, bound)
		}
		for i, r := range srv.Requests(ec2test.DescribeInstances)[before:] {
			if v := r.Get(fmt.Sprintf("Filter.1.Value.%d", MaxBatchSize+1)); v != "" {
				t.Errorf("request %d has more than %d values in a filter", i, MaxBatchSize)
			}
		}
	})

	t.Run("defaults", func(t *testing.T) {
		before := srv.Calls(ec2test.DescribeInstances)
		l := newLookup(t, srv, nil)
		lookupAll(t, l)
		// With the 50 ms window the count depends on how fast 1,000 goroutines start: logged, not asserted.
		t.Logf("%d concurrent lookups with the default %v window: %d DescribeInstances calls",
			n, DefaultBatchWindow, srv.Calls(ec2test.DescribeInstances)-before)
	})
}

func addrOf(i int) netip.Addr {
	return netip.AddrFrom4([4]byte{10, 1, byte(i / 250), byte(1 + i%250)})
}

// TestPagination makes EC2 answer 5 instances a page: one batch of 23 addresses takes 5 pages.
func TestPagination(t *testing.T) {
	const n = 23
	srv := ec2test.New(t)
	for i := range n {
		srv.Put(node(2000+i, cpGroup, []netip.Addr{addrOf(i)}))
	}
	l := newLookup(t, srv, func(c *Config) {
		c.BatchWindow = time.Hour
		c.BatchSize = n
		c.PageSize = 5
	})
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			_, errs[i] = l.InstanceByAddress(t.Context(), addrOf(i))
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	reqs := srv.Requests(ec2test.DescribeInstances)
	if len(reqs) != (n+4)/5 {
		t.Fatalf("%d DescribeInstances pages, want %d", len(reqs), (n+4)/5)
	}
	for i, r := range reqs {
		if (i == 0) != (r.Get("NextToken") == "") {
			t.Errorf("page %d: NextToken %q", i, r.Get("NextToken"))
		}
	}
}

// TestWindow sends a batch that never fills when its window ends.
func TestWindow(t *testing.T) {
	srv := ec2test.New(t)
	srv.Put(node(1, workGroup, addrs("10.0.2.10")), node(2, workGroup, addrs("10.0.2.20")))
	l := newLookup(t, srv, func(c *Config) { c.BatchWindow = 5 * time.Millisecond })
	var wg sync.WaitGroup
	for _, a := range []string{"10.0.2.10", "10.0.2.20", "10.0.2.10"} {
		wg.Go(func() {
			if _, err := l.InstanceByAddress(t.Context(), netip.MustParseAddr(a)); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if calls := srv.Calls(ec2test.DescribeInstances); calls < 1 || calls > 3 {
		t.Errorf("%d DescribeInstances calls for 3 lookups", calls)
	}
}

// TestCancelledWaiterLeavesBatch: a caller that gives up while its batch is at EC2 gets its context's error;
// the others of the batch get their answers from the same call.
func TestCancelledWaiterLeavesBatch(t *testing.T) {
	srv := ec2test.New(t)
	srv.Put(node(1, workGroup, addrs("10.0.2.10")), node(2, workGroup, addrs("10.0.2.20")))
	l := newLookup(t, srv, func(c *Config) {
		c.BatchWindow = time.Hour
		c.BatchSize = 2
	})
	arrived := srv.Hold()

	ctx, cancel := context.WithCancel(t.Context())
	gone := make(chan error, 1)
	go func() {
		_, err := l.InstanceByAddress(ctx, netip.MustParseAddr("10.0.2.10"))
		gone <- err
	}()
	stays := make(chan error, 1)
	go func() {
		inst, err := l.InstanceByAddress(t.Context(), netip.MustParseAddr("10.0.2.20"))
		if err == nil && inst.ID != instanceID(2) {
			err = fmt.Errorf("got %s", inst.ID)
		}
		stays <- err
	}()
	<-arrived // the batch of both is at EC2
	cancel()
	if err := <-gone; !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled lookup: %v, want context.Canceled", err)
	}
	srv.Release()
	if err := <-stays; err != nil {
		t.Errorf("the other lookup of the batch: %v", err)
	}
	if calls := srv.Calls(ec2test.DescribeInstances); calls != 1 {
		t.Errorf("%d DescribeInstances calls, want 1", calls)
	}
}

func TestThrottling(t *testing.T) {
	srv := ec2test.New(t)
	srv.Put(node(1, workGroup, addrs("10.0.2.10")), node(2, cpGroup, addrs("10.0.1.10")))

	t.Run("next calls", func(t *testing.T) {
		l := newLookup(t, srv, nil)
		before := srv.Calls(ec2test.DescribeInstances)
		srv.ThrottleNext(4)
		inst, err := l.InstanceByAddress(t.Context(), netip.MustParseAddr("10.0.2.10"))
		if err != nil {
			t.Fatalf("lookup after 4 throttled calls: %v", err)
		}
		if inst.ID != instanceID(1) {
			t.Errorf("got %s", inst.ID)
		}
		if calls := srv.Calls(ec2test.DescribeInstances) - before; calls != 5 {
			t.Errorf("%d DescribeInstances calls, want 4 throttled and 1 answered", calls)
		}
	})

	t.Run("fraction", func(t *testing.T) {
		l := newLookup(t, srv, func(c *Config) {
			c.BatchWindow = time.Millisecond
			c.DescribeRate = rate.Inf // 20 calls in a row: pacing would only slow the test
		})
		// A lookup fails only if all 8 attempts of its call are throttled: 0.2^8 ≈ 2.6e-6 a lookup.
		srv.ThrottleFraction(0.2)
		defer srv.ThrottleFraction(0)
		before := srv.Throttled()
		for range 10 {
			for _, a := range []string{"10.0.2.10", "10.0.1.10"} {
				if _, err := l.InstanceByAddress(t.Context(), netip.MustParseAddr(a)); err != nil {
					t.Fatalf("lookup with 20%% of calls throttled: %v", err)
				}
			}
		}
		t.Logf("%d calls throttled, every lookup answered", srv.Throttled()-before)
	})

	t.Run("never ends", func(t *testing.T) {
		l := newLookup(t, srv, nil)
		srv.ThrottleNext(1000)
		defer srv.ThrottleNext(0)
		_, err := l.InstanceByAddress(t.Context(), netip.MustParseAddr("10.0.2.10"))
		var ae *APIError
		if !errors.As(err, &ae) || ae.Code != "RequestLimitExceeded" {
			t.Fatalf("error %v, want an APIError RequestLimitExceeded", err)
		}
		if errors.Is(err, metadata.ErrNotFound) {
			t.Error("throttling reads as 'not found', which the join service's cache would keep")
		}
		if !strings.Contains(err.Error(), "throttled") {
			t.Errorf("error %q does not say it was throttled", err)
		}
	})
}

func TestDescribeUnauthorized(t *testing.T) {
	srv := ec2test.New(t)
	srv.Put(node(1, workGroup, addrs("10.0.2.10")))
	srv.Deny(ec2test.DescribeInstances)
	l := newLookup(t, srv, nil)
	_, err := l.InstanceByAddress(t.Context(), netip.MustParseAddr("10.0.2.10"))
	if err == nil || errors.Is(err, metadata.ErrNotFound) {
		t.Fatalf("error %v, want a failure that is not 'not found'", err)
	}
	if !strings.Contains(err.Error(), "ec2:DescribeInstances") {
		t.Errorf("error %q does not name the IAM action", err)
	}
	if len(err.Error()) > 1000 {
		t.Errorf("error is %d bytes long: EC2's encoded authorization message was not cut", len(err.Error()))
	}
	if calls := srv.Calls(ec2test.DescribeInstances); calls != 1 {
		t.Errorf("%d calls: an authorization failure was retried", calls)
	}
}

func TestNewChecksConfig(t *testing.T) {
	srv := ec2test.New(t)
	api := newClient(srv)
	for _, tc := range []struct {
		name string
		cfg  Config
		want string
	}{
		{"no API", Config{VPCID: testVPC, Roles: testRoles}, "API is required"},
		{"no VPC", Config{API: api, Roles: testRoles}, "VPC id"},
		{"bad VPC", Config{API: api, VPCID: "vpc-12", Roles: testRoles}, "VPC id"},
		{"no roles", Config{API: api, VPCID: testVPC}, "no autoscaling group"},
		{"bad role", Config{API: api, VPCID: testVPC, Roles: map[string]metadata.Role{"g": "admin"}}, `role "admin"`},
		{"empty group", Config{API: api, VPCID: testVPC, Roles: map[string]metadata.Role{"": metadata.RoleWorker}}, "group name"},
		{"batch too big", Config{API: api, VPCID: testVPC, Roles: testRoles, BatchSize: 201}, "batch size"},
		{"page too small", Config{API: api, VPCID: testVPC, Roles: testRoles, PageSize: 4}, "page size"},
		{"negative window", Config{API: api, VPCID: testVPC, Roles: testRoles, BatchWindow: -1}, "negative"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(tc.cfg)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("New: %v, want an error saying %q", err, tc.want)
			}
		})
	}

	// Changing the caller's map afterwards changes nothing.
	roles := map[string]metadata.Role{workGroup: metadata.RoleWorker}
	srv.Put(node(1, workGroup, addrs("10.0.2.10")))
	l, err := New(Config{API: api, VPCID: testVPC, Roles: roles})
	if err != nil {
		t.Fatal(err)
	}
	roles[workGroup] = metadata.RoleControlPlane
	inst, err := l.InstanceByAddress(t.Context(), netip.MustParseAddr("10.0.2.10"))
	if err != nil || inst.Role != metadata.RoleWorker {
		t.Errorf("after changing the caller's map: %+v, %v", inst, err)
	}
}

func TestNewAPI(t *testing.T) {
	srv := ec2test.New(t)
	srv.Put(node(1, cpGroup, addrs("10.0.1.10")))
	// The default credential chain, from the environment here (the instance profile on EC2).
	none := t.TempDir() + "/none"
	t.Setenv("AWS_ACCESS_KEY_ID", "AKIAIOSFODNN7EXAMPLE")
	t.Setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
	t.Setenv("AWS_SESSION_TOKEN", "")
	t.Setenv("AWS_PROFILE", "")
	t.Setenv("AWS_CONFIG_FILE", none)
	t.Setenv("AWS_SHARED_CREDENTIALS_FILE", none)
	t.Setenv("AWS_EC2_METADATA_DISABLED", "true")
	t.Setenv("AWS_ENDPOINT_URL", "")
	t.Setenv("AWS_ENDPOINT_URL_EC2", "")

	api, err := NewAPI(t.Context(), srv.Region, srv.URL, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := api.Options().HTTPClient.(guardedClient); !ok {
		t.Errorf("HTTP client %T is not behind GuardBodies", api.Options().HTTPClient)
	}
	if got := api.Options().Retryer.MaxAttempts(); got != maxAttempts {
		t.Errorf("retryer allows %d attempts, want %d", got, maxAttempts)
	}
	l, err := New(Config{API: api, VPCID: testVPC, Roles: testRoles, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	srv.ThrottleNext(1)
	inst, err := l.InstanceByAddress(t.Context(), netip.MustParseAddr("10.0.1.10"))
	if err != nil {
		t.Fatalf("lookup through NewAPI's client: %v", err)
	}
	if inst.Role != metadata.RoleControlPlane {
		t.Errorf("role %q", inst.Role)
	}

	// Signed for another region: EC2 refuses it.
	other, err := NewAPI(t.Context(), "eu-west-1", srv.URL, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := other.DescribeInstances(t.Context(), &ec2.DescribeInstancesInput{}); err == nil || !strings.Contains(err.Error(), "AuthFailure") {
		t.Errorf("request signed for another region: %v, want AuthFailure", err)
	}

	for _, tc := range []struct{ region, endpoint, want string }{
		{"", "", "region is empty"},
		{"us-east-1", "http://ec2.example.com", "plain http"},
		{"us-east-1", "ftp://127.0.0.1", "not https"},
		{"us-east-1", "https://user:pw@ec2.example.com", "scheme://host"},
		{"us-east-1", "127.0.0.1:443", ""},
	} {
		_, err := NewAPI(t.Context(), tc.region, tc.endpoint, nil)
		if err == nil || tc.want != "" && !strings.Contains(err.Error(), tc.want) {
			t.Errorf("NewAPI(%q, %q): %v, want an error saying %q", tc.region, tc.endpoint, err, tc.want)
		}
	}
}

func TestPrivateAddressesOrder(t *testing.T) {
	// EC2 lists interfaces and addresses in no promised order.
	srv := ec2test.New(t)
	w := node(1, workGroup, addrs("10.0.2.10", "10.0.2.11", "10.0.2.12"), addrs("10.0.3.10"))
	srv.Put(w)
	l := newLookup(t, srv, nil)
	out, err := l.cfg.API.DescribeInstances(t.Context(), &ec2.DescribeInstancesInput{})
	if err != nil {
		t.Fatal(err)
	}
	inst := out.Reservations[0].Instances[0]
	slices.Reverse(inst.NetworkInterfaces)
	for i := range inst.NetworkInterfaces {
		slices.Reverse(inst.NetworkInterfaces[i].PrivateIpAddresses)
	}
	got := privateAddresses(inst)
	// The instance's primary address, then by interface, each one's primary address first; secondary
	// addresses stay in EC2's order.
	want := addrs("10.0.2.10", "10.0.2.12", "10.0.2.11", "10.0.3.10")
	if !slices.Equal(got, want) {
		t.Errorf("addresses %v, want %v", got, want)
	}
}

// TestPacing: a call whose turn under the join service's own pacing would come after CallTimeout fails at
// once, as a failure (not "not found"), and never reaches EC2.
func TestPacing(t *testing.T) {
	srv := ec2test.New(t)
	a, b := node(1, workGroup, addrs("10.0.2.10")), node(2, workGroup, addrs("10.0.2.20"))
	a.EK, b.EK = spki(t, ekRSA()), spki(t, ekRSA())
	srv.Put(a, b)
	l := newLookup(t, srv, func(c *Config) {
		c.DescribeRate = rate.Every(time.Hour)
		c.EKRate = rate.Every(time.Hour)
		c.Burst = 1
	})
	if _, err := l.InstanceByAddress(t.Context(), netip.MustParseAddr("10.0.2.10")); err != nil {
		t.Fatal(err)
	}
	_, err := l.InstanceByAddress(t.Context(), netip.MustParseAddr("10.0.2.20"))
	if err == nil || errors.Is(err, metadata.ErrNotFound) || !strings.Contains(err.Error(), "pacing") {
		t.Errorf("lookup beyond the pace: %v, want a pacing failure", err)
	}
	if calls := srv.Calls(ec2test.DescribeInstances); calls != 1 {
		t.Errorf("%d DescribeInstances calls, want 1", calls)
	}

	if _, err := l.EKPublic(t.Context(), a.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := l.EKPublic(t.Context(), b.ID); err == nil || !strings.Contains(err.Error(), "pacing") {
		t.Errorf("EK request beyond the pace: %v, want a pacing failure", err)
	}
	if calls := srv.Calls(ec2test.GetInstanceTpmEkPub); calls != 1 {
		t.Errorf("%d GetInstanceTpmEkPub calls, want 1", calls)
	}
}
