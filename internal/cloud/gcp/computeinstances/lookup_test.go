package computeinstances

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"golang.org/x/oauth2"
	"golang.org/x/time/rate"
	compute "google.golang.org/api/compute/v1"

	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/cloud/gcp/computeinstances/computetest"
	"github.com/berthlabs/berth/internal/instancecache"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/test/clocktest"
)

// Lookup is what the join service needs of a cloud: its instance lookup (behind instancecache) and the EK
// source of attest's cloud EK trust.
var (
	_ instancecache.Lookup  = (*Lookup)(nil)
	_ attest.EKPublicSource = (*Lookup)(nil)
	_ attest.EKPublicSource = (*Identities)(nil)
)

const (
	project   = computetest.DefaultProject
	network   = "berth-net"
	zoneB     = "europe-west1-b"
	zoneC     = "europe-west1-c"
	cpGroup   = "europe-west1/berth-control-plane" // regional
	workGroup = "europe-west1-b/berth-workers"     // zonal
	testToken = "ya29.c.test-access-token"
)

var testGroups = map[string]metadata.Role{cpGroup: metadata.RoleControlPlane, workGroup: metadata.RoleWorker}

// fastTransport is the client's transport with backoff shortened, so that throttling tests take
// milliseconds.
var fastTransport = transportConfig{
	requestTimeout: DefaultRequestTimeout,
	baseBackoff:    time.Millisecond,
	maxBackoff:     10 * time.Millisecond,
	maxBody:        MaxResponseBytes,
}

func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type tWriter struct{ t *testing.T }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// newServer is an endpoint that wants the test token, with the configured groups (empty).
func newServer(t *testing.T) *computetest.Server {
	t.Helper()
	srv := computetest.NewWithOptions(t, computetest.Options{Token: testToken})
	for key := range testGroups {
		if err := srv.PutGroup(computetest.Group{Key: key}); err != nil {
			t.Fatal(err)
		}
	}
	return srv
}

// newTestService is Google's client as NewService makes it, pointed at srv, with the shortened backoff.
func newTestService(t *testing.T, srv *computetest.Server) *compute.Service {
	t.Helper()
	svc, err := newService(t.Context(), srv.URL, oauth2.StaticTokenSource(&oauth2.Token{AccessToken: testToken}), testLogger(t), fastTransport)
	if err != nil {
		t.Fatal(err)
	}
	return svc
}

func newLookup(t *testing.T, srv *computetest.Server, mod func(*Config)) *Lookup {
	t.Helper()
	cfg := Config{Service: newTestService(t, srv), Project: project, Network: network, Groups: testGroups, Logger: testLogger(t)}
	if mod != nil {
		mod(&cfg)
	}
	l, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func put(t *testing.T, srv *computetest.Server, instances ...computetest.Instance) {
	t.Helper()
	if err := srv.Put(instances...); err != nil {
		t.Fatal(err)
	}
}

// node is a running instance with one interface on the network per address.
func node(name, zone, group string, ips ...string) computetest.Instance {
	inst := computetest.Instance{Name: name, Zone: zone, Group: group}
	for _, ip := range ips {
		inst.NICs = append(inst.NICs, computetest.NIC{Network: network, IP: netip.MustParseAddr(ip)})
	}
	return inst
}

func idOf(t *testing.T, srv *computetest.Server, zone, name string) string {
	t.Helper()
	inst, ok := srv.Get(zone, name)
	if !ok {
		t.Fatalf("no instance %s/%s", zone, name)
	}
	return InstanceID(project, zone, inst.ID)
}

func addrs(s ...string) []netip.Addr {
	out := make([]netip.Addr, len(s))
	for i, a := range s {
		out[i] = netip.MustParseAddr(a)
	}
	return out
}

var cmpAddr = cmp.Comparer(func(a, b netip.Addr) bool { return a == b })

func lookup(t *testing.T, l *Lookup, addr string) (*metadata.Instance, error) {
	t.Helper()
	return l.InstanceByAddress(t.Context(), netip.MustParseAddr(addr))
}

func TestLookupByAddress(t *testing.T) {
	srv := newServer(t)
	cp := node("berth-control-plane-x1z2", zoneC, cpGroup, "10.0.1.10")
	worker := node("berth-workers-k3m4", zoneB, workGroup, "10.0.2.10", "10.0.3.10")
	// A third interface on another network: its address is not the node's.
	worker.NICs = append(worker.NICs, computetest.NIC{Network: "other-net", IP: netip.MustParseAddr("192.168.7.10")})
	put(t, srv, cp, worker)
	l := newLookup(t, srv, nil)

	wantCP := &metadata.Instance{Name: cp.Name, Role: metadata.RoleControlPlane, Addresses: addrs("10.0.1.10"), ID: idOf(t, srv, zoneC, cp.Name)}
	wantWorker := &metadata.Instance{Name: worker.Name, Role: metadata.RoleWorker, Addresses: addrs("10.0.2.10", "10.0.3.10"), ID: idOf(t, srv, zoneB, worker.Name)}
	for _, tc := range []struct {
		addr string
		want *metadata.Instance
	}{
		{"10.0.1.10", wantCP},     // a regional group's instance
		{"10.0.2.10", wantWorker}, // nic0
		{"10.0.3.10", wantWorker}, // nic1, on the network too
	} {
		got, err := lookup(t, l, tc.addr)
		if err != nil {
			t.Fatalf("%s: %v", tc.addr, err)
		}
		if diff := cmp.Diff(tc.want, got, cmpAddr); diff != "" {
			t.Errorf("%s: record (-want +got):\n%s", tc.addr, diff)
		}
	}
	if !strings.HasPrefix(wantWorker.ID, "projects/"+project+"/zones/"+zoneB+"/instances/") {
		t.Errorf("instance id %q is not projects/<project>/zones/<zone>/instances/<id>", wantWorker.ID)
	}
	if _, err := lookup(t, l, "192.168.7.10"); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("address on another network: %v, want not found", err)
	}

	// One refresh answered everything: one page, one call per group.
	for method, want := range map[string]int{computetest.AggregatedList: 1, computetest.ListManagedInstances: 1, computetest.RegionListManagedInstances: 1} {
		if got := srv.Calls(method); got != want {
			t.Errorf("%d %s calls, want %d", got, method, want)
		}
	}
	r := srv.Requests(computetest.AggregatedList)[0]
	for k, want := range map[string]string{"filter": "status = RUNNING", "returnPartialSuccess": "true", "maxResults": "500", "fields": instanceFields} {
		if got := r.Get(k); got != want {
			t.Errorf("aggregatedList %s = %q, want %q", k, got, want)
		}
	}
	if got := srv.Requests(computetest.ListManagedInstances)[0].Get("fields"); got != managedFields {
		t.Errorf("listManagedInstances fields = %q, want %q", got, managedFields)
	}
}

func TestRefusals(t *testing.T) {
	srv := newServer(t)
	stopped := node("berth-workers-stop", zoneB, workGroup, "10.0.9.1")
	stopped.Status = "TERMINATED"
	elsewhere := node("berth-workers-else", zoneB, workGroup)
	elsewhere.NICs = []computetest.NIC{{Network: "other-net", IP: netip.MustParseAddr("10.0.9.2")}}
	// An instance in no group whose metadata claims the control plane's group: metadata is writable by
	// whoever may set it, and never gives a role.
	noGroup := node("rogue", zoneB, "", "10.0.9.3")
	noGroup.Metadata = map[string]string{"created-by": "projects/" + project + "/regions/europe-west1/instanceGroupManagers/berth-control-plane"}
	unmapped := node("someone-else-x", zoneB, "europe-west1-b/someone-else", "10.0.9.4")
	// A worker whose metadata claims the control plane: only the group's own list counts.
	claims := node("berth-workers-claim", zoneB, workGroup, "10.0.9.5")
	claims.Metadata = map[string]string{"created-by": "projects/" + project + "/regions/europe-west1/instanceGroupManagers/berth-control-plane"}
	sharedVPC := node("berth-workers-shared", zoneB, workGroup)
	sharedVPC.NICs = []computetest.NIC{{Network: "projects/host-project/global/networks/" + network, IP: netip.MustParseAddr("10.0.9.6")}}
	put(t, srv, stopped, elsewhere, noGroup, unmapped, claims, sharedVPC)
	l := newLookup(t, srv, nil)

	got, err := lookup(t, l, "10.0.9.5")
	if err != nil {
		t.Fatalf("worker whose metadata claims the control plane: %v", err)
	}
	if got.Role != metadata.RoleWorker {
		t.Errorf("worker whose metadata claims the control plane got role %q: metadata was trusted", got.Role)
	}

	for _, tc := range []struct {
		name, addr string
		want       []string
	}{
		{"stopped", "10.0.9.1", []string{"no running instance", "10.0.9.1", network}},
		{"other network", "10.0.9.2", []string{"no running instance"}},
		{"no group, created-by claimed", "10.0.9.3", []string{"rogue", "none of the managed instance groups", cpGroup, workGroup}},
		{"unconfigured group", "10.0.9.4", []string{"someone-else-x", "none of the managed instance groups"}},
		{"same network name in another project", "10.0.9.6", []string{"no running instance"}},
		{"unknown address", "10.0.9.99", []string{"no running instance", "10.0.9.99"}},
		{"IPv6", "fd00::1", []string{"not an IPv4 address"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			inst, err := lookup(t, l, tc.addr)
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
	if calls := srv.Calls(computetest.AggregatedList); calls != 1 {
		t.Errorf("%d aggregatedList calls: misses within the refresh interval refreshed again", calls)
	}
}

// TestSharedVPC: a network given as projects/<host>/global/networks/<name> matches that network only.
func TestSharedVPC(t *testing.T) {
	srv := newServer(t)
	host := "projects/host-project/global/networks/" + network
	shared := node("berth-workers-shared", zoneB, workGroup)
	shared.NICs = []computetest.NIC{{Network: host, IP: netip.MustParseAddr("10.0.9.6")}}
	local := node("berth-workers-local", zoneB, workGroup, "10.0.9.7")
	put(t, srv, shared, local)
	l := newLookup(t, srv, func(c *Config) { c.Network = host })
	if inst, err := lookup(t, l, "10.0.9.6"); err != nil || inst.Name != shared.Name {
		t.Errorf("instance on the Shared VPC network: %+v, %v", inst, err)
	}
	if _, err := lookup(t, l, "10.0.9.7"); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("instance on the project's own network of the same name: %v, want not found", err)
	}
}

func addrOf(i int) netip.Addr {
	return netip.AddrFrom4([4]byte{10, 1, byte(i / 250), byte(1 + i%250)})
}

// TestStorm asks about 1,000 known addresses at once: whatever the scheduling, the first miss starts the
// one refresh, the others wait for it or find its index. Then misses are answered from the index until the
// refresh interval has passed.
func TestStorm(t *testing.T) {
	const n = 1000
	srv := newServer(t)
	var all []computetest.Instance
	for i := range n {
		all = append(all, node(fmt.Sprintf("berth-workers-%04d", i), zoneB, workGroup, addrOf(i).String()))
	}
	all = append(all, node("berth-control-plane-0", zoneC, cpGroup, "10.0.1.10"))
	put(t, srv, all...)
	clock := clocktest.New(time.Date(2026, 11, 24, 12, 0, 0, 0, time.UTC))
	l := newLookup(t, srv, func(c *Config) { c.Clock = clock.Now })

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
			if err == nil && inst.Name != fmt.Sprintf("berth-workers-%04d", i) {
				err = fmt.Errorf("%s: got %s", addrOf(i), inst.Name)
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
	// 1,001 instances are three pages of 500; each group answers at once (pageless).
	wantCalls := map[string]int{computetest.AggregatedList: 3, computetest.ListManagedInstances: 1, computetest.RegionListManagedInstances: 1}
	checkCalls := func(when string) {
		t.Helper()
		for method, want := range wantCalls {
			if got := srv.Calls(method); got != want {
				t.Errorf("%s: %d %s calls, want %d", when, got, method, want)
			}
		}
	}
	checkCalls("after 1,000 concurrent lookups")

	// A node that appears now is not found until the interval has passed: its miss costs nothing.
	put(t, srv, node("berth-workers-late", zoneB, workGroup, "10.0.8.1"))
	if _, err := lookup(t, l, "10.0.8.1"); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("new instance within the refresh interval: %v, want not found", err)
	}
	checkCalls("after a miss within the interval")

	clock.Advance(DefaultMinRefreshInterval)
	inst, err := lookup(t, l, "10.0.8.1")
	if err != nil || inst.Name != "berth-workers-late" {
		t.Fatalf("new instance after the interval: %+v, %v", inst, err)
	}
	wantCalls[computetest.AggregatedList] += 3
	wantCalls[computetest.ListManagedInstances]++
	wantCalls[computetest.RegionListManagedInstances]++
	checkCalls("after the refresh the interval allowed")
}

// TestIndexAge: an index answers hits until it is MaxIndexAge old, and then nothing until refreshed: an
// instance deleted since is not found any more, and its address may be another's.
func TestIndexAge(t *testing.T) {
	srv := newServer(t)
	put(t, srv, node("berth-workers-a", zoneB, workGroup, "10.0.2.10"))
	clock := clocktest.New(time.Date(2026, 11, 24, 12, 0, 0, 0, time.UTC))
	l := newLookup(t, srv, func(c *Config) { c.Clock = clock.Now })
	if _, err := lookup(t, l, "10.0.2.10"); err != nil {
		t.Fatal(err)
	}
	if err := srv.Remove(zoneB, "berth-workers-a"); err != nil {
		t.Fatal(err)
	}
	clock.Advance(DefaultMaxIndexAge - time.Second)
	if _, err := lookup(t, l, "10.0.2.10"); err != nil {
		t.Errorf("hit in an index younger than MaxIndexAge: %v", err)
	}
	if calls := srv.Calls(computetest.AggregatedList); calls != 1 {
		t.Errorf("%d aggregatedList calls, want 1: a hit refreshed", calls)
	}
	clock.Advance(time.Second)
	if _, err := lookup(t, l, "10.0.2.10"); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("deleted instance after MaxIndexAge: %v, want not found", err)
	}
	if calls := srv.Calls(computetest.AggregatedList); calls != 2 {
		t.Errorf("%d aggregatedList calls, want 2", calls)
	}
}

// TestPagination lists 23 instances 5 a page, and a paginated group's 23 members 5 a page; a pageless
// group answers all at once whatever maxResults says.
func TestPagination(t *testing.T) {
	const n = 23
	srv := newServer(t)
	if err := srv.PutGroup(computetest.Group{Key: workGroup, Paginated: true}); err != nil {
		t.Fatal(err)
	}
	for i := range n {
		put(t, srv, node(fmt.Sprintf("berth-workers-%02d", i), zoneB, workGroup, addrOf(i).String()))
	}
	for i := range 7 {
		put(t, srv, node(fmt.Sprintf("berth-control-plane-%02d", i), zoneC, cpGroup, addrOf(100+i).String()))
	}
	l := newLookup(t, srv, func(c *Config) { c.PageSize = 5 })
	for _, a := range []netip.Addr{addrOf(0), addrOf(n - 1), addrOf(100), addrOf(106)} {
		if _, err := l.InstanceByAddress(t.Context(), a); err != nil {
			t.Fatalf("%s: %v", a, err)
		}
	}
	for method, want := range map[string]int{
		computetest.AggregatedList:             (n + 7 + 4) / 5,
		computetest.ListManagedInstances:       (n + 4) / 5,
		computetest.RegionListManagedInstances: 1,
	} {
		reqs := srv.Requests(method)
		if len(reqs) != want {
			t.Errorf("%d %s calls, want %d", len(reqs), method, want)
		}
		for i, r := range reqs {
			if (i == 0) != (r.Get("pageToken") == "") {
				t.Errorf("%s page %d: pageToken %q", method, i, r.Get("pageToken"))
			}
			if r.Get("maxResults") != "5" {
				t.Errorf("%s page %d: maxResults %q", method, i, r.Get("maxResults"))
			}
		}
	}
}

func TestThrottling(t *testing.T) {
	srv := newServer(t)
	put(t, srv, node("berth-workers-a", zoneB, workGroup, "10.0.2.10"), node("berth-control-plane-a", zoneC, cpGroup, "10.0.1.10"))
	totalCalls := func() int {
		return srv.Calls(computetest.AggregatedList) + srv.Calls(computetest.ListManagedInstances) + srv.Calls(computetest.RegionListManagedInstances)
	}

	for _, tc := range []struct {
		name  string
		fault computetest.Fault
	}{
		{"403 rateLimitExceeded", computetest.RateLimited},
		{"429", computetest.TooManyRequests},
		{"503", computetest.Unavailable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := newLookup(t, srv, nil)
			before, faults := totalCalls(), srv.Faults()
			srv.FailNext(4, tc.fault)
			inst, err := lookup(t, l, "10.0.2.10")
			if err != nil {
				t.Fatalf("lookup after 4 failed calls: %v", err)
			}
			if inst.Name != "berth-workers-a" {
				t.Errorf("got %s", inst.Name)
			}
			if got := srv.Faults() - faults; got != 4 {
				t.Errorf("%d faults answered, want 4", got)
			}
			// Three calls (the list and two groups), four of their attempts failed and were tried again.
			if got := totalCalls() - before; got != 3+4 {
				t.Errorf("%d requests, want 3 answered and 4 failed", got)
			}
		})
	}

	t.Run("fraction", func(t *testing.T) {
		clock := clocktest.New(time.Date(2026, 11, 24, 12, 0, 0, 0, time.UTC))
		l := newLookup(t, srv, func(c *Config) {
			c.Clock = clock.Now
			c.ListRate = rate.Inf // 60 calls in a row: pacing would only slow the test
		})
		// A refresh fails only if all 8 attempts of one of its calls are throttled: 3·0.2^8 ≈ 8e-6 a refresh.
		srv.ThrottleFraction(0.2)
		defer srv.ThrottleFraction(0)
		before := srv.Faults()
		for range 20 {
			for _, a := range []string{"10.0.2.10", "10.0.1.10"} {
				if _, err := lookup(t, l, a); err != nil {
					t.Fatalf("lookup with 20%% of calls throttled: %v", err)
				}
			}
			clock.Advance(DefaultMaxIndexAge) // the next lookup refreshes
		}
		if srv.Faults() == before {
			t.Error("no call was throttled")
		}
		t.Logf("%d calls throttled (403 and 429), every lookup answered", srv.Faults()-before)
	})

	t.Run("every third", func(t *testing.T) {
		clock := clocktest.New(time.Date(2026, 11, 24, 12, 0, 0, 0, time.UTC))
		l := newLookup(t, srv, func(c *Config) { c.Clock = clock.Now; c.ListRate = rate.Inf })
		srv.ThrottleEvery(3)
		defer srv.ThrottleEvery(0)
		for range 5 {
			if _, err := lookup(t, l, "10.0.2.10"); err != nil {
				t.Fatalf("lookup with every third call throttled: %v", err)
			}
			clock.Advance(DefaultMaxIndexAge)
		}
	})

	t.Run("never ends", func(t *testing.T) {
		l := newLookup(t, srv, nil)
		before := map[string]int{}
		for _, m := range []string{computetest.AggregatedList, computetest.ListManagedInstances, computetest.RegionListManagedInstances} {
			before[m] = srv.Calls(m)
		}
		srv.FailNext(1000, computetest.RateLimited)
		defer srv.FailNext(0, 0)
		_, err := lookup(t, l, "10.0.2.10")
		var ae *APIError
		if !errors.As(err, &ae) || ae.Code != 403 || ae.Reason != "rateLimitExceeded" {
			t.Fatalf("error %v, want an APIError 403 rateLimitExceeded", err)
		}
		if errors.Is(err, metadata.ErrNotFound) {
			t.Error("throttling reads as 'not found', which the join service's cache would keep")
		}
		if !strings.Contains(ae.Hint, "throttled") {
			t.Errorf("hint %q does not say it was throttled", ae.Hint)
		}
		// The call that failed first made every attempt; the others were stopped with it.
		method := map[string]string{
			methodAggregatedList:       computetest.AggregatedList,
			methodListManagedInstances: computetest.ListManagedInstances,
			methodRegionListManaged:    computetest.RegionListManagedInstances,
		}[ae.Method]
		if calls := srv.Calls(method) - before[method]; calls != maxAttempts {
			t.Errorf("%d calls of %s, want %d attempts", calls, ae.Method, maxAttempts)
		}
	})
}

func TestPermissionDenied(t *testing.T) {
	for _, tc := range []struct {
		method     string
		permission string
	}{
		{computetest.AggregatedList, "compute.instances.list"},
		{computetest.ListManagedInstances, "compute.instanceGroupManagers.get"},
		{computetest.RegionListManagedInstances, "compute.instanceGroupManagers.get"},
	} {
		t.Run(tc.method, func(t *testing.T) {
			srv := newServer(t)
			put(t, srv, node("berth-workers-a", zoneB, workGroup, "10.0.2.10"), node("berth-control-plane-a", zoneC, cpGroup, "10.0.1.10"))
			srv.Deny(tc.method)
			l := newLookup(t, srv, nil)
			_, err := lookup(t, l, "10.0.2.10")
			var ae *APIError
			if !errors.As(err, &ae) || errors.Is(err, metadata.ErrNotFound) {
				t.Fatalf("error %v, want an APIError that is not 'not found'", err)
			}
			if ae.Code != 403 || ae.Reason != "forbidden" {
				t.Errorf("code %d reason %q, want 403 forbidden", ae.Code, ae.Reason)
			}
			if want := "needs IAM permission " + tc.permission; !strings.Contains(ae.Hint, want) {
				t.Errorf("hint %q does not say %q", ae.Hint, want)
			}
			if !strings.Contains(err.Error(), ae.Hint) {
				t.Errorf("error %q leaves the hint out", err)
			}
			if calls := srv.Calls(tc.method); calls != 1 {
				t.Errorf("%d calls: a refusal was retried", calls)
			}
		})
	}
}

func TestBadToken(t *testing.T) {
	srv := newServer(t)
	put(t, srv, node("berth-workers-a", zoneB, workGroup, "10.0.2.10"))
	svc, err := newService(t.Context(), srv.URL, oauth2.StaticTokenSource(&oauth2.Token{AccessToken: "ya29.wrong"}), testLogger(t), fastTransport)
	if err != nil {
		t.Fatal(err)
	}
	l, err := New(Config{Service: svc, Project: project, Network: network, Groups: testGroups})
	if err != nil {
		t.Fatal(err)
	}
	_, err = lookup(t, l, "10.0.2.10")
	var ae *APIError
	if !errors.As(err, &ae) || ae.Code != 401 || !strings.Contains(ae.Hint, "credentials") {
		t.Errorf("lookup with a wrong token: %v, want a 401 APIError about credentials", err)
	}
}

// TestMissingGroup: a configured group that does not exist gives its instances no role, and the others
// join.
func TestMissingGroup(t *testing.T) {
	srv := newServer(t)
	put(t, srv, node("berth-workers-a", zoneB, workGroup, "10.0.2.10"), node("stray", zoneB, "", "10.0.2.11"))
	l := newLookup(t, srv, func(c *Config) {
		c.Groups = map[string]metadata.Role{workGroup: metadata.RoleWorker, "europe-west1/gone": metadata.RoleControlPlane}
	})
	if _, err := lookup(t, l, "10.0.2.10"); err != nil {
		t.Fatalf("instance of an existing group: %v", err)
	}
	_, err := lookup(t, l, "10.0.2.11")
	if !errors.Is(err, metadata.ErrNotFound) || !strings.Contains(err.Error(), "do not exist: europe-west1/gone") {
		t.Errorf("instance in no group: %v, want not found naming the missing group", err)
	}
}

// TestTwoRoles: an instance that groups of different roles both list gets none.
func TestTwoRoles(t *testing.T) {
	srv := newServer(t)
	l := newLookup(t, srv, nil)
	inst := instance{id: 42, name: "both", zone: zoneB, addrs: addrs("10.0.2.10")}
	// members lists inst in the groups named, by the order of l.groups.
	members := func(keys ...string) []map[uint64]bool {
		out := make([]map[uint64]bool, len(l.groups))
		for i, g := range l.groups {
			out[i] = map[uint64]bool{}
			for _, k := range keys {
				if g.key == k {
					out[i][inst.id] = true
				}
			}
		}
		return out
	}
	none := make([]bool, len(l.groups))
	_, err := l.record(inst, members(cpGroup, workGroup), none)
	if !errors.Is(err, metadata.ErrNotFound) || !strings.Contains(err.Error(), "different roles") {
		t.Errorf("instance in groups of two roles: %v", err)
	}
	rec, err := l.record(inst, members(workGroup), none)
	if err != nil || rec.Role != metadata.RoleWorker || rec.ID != InstanceID(project, zoneB, 42) {
		t.Errorf("instance in the worker group: %+v, %v", rec, err)
	}
}

// TestUnreachableZone: with a zone unlisted, instances elsewhere are found, and a miss is not "not
// found", which the join service's cache would keep.
func TestUnreachableZone(t *testing.T) {
	srv := newServer(t)
	put(t, srv, node("berth-workers-a", zoneB, workGroup, "10.0.2.10"), node("berth-control-plane-c", zoneC, cpGroup, "10.0.1.10"))
	srv.SetUnreachable(zoneC)
	l := newLookup(t, srv, nil)
	if _, err := lookup(t, l, "10.0.2.10"); err != nil {
		t.Fatalf("instance in a reachable zone: %v", err)
	}
	_, err := lookup(t, l, "10.0.1.10")
	if err == nil || errors.Is(err, metadata.ErrNotFound) || !strings.Contains(err.Error(), "could not list zones/"+zoneC) {
		t.Errorf("instance in the unreachable zone: %v, want a failure naming the zone", err)
	}
}

func TestAddressOnTwoInstances(t *testing.T) {
	srv := newServer(t)
	put(t, srv, node("berth-workers-a", zoneB, workGroup, "10.0.2.10"), node("berth-workers-b", zoneB, workGroup, "10.0.2.10", "10.0.2.11"))
	l := newLookup(t, srv, nil)
	_, err := lookup(t, l, "10.0.2.10")
	if err == nil || errors.Is(err, metadata.ErrNotFound) || !strings.Contains(err.Error(), "on both") {
		t.Errorf("address of two instances: %v", err)
	}
	if inst, err := lookup(t, l, "10.0.2.11"); err != nil || inst.Name != "berth-workers-b" {
		t.Errorf("the other address of one of them: %+v, %v", inst, err)
	}
}

// TestCancelledWaiter: a caller that gives up while the refresh is at Compute Engine gets its context's
// error; the others waiting for the same refresh get their answers from it.
func TestCancelledWaiter(t *testing.T) {
	srv := newServer(t)
	put(t, srv, node("berth-workers-a", zoneB, workGroup, "10.0.2.10"), node("berth-workers-b", zoneB, workGroup, "10.0.2.20"))
	l := newLookup(t, srv, func(c *Config) { c.Groups = map[string]metadata.Role{workGroup: metadata.RoleWorker} })
	arrived := srv.Hold()

	ctx, cancel := context.WithCancel(t.Context())
	gone := make(chan error, 1)
	go func() {
		_, err := l.InstanceByAddress(ctx, netip.MustParseAddr("10.0.2.10"))
		gone <- err
	}()
	<-arrived // the refresh is at Compute Engine
	stays := make(chan error, 1)
	go func() {
		inst, err := l.InstanceByAddress(t.Context(), netip.MustParseAddr("10.0.2.20"))
		if err == nil && inst.Name != "berth-workers-b" {
			err = fmt.Errorf("got %s", inst.Name)
		}
		stays <- err
	}()
	cancel()
	if err := <-gone; !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled lookup: %v, want context.Canceled", err)
	}
	srv.Release()
	if err := <-stays; err != nil {
		t.Errorf("the other lookup: %v", err)
	}
	if calls := srv.Calls(computetest.AggregatedList); calls != 1 {
		t.Errorf("%d aggregatedList calls, want 1", calls)
	}
}

// TestFailedRefresh: a refresh that fails answers its own waiters and the misses of the interval after it
// with its error, without calls, and the next interval's miss tries again.
func TestFailedRefresh(t *testing.T) {
	srv := newServer(t)
	put(t, srv, node("berth-workers-a", zoneB, workGroup, "10.0.2.10"))
	clock := clocktest.New(time.Date(2026, 11, 24, 12, 0, 0, 0, time.UTC))
	l := newLookup(t, srv, func(c *Config) { c.Clock = clock.Now; c.ListRate = rate.Inf })
	srv.FailNext(1000, computetest.Unavailable)
	_, err := lookup(t, l, "10.0.2.10")
	if err == nil || errors.Is(err, metadata.ErrNotFound) || !strings.Contains(err.Error(), "503") {
		t.Fatalf("lookup while Compute Engine fails: %v", err)
	}
	calls := srv.Calls(computetest.AggregatedList)
	if _, err := lookup(t, l, "10.0.2.10"); err == nil || !strings.Contains(err.Error(), "503") {
		t.Errorf("lookup within the interval after a failed refresh: %v, want its error", err)
	}
	if got := srv.Calls(computetest.AggregatedList); got != calls {
		t.Errorf("%d aggregatedList calls after a miss within the interval, want %d", got, calls)
	}
	srv.FailNext(0, 0)
	clock.Advance(DefaultMinRefreshInterval)
	if _, err := lookup(t, l, "10.0.2.10"); err != nil {
		t.Errorf("lookup after Compute Engine recovered: %v", err)
	}
}

func TestMaxInstances(t *testing.T) {
	srv := newServer(t)
	for i := range 11 {
		put(t, srv, node(fmt.Sprintf("berth-workers-%02d", i), zoneB, workGroup, addrOf(i).String()))
	}
	l := newLookup(t, srv, func(c *Config) { c.MaxInstances = 10 })
	_, err := l.InstanceByAddress(t.Context(), addrOf(0))
	if err == nil || errors.Is(err, metadata.ErrNotFound) || !strings.Contains(err.Error(), "more than 10") {
		t.Errorf("project beyond MaxInstances: %v", err)
	}
}

// TestPacing: a list call whose turn under the join service's own pacing would come after the refresh
// timeout fails at once, as a failure, and never reaches Compute Engine.
func TestPacing(t *testing.T) {
	srv := newServer(t)
	put(t, srv, node("berth-workers-a", zoneB, workGroup, "10.0.2.10"))
	clock := clocktest.New(time.Date(2026, 11, 24, 12, 0, 0, 0, time.UTC))
	l := newLookup(t, srv, func(c *Config) {
		c.Clock = clock.Now
		c.Groups = map[string]metadata.Role{workGroup: metadata.RoleWorker}
		c.ListRate = rate.Every(time.Hour)
		c.Burst = 2 // one refresh: the list and the group
	})
	if _, err := lookup(t, l, "10.0.2.10"); err != nil {
		t.Fatal(err)
	}
	clock.Advance(DefaultMaxIndexAge)
	_, err := lookup(t, l, "10.0.2.10")
	if err == nil || errors.Is(err, metadata.ErrNotFound) || !strings.Contains(err.Error(), "pacing") {
		t.Errorf("refresh beyond the pace: %v, want a pacing failure", err)
	}
	if calls := srv.Calls(computetest.AggregatedList); calls != 1 {
		t.Errorf("%d aggregatedList calls, want 1", calls)
	}
}

func TestNewChecksConfig(t *testing.T) {
	srv := newServer(t)
	svc := newTestService(t, srv)
	ok := func() Config { return Config{Service: svc, Project: project, Network: network, Groups: testGroups} }
	for _, tc := range []struct {
		name string
		mod  func(*Config)
		want string
	}{
		{"no service", func(c *Config) { c.Service = nil }, "Service is required"},
		{"no project", func(c *Config) { c.Project = "" }, "project id"},
		{"bad project", func(c *Config) { c.Project = "Berth_Test" }, "project id"},
		{"no network", func(c *Config) { c.Network = "" }, "network"},
		{"network URL", func(c *Config) { c.Network = "https://www.googleapis.com/compute/v1/projects/p/global/networks/n" }, "network"},
		{"no groups", func(c *Config) { c.Groups = nil }, "no managed instance group"},
		{"bad group key", func(c *Config) { c.Groups = map[string]metadata.Role{"berth-workers": metadata.RoleWorker} }, "region or zone"},
		{"bad role", func(c *Config) { c.Groups = map[string]metadata.Role{workGroup: "admin"} }, `role "admin"`},
		{"page too big", func(c *Config) { c.PageSize = 501 }, "page size"},
		{"negative interval", func(c *Config) { c.MinRefreshInterval = -1 }, "negative"},
		{"age below interval", func(c *Config) { c.MaxIndexAge = time.Second }, "shorter than the min refresh interval"},
		{"negative max instances", func(c *Config) { c.MaxInstances = -1 }, "negative"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := ok()
			tc.mod(&cfg)
			_, err := New(cfg)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("New: %v, want an error saying %q", err, tc.want)
			}
		})
	}

	// Changing the caller's map afterwards changes nothing.
	groups := map[string]metadata.Role{workGroup: metadata.RoleWorker}
	put(t, srv, node("berth-workers-a", zoneB, workGroup, "10.0.2.10"))
	cfg := ok()
	cfg.Groups = groups
	l, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	groups[workGroup] = metadata.RoleControlPlane
	inst, err := lookup(t, l, "10.0.2.10")
	if err != nil || inst.Role != metadata.RoleWorker {
		t.Errorf("after changing the caller's map: %+v, %v", inst, err)
	}
}

func TestInstanceID(t *testing.T) {
	id := InstanceID("berth-test", "europe-west1-b", 4700000000000000123)
	if id != "projects/berth-test/zones/europe-west1-b/instances/4700000000000000123" {
		t.Errorf("InstanceID = %q", id)
	}
	p, z, n, err := ParseInstanceID(id)
	if err != nil || p != "berth-test" || z != "europe-west1-b" || n != 4700000000000000123 {
		t.Errorf("ParseInstanceID(%q) = %q, %q, %d, %v", id, p, z, n, err)
	}
	if _, _, _, err := ParseInstanceID("projects/example.com:berth-test/zones/us-central1-a/instances/1"); err != nil {
		t.Errorf("domain-scoped project: %v", err)
	}
	for _, bad := range []string{
		"",
		"i-0123456789abcdef0",
		"projects/berth-test/zones/europe-west1-b/instances/berth-workers-a", // a name, which is reused
		"projects/berth-test/zones/europe-west1-b/instances/0123",
		"projects/berth-test/zones/europe-west1-b/instances/0",
		"projects/berth-test/zones/europe-west1-b/instances/18446744073709551616",
		"projects/berth-test/zones/europe-west1/instances/1",
		"projects/Berth/zones/europe-west1-b/instances/1",
		"projects/berth-test/regions/europe-west1-b/instances/1",
		"projects/berth-test/zones/europe-west1-b/instances/1/x",
		"https://www.googleapis.com/compute/v1/projects/berth-test/zones/europe-west1-b/instances/1",
	} {
		if _, _, _, err := ParseInstanceID(bad); err == nil {
			t.Errorf("ParseInstanceID(%q) accepted it", bad)
		}
	}
}
