package storm

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/backoff"
	"github.com/berthlabs/berth/internal/cloud/aws/ec2instances/ec2test"
	"github.com/berthlabs/berth/nodeagent/internal/joinserver"
	"github.com/berthlabs/berth/test/swtpm/swtpmtest"
)

// poolSize is the number of swtpm processes the storm's agents share.
const poolSize = 8

// realAgents boot as berth-agent processes beside each storm, for the agent's own peak RSS.
const realAgents = 2

// ec2Throttle is the fraction of EC2 calls ec2test answers RequestLimitExceeded in the throttled EC2 storm.
const ec2Throttle = 0.2

// TestBench is make bench: storms of N agents (BERTH_BENCH_N, default 100,300,1000) against one join service,
// with where the machine's CPU went during each (the service, the agents, the TPMs, the API server); then, for
// each N of BERTH_BENCH_LATE_N (default 100,1000), N agents started 10 s before the service with Berth's retry
// schedule beside N retrying every 30 s on a fixed tick; then (unless BERTH_BENCH_EC2=0) the same storms
// against a join service on EC2, whose lookups and EKs come from EC2's API, and one of them with a fifth of the
// EC2 calls throttled. It prints Markdown tables, and appends them to BERTH_BENCH_OUT if set. Nothing here is a
// threshold: the figures are for docs/benchmarks.md. What is checked is that every agent gets its ticket, and
// that the EC2 calls stay within what batching and caching promise: at most one DescribeInstances and one
// GetInstanceTpmEkPub a ticket, throttled calls apart.
func TestBench(t *testing.T) {
	if os.Getenv("BERTH_BENCH") == "" {
		t.Skip("join storm benchmark: make bench runs it (BERTH_BENCH=1)")
	}
	sizes := []int{100, 300, 1000}
	if s := os.Getenv("BERTH_BENCH_N"); s != "" {
		sizes = parseSizes(t, "BERTH_BENCH_N", s)
	}
	lateSizes := []int{100, 1000}
	if s := os.Getenv("BERTH_BENCH_LATE_N"); s != "" {
		lateSizes = parseSizes(t, "BERTH_BENCH_LATE_N", s)
	}
	var out strings.Builder
	fmt.Fprintf(&out, "Storms: N agents boot at once against one join service (%d swtpm processes shared by the agents, %d real `berth-agent boot` processes beside them).\n\n", poolSize, realAgents)
	out.WriteString("| N | time to ticket p50 | p99 | max | tickets/s | join service CPU-s per ticket | join service peak RSS | agent peak RSS | tickets/s per join service CPU | connections open to the service, most | kernel accept queue, longest |\n")
	out.WriteString("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	plain := map[int]stormResult{}
	for _, n := range sizes {
		r := storm(t, n, stormMode{})
		plain[n] = r
		fmt.Fprintf(&out, "| %d | %s | %.0f MiB | %.0f | %s |\n", n, r.cells(), float64(r.agentPeak)/(1<<20),
			1/r.cpuPerTicket.Seconds(), r.queues.cells())
	}
	fmt.Fprintf(&out, "\nWhere the machine's CPU went during each storm, in CPU-ms per ticket (the storm's wall time × %d CPUs is the budget):\n\n", runtime.NumCPU())
	out.WriteString("| N |")
	for _, side := range Sides {
		fmt.Fprintf(&out, " %s |", side)
	}
	out.WriteString(" all | budget |\n|---:|" + strings.Repeat("---:|", len(Sides)+2) + "\n")
	for _, n := range sizes {
		r := plain[n]
		fmt.Fprintf(&out, "| %d |", n)
		var all time.Duration
		for _, side := range Sides {
			all += r.sides[side]
			fmt.Fprintf(&out, " %.2f |", ms(r.sides[side]/time.Duration(n)))
		}
		fmt.Fprintf(&out, " %.2f | %.2f |\n", ms(all/time.Duration(n)), ms(r.wall*time.Duration(runtime.NumCPU())/time.Duration(n)))
	}

	fmt.Fprintf(&out, "\nWhen the join service comes up late: N agents with Berth's retry schedule (a refused connection retried within %v, capped exponential backoff with full jitter once a service answered, cap 5 s) and N retrying every 30 s on a fixed tick start together; the service comes up 10 s later. Times are from the moment it listens; connected is the agent's first TCP connection to it, ticket when the agent has its ticket. The service's CPU per ticket, its connections and its accept queue are over the whole run, both groups; before the service listens, the agents' refused connections reach no process.\n\n", backoff.Policy{}.Soon(func() float64 { return 1 }))
	out.WriteString("| N | group | connected p50 | p99 | ticket p50 | p99 | max | join service CPU-s per ticket | connections open to the service, most | kernel accept queue, longest |\n")
	out.WriteString("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	var ratios []string
	for _, n := range lateSizes {
		var late lateResult
		subtest(t, fmt.Sprintf("late-service-%d", n), func(t *testing.T) { late = lateService(t, n) })
		if len(late.groups) == 0 {
			continue // left out by -run
		}
		for _, g := range late.groups {
			fmt.Fprintf(&out, "| %d | %s | %.2f s | %.2f s | %.2f s | %.2f s | %.2f s | %.4f | %s |\n", n, g.name,
				g.connected.p50.Seconds(), g.connected.p99.Seconds(), g.ticket.p50.Seconds(), g.ticket.p99.Seconds(), g.ticket.max.Seconds(),
				late.cpuPerTicket.Seconds(), late.queues.cells())
		}
		berth, fixed := late.groups[0], late.groups[1]
		ratios = append(ratios, fmt.Sprintf("- N = %d: **p99 ratio, fixed 30 s tick / Berth: %.1f×** (time to ticket); %.0f× for the first connection.",
			n, fixed.ticket.p99.Seconds()/berth.ticket.p99.Seconds(), fixed.connected.p99.Seconds()/berth.connected.p99.Seconds()))
	}
	out.WriteString("\n" + strings.Join(ratios, "\n") + "\n")
	fmt.Fprintf(&out, "\nThe join service serves %d connections at once and works on %d exchanges at once (4 per CPU); connections open beyond that wait, accepted, for one of them. Its listening socket's backlog (somaxconn) is %d.\n",
		joinserver.Connections, 4*runtime.NumCPU(), ListenBacklog())
	if os.Getenv("BERTH_BENCH_EC2") != "0" {
		writeEC2Storms(t, &out, sizes, plain)
	}
	t.Logf("\n%s", out.String())
	if path := os.Getenv("BERTH_BENCH_OUT"); path != "" {
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if _, err := io.WriteString(f, out.String()); err != nil {
			t.Fatal(err)
		}
	}
}

// parseSizes reads a list of storm sizes such as 100,300 from the environment variable name.
func parseSizes(t *testing.T, name, s string) []int {
	var sizes []int
	for f := range strings.SplitSeq(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n <= 0 {
			t.Fatalf("%s=%q: want sizes such as 100,300", name, s)
		}
		sizes = append(sizes, n)
	}
	return sizes
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// writeEC2Storms runs the storms of sizes against a join service on EC2, and one of them (the largest size
// up to 300) with ec2Throttle of the EC2 calls throttled, and writes their table, with each p99 against
// plain's at the same N.
func writeEC2Storms(t *testing.T, out *strings.Builder, sizes []int, plain map[int]stormResult) {
	throttledN := slices.Min(sizes)
	for _, n := range sizes {
		if n <= 300 {
			throttledN = max(throttledN, n)
		}
	}
	type run struct {
		n int
		m stormMode
	}
	var runs []run
	for _, n := range sizes {
		runs = append(runs, run{n, stormMode{ec2: true}})
	}
	runs = append(runs, run{throttledN, stormMode{ec2: true, throttle: ec2Throttle}})

	fmt.Fprintf(out, "\nStorms against a join service on EC2: it reads its own record from AWS's IMDS emulator and looks every node up through EC2's API (a local endpoint speaking EC2's wire format, every agent an instance of the workers' autoscaling group); TPMs without EK certificate, trusted by the EK EC2 reports. Calls per ticket count every call EC2 received, throttled ones included.\n\n")
	out.WriteString("| N | time to ticket p50 | p99 | max | tickets/s | join service CPU-s per ticket | join service peak RSS | DescribeInstances calls per ticket | GetInstanceTpmEkPub calls per ticket | throttled calls | p99 EC2 / plain |\n")
	out.WriteString("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, run := range runs {
		r := storm(t, run.n, run.m)
		label := strconv.Itoa(run.n)
		if run.m.throttle > 0 {
			label += fmt.Sprintf(", %.0f %% of calls throttled", 100*run.m.throttle)
		}
		fmt.Fprintf(out, "| %s | %s | %.2f | %.2f | %d | %.1f× |\n", label, r.cells(),
			float64(r.ec2.describe)/float64(r.ec2.tickets), float64(r.ec2.ek)/float64(r.ec2.tickets), r.ec2.throttled,
			r.p99.Seconds()/plain[run.n].p99.Seconds())
	}
}

// stormMode says against what a storm runs: the plain join service (metadata service, EK certificates) or
// one on EC2, with a fraction of its EC2 calls throttled.
type stormMode struct {
	ec2      bool
	throttle float64
}

// name tells a storm's profiles and logs apart.
func (m stormMode) name(n int) string {
	switch {
	case m.throttle > 0:
		return fmt.Sprintf("ec2-throttled-%d", n)
	case m.ec2:
		return fmt.Sprintf("ec2-%d", n)
	}
	return strconv.Itoa(n)
}

type stormResult struct {
	p50, p99, max          time.Duration
	perSecond              float64
	wall                   time.Duration
	cpuPerTicket           time.Duration
	servicePeak, agentPeak int64
	// sides is the CPU time of each side of the storm, from its start to its last ticket.
	sides CPUSnapshot
	// queues are the most connections open to the join service at once, and its longest accept queue.
	queues ConnectionCounts
	ec2    ec2Calls
}

// cells are the counts as table cells.
func (c ConnectionCounts) cells() string { return fmt.Sprintf("%d | %d", c.Established, c.AcceptQueue) }

// ec2Calls are the calls EC2 received during a storm, and the tickets the join service issued.
type ec2Calls struct {
	describe, ek, throttled, tickets int
	// The join service's warnings: lookups and EK requests that failed (after the SDK's retries).
	lookupsFailed, eksFailed int
}

// cells are a storm's figures that every table shows, from p50 to the service's peak RSS.
func (r stormResult) cells() string {
	return fmt.Sprintf("%.2f s | %.2f s | %.2f s | %.0f | %.4f | %.0f MiB", r.p50.Seconds(), r.p99.Seconds(), r.max.Seconds(),
		r.perSecond, r.cpuPerTicket.Seconds(), float64(r.servicePeak)/(1<<20))
}

// storm runs a storm of n agents as a subtest: its host (API server, etcd, TPMs, join service) ends with it,
// before the next storm starts.
func storm(t *testing.T, n int, mode stormMode) (r stormResult) {
	subtest(t, "storm-"+mode.name(n), func(t *testing.T) { r = runStorm(t, n, mode) })
	return r
}

// subtest runs f as a subtest of t, and ends t if it fails: later figures would be measured against none.
func subtest(t *testing.T, name string, f func(t *testing.T)) {
	t.Helper()
	if !t.Run(name, f) {
		t.FailNow()
	}
}

func runStorm(t *testing.T, n int, mode stormMode) stormResult {
	t.Helper()
	var h *Host
	if mode.ec2 {
		h = NewEC2Host(t, poolSize)
		h.EC2.ThrottleFraction(mode.throttle)
	} else {
		h = NewHost(t, poolSize)
	}
	workers := h.AddWorkers(n + realAgents)
	svc := h.StartService()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()

	tpms := make([]*swtpmtest.TPM, realAgents)
	for i := range tpms {
		tpms[i] = h.NewTPM(t)
	}
	profile := profileDuring(t, svc, mode.name(n))
	var wg sync.WaitGroup
	peaks := make([]int64, realAgents)
	errs := make([]error, realAgents)
	for i, tpm := range tpms {
		wg.Go(func() { peaks[i], _, errs[i] = h.BootAgent(ctx, workers[n+i], tpm) })
	}
	conns := WatchConnections(netip.MustParseAddrPort(h.JoinAddr))
	stopProfile := profileAgents(t, mode.name(n))
	cpu0 := TakeCPUSnapshot(svc.Pid())
	start := time.Now()
	agents := h.Storm(ctx, workers[:n], backoff.Policy{}, nil)
	end := time.Now()
	sides := TakeCPUSnapshot(svc.Pid()).Since(cpu0)
	stopProfile()
	q := conns.Stop()
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	var times []time.Duration
	for _, a := range agents {
		if a.Err != nil {
			t.Fatalf("%s: %v", a.Name, a.Err)
		}
		times = append(times, a.Ticket.Sub(a.Start))
	}
	r := stormResult{perSecond: float64(n) / end.Sub(start).Seconds(), wall: end.Sub(start), cpuPerTicket: svc.StormCPU() / time.Duration(n),
		servicePeak: svc.PeakRSS(), agentPeak: slices.Max(peaks), sides: sides, queues: q}
	r.p50, r.p99, r.max = quantiles(times)
	profile()
	svc.Kill()
	saveLog(t, svc, mode.name(n))
	t.Logf("N=%d: %d tickets in %.1fs; p50 %v p99 %v max %v; service %v CPU a ticket, peak RSS %d MiB; agent process peak RSS %d MiB",
		n, n, end.Sub(start).Seconds(), r.p50, r.p99, r.max, r.cpuPerTicket, r.servicePeak>>20, r.agentPeak>>20)
	if mode.ec2 {
		r.ec2 = checkEC2Calls(t, h, svc, n+realAgents)
	}
	return r
}

// checkEC2Calls reads what EC2 was asked during a storm of agents nodes, and checks it against what the
// join service's batching and caching promise: every node is looked up in batches and its EK asked for once,
// so EC2 answers at most one DescribeInstances and one GetInstanceTpmEkPub a ticket, apart from the calls it
// throttled (which the SDK retries).
func checkEC2Calls(t *testing.T, h *Host, svc *Service, agents int) ec2Calls {
	t.Helper()
	log := svc.Log()
	c := ec2Calls{
		describe: h.EC2.Calls(ec2test.DescribeInstances), ek: h.EC2.Calls(ec2test.GetInstanceTpmEkPub),
		throttled: h.EC2.Throttled(), tickets: strings.Count(log, `"msg":"join ticket issued"`),
		lookupsFailed: strings.Count(log, `"msg":"EC2 instance lookup failed"`), eksFailed: strings.Count(log, `"msg":"EC2 EK request failed"`),
	}
	var addrs, most int
	for _, req := range h.EC2.Requests(ec2test.DescribeInstances) {
		k := addressesAsked(req)
		addrs += k
		most = max(most, k)
	}
	t.Logf("EC2: %d tickets; %d DescribeInstances calls asking about %d addresses (%.1f a call, at most %d), %d GetInstanceTpmEkPub calls; %d calls throttled; the join service logged %d failed lookups, %d failed EK requests",
		c.tickets, c.describe, addrs, float64(addrs)/float64(max(c.describe, 1)), most, c.ek, c.throttled, c.lookupsFailed, c.eksFailed)
	if c.tickets < agents {
		t.Errorf("the join service logged %d tickets for %d agents that all got one", c.tickets, agents)
	}
	for _, a := range []struct {
		action string
		calls  int
	}{{ec2test.DescribeInstances, c.describe}, {ec2test.GetInstanceTpmEkPub, c.ek}} {
		if answered := a.calls - c.throttled; answered > c.tickets {
			t.Errorf("%s: %d calls, %d throttled (of all actions): over %d calls answered for %d tickets, more than one a ticket",
				a.action, a.calls, c.throttled, answered, c.tickets)
		}
	}
	return c
}

// addressesAsked counts the values of a DescribeInstances request's address filter.
func addressesAsked(req url.Values) int {
	for key, v := range req {
		if idx, ok := strings.CutSuffix(key, ".Name"); ok && strings.HasPrefix(idx, "Filter.") && v[0] == "network-interface.addresses.private-ip-address" {
			n := 0
			for k := range req {
				if strings.HasPrefix(k, idx+".Value.") {
					n++
				}
			}
			return n
		}
	}
	return 0
}

// saveLog keeps the join service's log in BERTH_BENCH_PROFILES/joinservice-name.log, if that is set.
func saveLog(t *testing.T, svc *Service, name string) {
	dir := os.Getenv("BERTH_BENCH_PROFILES")
	if dir == "" {
		return
	}
	if err := os.WriteFile(filepath.Join(dir, "joinservice-"+name+".log"), []byte(svc.Log()), 0o644); err != nil {
		t.Logf("saving the join service's log: %v", err)
	}
}

// profileDuring takes a CPU profile of the service for the storm's first 12 seconds, and a goroutine profile
// three seconds in, into BERTH_BENCH_PROFILES/joinservice-name.{pprof,goroutines.txt} (name N, or ec2-N for a
// service on EC2), if that is set; the returned func waits for them.
func profileDuring(t *testing.T, svc *Service, name string) func() {
	dir := os.Getenv("BERTH_BENCH_PROFILES")
	if dir == "" {
		return func() {}
	}
	fetch := func(path, file string) {
		resp, err := http.Get("http://" + svc.Debug + path)
		if err != nil {
			t.Logf("profile: %v", err)
			return
		}
		defer resp.Body.Close()
		f, err := os.Create(filepath.Join(dir, file))
		if err != nil {
			t.Logf("profile: %v", err)
			return
		}
		defer f.Close()
		io.Copy(f, resp.Body)
	}
	var wg sync.WaitGroup
	// Long enough for a whole storm of 1,000 agents; the idle seconds after it add no samples.
	wg.Go(func() { fetch("/debug/pprof/profile?seconds=12", "joinservice-"+name+".pprof") })
	wg.Go(func() {
		time.Sleep(3 * time.Second)
		fetch("/debug/pprof/goroutine?debug=1", "joinservice-"+name+".goroutines.txt")
	})
	return wg.Wait
}

// profileAgents takes a CPU profile of the test process, the storm's agents, into
// BERTH_BENCH_PROFILES/agents-name.pprof if that is set, until the returned func is called.
func profileAgents(t *testing.T, name string) func() {
	dir := os.Getenv("BERTH_BENCH_PROFILES")
	if dir == "" {
		return func() {}
	}
	f, err := os.Create(filepath.Join(dir, "agents-"+name+".pprof"))
	if err != nil {
		t.Logf("profile: %v", err)
		return func() {}
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		t.Logf("profile: %v", err)
		f.Close()
		return func() {}
	}
	return func() {
		pprof.StopCPUProfile()
		f.Close()
	}
}

type quantileSet struct{ p50, p99, max time.Duration }

type group struct {
	name              string
	connected, ticket quantileSet
}

type lateResult struct {
	groups       []group // Berth's, then the fixed tick's
	cpuPerTicket time.Duration
	queues       ConnectionCounts
}

// lateService starts n agents with Berth's schedule and n on a fixed 30 s tick, and the service 10 s later.
func lateService(t *testing.T, n int) lateResult {
	t.Helper()
	h := NewHost(t, poolSize)
	workers := h.AddWorkers(2 * n)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var wg sync.WaitGroup
	var berth, fixed []*Agent
	wg.Go(func() { berth = h.Storm(ctx, workers[:n], backoff.Policy{}, nil) })
	// A draw just under 1 makes every delay the ceiling: a fixed 30 s tick.
	wg.Go(func() {
		fixed = h.Storm(ctx, workers[n:], backoff.Policy{Initial: 30 * time.Second, Max: 30 * time.Second},
			func() float64 { return 0.999999 })
	})
	time.Sleep(10 * time.Second)
	conns := WatchConnections(netip.MustParseAddrPort(h.JoinAddr))
	svc := h.StartService()
	wg.Wait()
	r := lateResult{cpuPerTicket: svc.StormCPU() / time.Duration(2*n), queues: conns.Stop()}
	svc.Kill()
	for _, g := range []struct {
		name   string
		agents []*Agent
	}{{"Berth", berth}, {"fixed 30 s tick", fixed}} {
		var connected, tickets []time.Duration
		for _, a := range g.agents {
			if a.Err != nil {
				t.Fatalf("%s: %v", a.Name, a.Err)
			}
			if a.Connected().IsZero() {
				t.Fatalf("%s got its ticket without the join client logging its connection", a.Name)
			}
			connected = append(connected, a.Connected().Sub(svc.Ready))
			tickets = append(tickets, a.Ticket.Sub(svc.Ready))
		}
		gr := group{name: g.name}
		gr.connected.p50, gr.connected.p99, gr.connected.max = quantiles(connected)
		gr.ticket.p50, gr.ticket.p99, gr.ticket.max = quantiles(tickets)
		r.groups = append(r.groups, gr)
	}
	t.Logf("late service, N=%d: %+v", n, r)
	return r
}

// quantiles are the nearest-rank p50, p99 and maximum.
func quantiles(d []time.Duration) (p50, p99, maxd time.Duration) {
	s := slices.Clone(d)
	slices.Sort(s)
	rank := func(q float64) time.Duration {
		i := int(q*float64(len(s))+0.999999) - 1
		return s[max(0, min(i, len(s)-1))]
	}
	return rank(0.50), rank(0.99), s[len(s)-1]
}
