package storm

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/backoff"
	"github.com/berthlabs/berth/nodeagent/internal/joinservice"
	"github.com/berthlabs/berth/test/clustertest"
)

// Sizes of TestMetrics: as TestHostileNetwork's genuine storm, plus agents that storm before the policy is
// there and strangers the admission closes.
const (
	metricsEarly     = 8
	metricsStorm     = 40
	metricsStrangers = 20
)

// TestMetrics runs the real join service process with its metrics endpoint (agent.yaml metricsListen) and
// no policy file yet: /readyz is not ready, and agents that storm it are refused for their measurements and
// retry. Once the policy file appears /readyz turns ready and they get their tickets; strangers' connections
// are closed before their handshake; then a storm of genuine agents joins while /metrics is scraped over
// HTTP. The tickets and refusals the metrics count are exactly those the agents' join clients logged, the
// strangers' connections are counted by reason, and the connection gauges return to zero.
func TestMetrics(t *testing.T) {
	h := NewHost(t, 4)
	policyFile := filepath.Join(h.dir, "policy.yaml")
	policyData, err := os.ReadFile(policyFile)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(policyFile); err != nil {
		t.Fatal(err)
	}
	agentLog := &clustertest.SafeBuffer{}
	h.AgentLog = agentLog
	svc := h.StartService()
	base := "http://" + h.MetricsAddr

	code, body := httpGet(t, base+"/readyz")
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "policy: no join policy loaded yet") {
		t.Fatalf("/readyz before the policy file exists: %d %q, want 503 naming the policy", code, body)
	}
	if got := scrape(t, base)["berth_join_policy_loaded"]; got != 0 {
		t.Errorf("berth_join_policy_loaded before the policy file exists: %v", got)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	bo := backoff.Policy{Max: time.Second}
	early := make(chan []*Agent, 1)
	go func() { early <- h.Storm(ctx, h.AddWorkers(metricsEarly), bo, nil) }()
	// The policy comes once the service has refused someone for want of it.
	waitFor(t, "a refusal for measurements", func() bool {
		return scrape(t, base)[`berth_join_tickets_refused_total{call="join",reason="measurements"}`] > 0
	})
	if err := os.WriteFile(policyFile, policyData, 0o600); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "/readyz to turn ready", func() bool {
		code, _ := httpGet(t, base+"/readyz")
		return code == http.StatusOK
	})
	for _, a := range <-early {
		if a.Err != nil {
			t.Errorf("%s, which stormed before the policy, did not join after it: %v", a.Name, a.Err)
		}
	}

	for i := range metricsStrangers {
		from := netip.AddrFrom4([4]byte{127, 3, 0, byte(1 + i)})
		hctx, hcancel := context.WithTimeout(ctx, time.Minute)
		err := holdConnection(hctx, h.JoinAddr, from, 0, nil)
		hcancel()
		if err != errClosedByService {
			t.Errorf("stranger %s: %v, want its connection closed by the service", from, err)
		}
	}

	// Scrapes during the storm: each must parse, and no gauge may leave its bounds.
	stormDone := make(chan struct{})
	var scrapes sync.WaitGroup
	var during []map[string]float64
	scrapes.Go(func() {
		for {
			select {
			case <-stormDone:
				return
			default:
			}
			m, err := scrapeMetrics(base)
			if err != nil {
				t.Errorf("scraping during the storm: %v", err)
				return
			}
			during = append(during, m)
		}
	})
	agents := h.Storm(ctx, h.AddWorkers(metricsStorm), bo, nil)
	close(stormDone)
	scrapes.Wait()
	for _, a := range agents {
		if a.Err != nil {
			t.Errorf("%s did not get its ticket: %v", a.Name, a.Err)
		}
	}
	maxServing := 0.0
	for _, m := range during {
		serving, waiting, slots := m[`berth_join_connections{state="serving"}`], m[`berth_join_connections{state="waiting"}`], m["berth_join_connection_slots"]
		if serving < 0 || waiting < 0 || serving > slots {
			t.Errorf("a scrape during the storm: %v serving, %v waiting, %v slots", serving, waiting, slots)
		}
		maxServing = max(maxServing, serving)
	}
	t.Logf("%d scrapes during the storm; at most %v connections served at once", len(during), maxServing)

	// What the agents saw: each ticket they received, each refusal they were told of.
	received, refusedMeasurements, otherRefusals := agentOutcomes(t, agentLog.String())
	after := scrape(t, base)
	issued := after[`berth_join_tickets_issued_total{call="join"}`]
	t.Logf("agents received %d tickets and were refused %d times for their measurements; the service counted %v issued",
		received, refusedMeasurements, issued)
	if received != metricsEarly+metricsStorm {
		t.Errorf("the agents logged %d tickets received, want one each: %d", received, metricsEarly+metricsStorm)
	}
	if issued != float64(received) {
		t.Errorf("berth_join_tickets_issued_total{call=\"join\"} = %v, the agents received %d", issued, received)
	}
	if got := after[`berth_join_exchange_duration_seconds_count{call="join",result="issued"}`]; got != issued {
		t.Errorf("the exchange latency histogram counts %v issued exchanges, the counter %v", got, issued)
	}
	if refusedMeasurements == 0 {
		t.Error("no agent was refused for its measurements before the policy was there")
	}
	if otherRefusals != 0 {
		t.Errorf("the agents were refused %d times for other reasons", otherRefusals)
	}
	var refusedTotal float64
	for _, reason := range joinservice.RefusalReasons {
		refusedTotal += after[`berth_join_tickets_refused_total{call="join",reason="`+reason+`"}`]
	}
	refusedTotal += after[`berth_join_tickets_refused_total{call="join",reason="other"}`]
	if got := after[`berth_join_tickets_refused_total{call="join",reason="measurements"}`]; got != float64(refusedMeasurements) || refusedTotal != got {
		t.Errorf("the service counted %v refusals for measurements (%v in all), the agents were told of %d",
			got, refusedTotal, refusedMeasurements)
	}
	if got := after[`berth_join_connections_refused_total{reason="not_admitted"}`]; got != metricsStrangers {
		t.Errorf("berth_join_connections_refused_total{reason=\"not_admitted\"} = %v, want the %d strangers' connections", got, metricsStrangers)
	}
	if got := after[`berth_api_requests_total{api="kubernetes",outcome="ok"}`]; got < issued {
		t.Errorf("%v Kubernetes requests answered, fewer than the %v tickets, each of which records a disk and a token", got, issued)
	}
	if after["berth_join_policy_loaded"] != 1 || after["berth_join_policy_images"] != 1 {
		t.Errorf("policy metrics after the policy loaded: loaded %v, images %v", after["berth_join_policy_loaded"], after["berth_join_policy_images"])
	}
	if after["berth_kubernetes_api_reachable"] != 1 {
		t.Errorf("berth_kubernetes_api_reachable = %v while /readyz is ready", after["berth_kubernetes_api_reachable"])
	}
	waitFor(t, "every connection to close", func() bool {
		m := scrape(t, base)
		return m[`berth_join_connections{state="serving"}`] == 0 && m[`berth_join_connections{state="waiting"}`] == 0
	})
	if t.Failed() {
		t.Logf("join service log, last lines:\n%s", tail(svc.Log(), 20))
	}
}

// agentOutcomes counts, in the agents' join client logs, the tickets received, the refusals for
// measurements, and every other refusal (a status the service refuses with, not a transport failure).
func agentOutcomes(t *testing.T, log string) (received, refusedMeasurements, otherRefusals int) {
	t.Helper()
	sc := bufio.NewScanner(strings.NewReader(log))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var line struct {
			Msg   string `json:"msg"`
			Error string `json:"error"`
		}
		if err := json.Unmarshal(sc.Bytes(), &line); err != nil {
			t.Fatalf("agent log line %q: %v", sc.Text(), err)
		}
		switch {
		case line.Msg == "join ticket received":
			received++
		case line.Msg != "requesting join ticket":
		case strings.Contains(line.Error, "measurements refused"):
			refusedMeasurements++
		case strings.Contains(line.Error, "code = PermissionDenied"), strings.Contains(line.Error, "code = InvalidArgument"),
			strings.Contains(line.Error, "code = Unauthenticated"), strings.Contains(line.Error, "code = FailedPrecondition"):
			otherRefusals++
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return received, refusedMeasurements, otherRefusals
}

func httpGet(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	return resp.StatusCode, string(body)
}

// scrape reads /metrics.
func scrape(t *testing.T, base string) map[string]float64 {
	t.Helper()
	m, err := scrapeMetrics(base)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// scrapeMetrics reads /metrics in Prometheus's text format: each sample by its name and labels as written.
func scrapeMetrics(base string) (map[string]float64, error) {
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("/metrics: %s: %s", resp.Status, body)
	}
	out := map[string]float64{}
	for line := range strings.SplitSeq(string(body), "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			return nil, fmt.Errorf("/metrics line %q has no value", line)
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			return nil, fmt.Errorf("/metrics line %q: %w", line, err)
		}
		out[line[:i]] = v
	}
	return out, nil
}

// waitFor polls cond until it holds, for at most a minute.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("waited a minute for %s", what)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
