package telemetry

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/berthlabs/berth/internal/cloud/apicalls"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/rpc"
	"github.com/berthlabs/berth/nodeagent/internal/kubecerts"
)

var testLabels = Labels{
	JoinCalls: []string{"join", "rejoin"}, JoinRefusals: []string{"measurements", "role"},
	JoinErrors: []string{"internal", "stream"}, InitResults: []string{"initialized", "refused"},
	BootSteps: []string{"tpm", "membership"}, Unlocks: []string{"tpm", "rejoin_ticket"}, LocalUnlockFallbacks: []string{"refused"}, Build: Build{Version: "v0.9.0", KubernetesVersion: "v1.36.3"},
}

// series is every sample of the registry as "name{label=value,...}" → value.
func series(t *testing.T, m *Metrics) map[string]float64 {
	t.Helper()
	families, err := m.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, f := range families {
		if !strings.HasPrefix(f.GetName(), "berth_") {
			continue
		}
		for _, s := range f.GetMetric() {
			var labels []string
			for _, l := range s.GetLabel() {
				labels = append(labels, l.GetName()+"="+l.GetValue())
			}
			out[f.GetName()+"{"+strings.Join(labels, ",")+"}"] = value(s)
		}
	}
	return out
}

func value(s *dto.Metric) float64 {
	switch {
	case s.Counter != nil:
		return s.Counter.GetValue()
	case s.Gauge != nil:
		return s.Gauge.GetValue()
	case s.Histogram != nil:
		return float64(s.Histogram.GetSampleCount())
	}
	return 0
}

// TestLabelsStayFixed: every series of the fixed lists exists at zero from the start, and a value outside a
// list (what a peer could make up) lands in "other" instead of making a series of its own.
func TestLabelsStayFixed(t *testing.T) {
	m := New(testLabels)
	before := series(t, m)
	for _, s := range []string{
		"berth_join_tickets_issued_total{call=rejoin}", "berth_join_tickets_refused_total{call=join,reason=role}",
		"berth_join_exchange_errors_total{call=join,kind=stream}", "berth_init_exchanges_total{result=refused}",
		"berth_api_requests_total{api=ec2,outcome=throttled}", "berth_join_exchange_duration_seconds{call=join,result=issued}",
	} {
		if v, ok := before[s]; !ok || v != 0 {
			t.Errorf("%s = %v (present %v), want 0 from the start", s, v, ok)
		}
	}
	m.TicketIssued("join", time.Millisecond)
	m.TicketRefused("join", "measurements", time.Millisecond)
	m.TicketRefused("join", "node-7\"}evil", time.Millisecond)
	m.TicketRefused("made-up-call", "role", time.Millisecond)
	m.ExchangeFailed("rejoin", "internal", time.Millisecond)
	m.InitExchange("initialized", time.Second)
	m.InitExchange("whatever", time.Second)
	m.Calls(APIKubernetes).Count(apicalls.Throttled)
	m.Calls("s3").Count("strange")
	after := series(t, m)
	if len(after) != len(before) {
		t.Errorf("%d series after odd label values, %d before: a value outside the lists made a series", len(after), len(before))
	}
	want := map[string]float64{
		"berth_join_tickets_issued_total{call=join}":                                  1,
		"berth_join_tickets_refused_total{call=join,reason=measurements}":             1,
		"berth_join_tickets_refused_total{call=join,reason=other}":                    1,
		"berth_join_tickets_refused_total{call=other,reason=role}":                    1,
		"berth_join_exchange_errors_total{call=rejoin,kind=internal}":                 1,
		"berth_join_exchange_duration_seconds{call=join,result=refused}":              2,
		"berth_join_exchange_duration_seconds{call=rejoin,result=error}":              1,
		"berth_init_exchanges_total{result=initialized}":                              1,
		"berth_init_exchanges_total{result=other}":                                    1,
		"berth_api_requests_total{api=kubernetes,outcome=throttled}":                  1,
		"berth_api_requests_total{api=other,outcome=error}":                           1,
		"berth_join_connections_refused_total{reason=" + rpc.RefusedNotAdmitted + "}": 0,
	}
	for s, v := range want {
		if after[s] != v {
			t.Errorf("%s = %v, want %v", s, after[s], v)
		}
	}
}

type fakeAdmission struct {
	refused                 map[string]int
	serving, waiting, slots int
}

func (f fakeAdmission) Refused() map[string]int { return f.refused }
func (f fakeAdmission) Connections() (int, int, int) {
	return f.serving, f.waiting, f.slots
}

// TestAdmissionRead: the connection metrics are the listener's counts at the scrape, an unknown refusal
// reason summed into "other".
func TestAdmissionRead(t *testing.T) {
	m := New(testLabels)
	m.WatchAdmission(fakeAdmission{refused: map[string]int{rpc.RefusedNotAdmitted: 7, rpc.RefusedAddressLimit: 2, "new_reason": 3},
		serving: 5, waiting: 9, slots: 64})
	got := series(t, m)
	for s, v := range map[string]float64{
		"berth_join_connections_refused_total{reason=not_admitted}":  7,
		"berth_join_connections_refused_total{reason=address_limit}": 2,
		"berth_join_connections_refused_total{reason=other}":         3,
		"berth_join_connections{state=serving}":                      5,
		"berth_join_connections{state=waiting}":                      9,
		"berth_join_connection_slots{}":                              64,
	} {
		if got[s] != v {
			t.Errorf("%s = %v, want %v", s, got[s], v)
		}
	}
}

// TestPolicyVersionOneSeries: a new policy replaces the version series instead of adding one.
func TestPolicyVersionOneSeries(t *testing.T) {
	m := New(testLabels)
	m.PolicyLoaded(2, "aaaaaaaaaaaa", time.Unix(100, 0))
	m.PolicyLoaded(3, "bbbbbbbbbbbb", time.Unix(200, 0))
	got := series(t, m)
	if _, ok := got["berth_join_policy_info{version=aaaaaaaaaaaa}"]; ok {
		t.Error("the old policy's version series is still there")
	}
	for s, v := range map[string]float64{
		"berth_join_policy_info{version=bbbbbbbbbbbb}": 1, "berth_join_policy_images{}": 3,
		"berth_join_policy_loads_total{}": 2, "berth_join_policy_loaded{}": 1, "berth_join_policy_last_load_timestamp_seconds{}": 200,
	} {
		if got[s] != v {
			t.Errorf("%s = %v, want %v", s, got[s], v)
		}
	}
}

// TestBootAndBuild: the step in progress is the only one at 1, each finished step has its duration, the
// finish time is set at the end, and the build is named; nil metrics (no metricsListen) take the calls too.
func TestBootAndBuild(t *testing.T) {
	m := New(testLabels)
	step := func(name string) float64 { return series(t, m)["berth_boot_step{step="+name+"}"] }
	if step("tpm") != 0 || step("membership") != 0 || series(t, m)["berth_boot_step_duration_seconds{step=membership}"] != 0 {
		t.Error("a step is shown before the boot started")
	}
	m.BootStepStarted("tpm")
	if step("tpm") != 1 || step("membership") != 0 {
		t.Errorf("in tpm: tpm %v, membership %v", step("tpm"), step("membership"))
	}
	m.BootStepDone("tpm", time.Second)
	m.BootStepStarted("membership")
	if step("tpm") != 0 || step("membership") != 1 {
		t.Errorf("in membership: tpm %v, membership %v", step("tpm"), step("membership"))
	}
	m.BootStepDone("membership", 12*time.Minute)
	m.BootFinished(time.Unix(300, 0))
	got := series(t, m)
	for s, v := range map[string]float64{
		"berth_boot_step{step=membership}": 0, "berth_boot_step_duration_seconds{step=tpm}": 1,
		"berth_boot_step_duration_seconds{step=membership}": 1, "berth_boot_finished_timestamp_seconds{}": 300,
		"berth_build_info{go_version=" + runtime.Version() + ",kubernetes_version=v1.36.3,version=v0.9.0}": 1,
	} {
		if got[s] != v {
			t.Errorf("%s = %v, want %v", s, got[s], v)
		}
	}
	var none *Metrics
	none.BootStepStarted("tpm")
	none.BootStepDone("tpm", time.Second)
	none.BootFinished(time.Now())
}

// TestUnlockAndSeal: how each boot opened its disk, why the TPM did not, each seal's and each certificate
// renewal's outcome are counted under their fixed labels; a seal's success sets its time, a failure leaves it; nil metrics take the calls.
func TestUnlockAndSeal(t *testing.T) {
	m := New(testLabels)
	m.StateDiskUnlocked("tpm", 2*time.Second)
	m.StateDiskUnlocked("made-up", time.Second)
	m.LocalUnlockFellBack("refused")
	m.Sealed(nil, time.Second, time.Unix(200, 0))
	m.Sealed(errors.New("TPM busy"), time.Second, time.Unix(400, 0))
	m.CertificatesRenewed(errors.New("kubeadm failed"))
	got := series(t, m)
	for s, v := range map[string]float64{
		"berth_state_disk_unlock_duration_seconds{via=tpm}": 1, "berth_state_disk_unlock_duration_seconds{via=rejoin_ticket}": 0,
		"berth_state_disk_unlock_duration_seconds{via=other}": 1, "berth_local_unlock_fallbacks_total{reason=refused}": 1,
		"berth_local_unlock_fallbacks_total{reason=other}": 0, "berth_seals_total{result=ok}": 1, "berth_seals_total{result=error}": 1,
		"berth_seal_duration_seconds{}": 2, "berth_seal_last_success_timestamp_seconds{}": 200,
		"berth_certificate_renewals_total{result=error}": 1, "berth_certificate_renewals_total{result=ok}": 0,
	} {
		if got[s] != v {
			t.Errorf("%s = %v, want %v", s, got[s], v)
		}
	}
	var none *Metrics
	none.StateDiskUnlocked("tpm", time.Second)
	none.LocalUnlockFellBack("refused")
	none.Sealed(nil, time.Second, time.Now())
	none.CertificatesRenewed(nil)
}

// TestCertificateExpiry: each certificate's expiry is read again at each scrape, so a renewal on disk shows
// at once; an absent file has no series, and an unreadable one has none and is logged once.
func TestCertificateExpiry(t *testing.T) {
	dir := t.TempDir()
	end := time.Date(2027, 11, 28, 10, 0, 0, 0, time.UTC)
	write := func(name string, notAfter time.Time) string {
		ca, err := pki.NewCA("test", notAfter.Add(-time.Hour), time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, ca.CertPEM(), 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	garbage := filepath.Join(dir, "garbage.crt")
	if err := os.WriteFile(garbage, []byte("{"), 0o600); err != nil {
		t.Fatal(err)
	}
	var logs bytes.Buffer
	m := New(testLabels)
	m.WatchCertificates([]kubecerts.File{{Name: "apiserver", Path: write("apiserver.crt", end)},
		{Name: "absent", Path: filepath.Join(dir, "absent.crt")}, {Name: "garbage", Path: garbage}},
		slog.New(slog.NewTextHandler(&logs, nil)))
	check := func(want time.Time) {
		t.Helper()
		var got []string
		for s, v := range series(t, m) {
			if strings.HasPrefix(s, "berth_certificate_expiry_timestamp_seconds") {
				got = append(got, fmt.Sprintf("%s %v", s, time.Unix(int64(v), 0).UTC()))
			}
		}
		if want := []string{fmt.Sprintf("berth_certificate_expiry_timestamp_seconds{certificate=apiserver} %v", want)}; !slices.Equal(got, want) {
			t.Errorf("series %q, want %q", got, want)
		}
	}
	check(end)
	check(end)
	if n := strings.Count(logs.String(), "certificate=garbage"); n != 1 || strings.Contains(logs.String(), "absent") {
		t.Errorf("logged over two scrapes (want the garbage once, nothing of the absent file):\n%s", logs.String())
	}
	write("apiserver.crt", end.AddDate(1, 0, 0))
	check(end.AddDate(1, 0, 0))
}

// TestHistogramsCoverTheirTimeouts: an init may take berth_cluster's init_timeout (15 minutes by default) and a
// boot may wait an hour for its operator; each must land in a bucket below +Inf, or the quantiles of the
// slowest cases, the ones alerts are about, are unknown.
func TestHistogramsCoverTheirTimeouts(t *testing.T) {
	for name, c := range map[string]struct {
		buckets []float64
		longest time.Duration
	}{
		"init": {initBuckets, 15 * time.Minute}, "join": {exchangeBuckets, 30 * time.Second}, "boot": {bootBuckets, time.Hour},
		"seal": {sealBuckets, 30 * time.Second},
	} {
		if top := c.buckets[len(c.buckets)-1]; top < c.longest.Seconds() {
			t.Errorf("%s buckets end at %vs, below the %v they must cover", name, top, c.longest)
		}
	}
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(body)
}

// TestReadiness: /readyz is 503 before any check is added (no join service yet) and while a check fails,
// naming it, and 200 once all pass; /healthz is 200 throughout; /metrics serves the registry.
func TestReadiness(t *testing.T) {
	m := New(testLabels)
	s := NewServer(m, nil)
	srv := httptest.NewServer(s.Handler())
	t.Cleanup(srv.Close)
	if code, _ := get(t, srv.URL+"/readyz"); code != http.StatusServiceUnavailable {
		t.Errorf("/readyz without checks: %d, want 503", code)
	}
	policyErr := errors.New("no join policy loaded yet")
	s.AddCheck("policy", func() error { return policyErr })
	s.AddCheck("kubernetes-api", func() error { return nil })
	if code, body := get(t, srv.URL+"/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "policy: no join policy") {
		t.Errorf("/readyz with a failing check: %d %q, want 503 naming the policy", code, body)
	}
	policyErr = nil
	if code, body := get(t, srv.URL+"/readyz"); code != http.StatusOK {
		t.Errorf("/readyz with every check passing: %d %q", code, body)
	}
	if code, _ := get(t, srv.URL+"/healthz"); code != http.StatusOK {
		t.Errorf("/healthz: %d", code)
	}
	if code, body := get(t, srv.URL+"/metrics"); code != http.StatusOK || !strings.Contains(body, "berth_join_tickets_issued_total") {
		t.Errorf("/metrics: %d, body without berth_join_tickets_issued_total", code)
	}
	resp, err := http.Post(srv.URL+"/metrics", "text/plain", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("POST /metrics: %d, want 405", resp.StatusCode)
	}
}

// TestServeBounds: a request whose headers exceed the bound is refused, and Serve returns once its context
// ends.
func TestServeBounds(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- NewServer(New(testLabels), nil).Serve(ctx, lis) }()
	req, err := http.NewRequest(http.MethodGet, "http://"+lis.Addr().String()+"/healthz", nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("X-Filler", strings.Repeat("a", 2*maxHeaderBytes))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
		t.Errorf("a request with %d bytes of headers: %d, want 431", 2*maxHeaderBytes, resp.StatusCode)
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Serve after its context ended: %v", err)
	}
}

// TestProbe: a probe keeps the last result of its check, which runs in the background.
func TestProbe(t *testing.T) {
	results := make(chan error)
	told := make(chan error)
	p := StartProbe(t.Context(), time.Millisecond, time.Second, func(context.Context) error { return <-results },
		func(err error) { told <- err })
	if p.Err() == nil {
		t.Error("a probe that has not run yet passes")
	}
	down := errors.New("connection refused")
	results <- down
	<-told
	if !errors.Is(p.Err(), down) {
		t.Errorf("after a failed check: %v", p.Err())
	}
	results <- nil
	<-told
	if p.Err() != nil {
		t.Errorf("after a passing check: %v", p.Err())
	}
}

type countedOutcomes map[apicalls.Outcome]int

func (c countedOutcomes) Count(o apicalls.Outcome) { c[o]++ }

// TestKubernetesRequests: client-go's request results reach the counter set last, classified.
func TestKubernetesRequests(t *testing.T) {
	first, second := countedOutcomes{}, countedOutcomes{}
	CountKubernetesRequests(first)
	CountKubernetesRequests(second)
	for _, code := range []string{"200", "201", "404", "409", "429", "500", "403", "<error>"} {
		kubeResult{}.Increment(t.Context(), code, "GET", "api")
	}
	if len(first) != 0 {
		t.Errorf("the replaced counter got %v", first)
	}
	want := countedOutcomes{apicalls.OK: 4, apicalls.Throttled: 1, apicalls.Error: 3}
	for o, n := range want {
		if second[o] != n {
			t.Errorf("%s: %d, want %d (all: %v)", o, second[o], n, second)
		}
	}
}

// TestServeBoundsConnections: one address holding thousands of idle connections gets maxConnsPerAddress of
// them served, the rest closed at once, and /readyz still answers another address.
func TestServeBoundsConnections(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := NewServer(New(testLabels), nil)
	srv.AddCheck("join service", func() error { return nil })
	go srv.Serve(t.Context(), lis)
	addr := lis.Addr().String()

	const flood = 3000
	var held []net.Conn
	t.Cleanup(func() {
		for _, c := range held {
			c.Close()
		}
	})
	for range flood {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
	}
	open := 0
	for _, c := range held {
		c.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
		if _, err := c.Read(make([]byte, 1)); errors.Is(err, os.ErrDeadlineExceeded) {
			open++
		}
	}
	if open != maxConnsPerAddress {
		t.Errorf("the server kept %d of one address's %d connections open, want %d", open, flood, maxConnsPerAddress)
	}

	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.2")}}
	client := &http.Client{Transport: &http.Transport{DialContext: d.DialContext}, Timeout: 5 * time.Second}
	resp, err := client.Get("http://" + addr + "/readyz")
	if err != nil {
		t.Fatalf("/readyz while one address floods the port: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("/readyz while one address floods the port: %d", resp.StatusCode)
	}
}

// TestLimitListenerTotal: past the total, connections from any address are closed until one is given back.
func TestLimitListenerTotal(t *testing.T) {
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := newLimitListener(inner, 2, 3, slog.New(slog.DiscardHandler))
	defer l.Close()
	dial := func(from string) net.Conn {
		d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}}
		c, err := d.Dial("tcp", inner.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	accepted := make(chan net.Conn, 8)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			accepted <- c
		}
	}()
	var first net.Conn
	for i, from := range []string{"127.0.0.11", "127.0.0.12", "127.0.0.13"} {
		dial(from)
		c := <-accepted
		if i == 0 {
			first = c
		}
	}
	if c := dial("127.0.0.14"); !closedSoon(c) {
		t.Error("a fourth connection past a total of 3 was kept")
	}
	if got := l.refused.Load(); got != 1 {
		t.Errorf("%d refusals counted, want 1", got)
	}
	first.Close()
	dial("127.0.0.14")
	select {
	case <-accepted:
	case <-time.After(5 * time.Second):
		t.Error("no connection accepted after one was given back")
	}
}

// closedSoon reports whether the peer closes c within a second.
func closedSoon(c net.Conn) bool {
	c.SetReadDeadline(time.Now().Add(time.Second))
	_, err := c.Read(make([]byte, 1))
	return errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET)
}
