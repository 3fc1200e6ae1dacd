package storm

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/backoff"
)

// poolSize is the number of swtpm processes the storm's agents share.
const poolSize = 8

// realAgents boot as berth-agent processes beside each storm, for the agent's own peak RSS.
const realAgents = 2

// TestBench is make bench: storms of N agents (BERTH_BENCH_N, default 100,300,1000) against one join service,
// then agents started 10 s before the service with Berth's retry schedule beside a group retrying every 30 s
// on a fixed tick. It prints Markdown tables, and appends them to BERTH_BENCH_OUT if set. Nothing here is a
// threshold: the figures are for docs/benchmarks.md.
func TestBench(t *testing.T) {
	if os.Getenv("BERTH_BENCH") == "" {
		t.Skip("join storm benchmark: make bench runs it (BERTH_BENCH=1)")
	}
	sizes := []int{100, 300, 1000}
	if s := os.Getenv("BERTH_BENCH_N"); s != "" {
		sizes = nil
		for f := range strings.SplitSeq(s, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || n <= 0 {
				t.Fatalf("BERTH_BENCH_N=%q: want sizes such as 100,300", s)
			}
			sizes = append(sizes, n)
		}
	}
	var out strings.Builder
	fmt.Fprintf(&out, "Storms: N agents boot at once against one join service (%d swtpm processes shared by the agents, %d real `berth-agent boot` processes beside them).\n\n", poolSize, realAgents)
	out.WriteString("| N | time to ticket p50 | p99 | max | tickets/s | join service CPU-s per ticket | join service peak RSS | agent peak RSS |\n")
	out.WriteString("|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, n := range sizes {
		r := storm(t, n)
		fmt.Fprintf(&out, "| %d | %.2f s | %.2f s | %.2f s | %.0f | %.4f | %.0f MiB | %.0f MiB |\n",
			n, r.p50.Seconds(), r.p99.Seconds(), r.max.Seconds(), r.perSecond, r.cpuPerTicket.Seconds(),
			float64(r.servicePeak)/(1<<20), float64(r.agentPeak)/(1<<20))
	}
	late := lateService(t, 100)
	fmt.Fprintf(&out, "\nTime to ticket after the join service appears: 100 agents with Berth's retry schedule (capped exponential backoff, full jitter, cap 5 s) and 100 retrying every 30 s on a fixed tick start together; the service comes up 10 s later.\n\n")
	out.WriteString("| group | p50 after the service appears | p99 | max |\n|---|---:|---:|---:|\n")
	for _, g := range late {
		fmt.Fprintf(&out, "| %s | %.2f s | %.2f s | %.2f s |\n", g.name, g.p50.Seconds(), g.p99.Seconds(), g.max.Seconds())
	}
	fmt.Fprintf(&out, "\nRatio of p99 times, fixed 30 s tick / Berth: **%.1f×**\n", late[1].p99.Seconds()/late[0].p99.Seconds())
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

type stormResult struct {
	p50, p99, max          time.Duration
	perSecond              float64
	cpuPerTicket           time.Duration
	servicePeak, agentPeak int64
}

func storm(t *testing.T, n int) stormResult {
	t.Helper()
	h := NewHost(t, poolSize)
	workers := h.AddWorkers(n + realAgents)
	svc := h.StartService()
	profile := profileDuring(t, svc, n)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()

	var wg sync.WaitGroup
	peaks := make([]int64, realAgents)
	errs := make([]error, realAgents)
	for i := range realAgents {
		tpm := h.EKCA.NewTPM(t)
		wg.Go(func() { peaks[i], _, errs[i] = h.BootAgent(ctx, workers[n+i], tpm) })
	}
	start := time.Now()
	agents := h.Storm(ctx, workers[:n], backoff.Policy{}, nil)
	end := time.Now()
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
	r := stormResult{perSecond: float64(n) / end.Sub(start).Seconds(), cpuPerTicket: svc.StormCPU() / time.Duration(n),
		servicePeak: svc.PeakRSS(), agentPeak: slices.Max(peaks)}
	r.p50, r.p99, r.max = quantiles(times)
	profile()
	svc.Kill()
	t.Logf("N=%d: %d tickets in %.1fs; p50 %v p99 %v max %v; service %v CPU a ticket, peak RSS %d MiB; agent process peak RSS %d MiB",
		n, n, end.Sub(start).Seconds(), r.p50, r.p99, r.max, r.cpuPerTicket, r.servicePeak>>20, r.agentPeak>>20)
	return r
}

// profileDuring takes a CPU profile of the service for the storm's first seconds, and a goroutine profile
// one second in, into BERTH_BENCH_PROFILES/joinservice-N.{pprof,goroutines.txt}, if that is set; the
// returned func waits for them.
func profileDuring(t *testing.T, svc *Service, n int) func() {
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
	wg.Go(func() { fetch("/debug/pprof/profile?seconds=5", fmt.Sprintf("joinservice-%d.pprof", n)) })
	wg.Go(func() {
		time.Sleep(time.Second)
		fetch("/debug/pprof/goroutine?debug=1", fmt.Sprintf("joinservice-%d.goroutines.txt", n))
	})
	return wg.Wait
}

type group struct {
	name          string
	p50, p99, max time.Duration
}

// lateService starts n agents with Berth's schedule and n on a fixed 30 s tick, and the service 10 s later.
func lateService(t *testing.T, n int) []group {
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
	svc := h.StartService()
	wg.Wait()
	svc.Kill()
	var groups []group
	for _, g := range []struct {
		name   string
		agents []*Agent
	}{{"Berth (backoff, jitter, cap 5 s)", berth}, {"fixed 30 s tick", fixed}} {
		var times []time.Duration
		for _, a := range g.agents {
			if a.Err != nil {
				t.Fatalf("%s: %v", a.Name, a.Err)
			}
			times = append(times, a.Ticket.Sub(svc.Ready))
		}
		r := group{name: g.name}
		r.p50, r.p99, r.max = quantiles(times)
		groups = append(groups, r)
	}
	return groups
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
