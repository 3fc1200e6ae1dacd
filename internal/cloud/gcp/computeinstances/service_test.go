package computeinstances

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"sync"
	"testing"

	"golang.org/x/oauth2"
	compute "google.golang.org/api/compute/v1"
	"google.golang.org/api/option"

	"github.com/berthlabs/berth/internal/cloud/apicalls"
	"github.com/berthlabs/berth/internal/cloud/gcp/computeinstances/computetest"
	"github.com/berthlabs/berth/internal/metadata"
)

var testTS = oauth2.StaticTokenSource(&oauth2.Token{AccessToken: testToken})

func TestNewService(t *testing.T) {
	srv := newServer(t)
	put(t, srv, node("berth-workers-a", zoneB, workGroup, "10.0.2.10"))

	// The endpoint as the server's root, as the API's base with and without the last slash: each reaches
	// /compute/v1/ (the server answers nothing else).
	for _, endpoint := range []string{srv.URL, srv.Endpoint, strings.TrimSuffix(srv.Endpoint, "/")} {
		svc, err := NewService(t.Context(), endpoint, testTS, testLogger(t), nil)
		if err != nil {
			t.Fatalf("NewService(%q): %v", endpoint, err)
		}
		l, err := New(Config{Service: svc, Project: project, Network: network, Groups: testGroups})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := lookup(t, l, "10.0.2.10"); err != nil {
			t.Errorf("lookup through NewService(%q): %v", endpoint, err)
		}
	}

	// Why the last slash matters: Google's client resolves paths against its endpoint as a URL reference,
	// so "…/compute/v1" loses its last segment.
	raw, err := compute.NewService(t.Context(), option.WithEndpoint(strings.TrimSuffix(srv.Endpoint, "/")),
		option.WithTokenSource(testTS))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := raw.Instances.AggregatedList(project).Context(t.Context()).Do(); err == nil {
		t.Error("Google's client with an endpoint without its last slash reached the API: the normalization is not needed")
	}

	for _, tc := range []struct{ endpoint, want string }{
		{"http://compute.example.com", "plain http"},
		{"http://10.250.0.1:8080", "plain http"},
		{"ftp://127.0.0.1", "not https"},
		{"https://user:pw@compute.example.com", "scheme://host"},
		{"https://compute.example.com/?x=1", "scheme://host"},
		{"127.0.0.1:443", ""},
		{"compute.googleapis.com", "scheme://host"},
	} {
		_, err := NewService(t.Context(), tc.endpoint, testTS, nil, nil)
		if err == nil || tc.want != "" && !strings.Contains(err.Error(), tc.want) {
			t.Errorf("NewService(%q): %v, want an error saying %q", tc.endpoint, err, tc.want)
		}
	}
	if _, err := NewService(t.Context(), "", nil, nil, nil); err == nil || !strings.Contains(err.Error(), "token source") {
		t.Errorf("NewService without a token source: %v", err)
	}
	svc, err := NewService(t.Context(), "", testTS, nil, nil)
	if err != nil || svc.BasePath != "https://compute.googleapis.com/compute/v1/" {
		t.Errorf("NewService without an endpoint: base %q, %v", svc.BasePath, err)
	}
}

func TestCheckEndpoint(t *testing.T) {
	for in, want := range map[string]string{
		"https://compute.googleapis.com":                    "https://compute.googleapis.com/compute/v1/",
		"https://compute.googleapis.com/":                   "https://compute.googleapis.com/compute/v1/",
		"https://compute-berth.p.googleapis.com/compute/v1": "https://compute-berth.p.googleapis.com/compute/v1/",
		"http://127.0.0.1:8080/compute/v1/":                 "http://127.0.0.1:8080/compute/v1/",
		"http://localhost:8080":                             "http://localhost:8080/compute/v1/",
		"http://[::1]:8080":                                 "http://[::1]:8080/compute/v1/",
	} {
		got, err := checkEndpoint(in)
		if err != nil || got != want {
			t.Errorf("checkEndpoint(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
}

// TestTLS: an https endpoint whose CA is trusted answers; one whose CA is not is refused at once, and the
// refusal is not retried.
func TestTLS(t *testing.T) {
	srv := computetest.NewWithOptions(t, computetest.Options{TLS: true, Token: testToken})
	put(t, srv, node("berth-workers-a", zoneB, workGroup, "10.0.2.10"))
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(srv.CACertPEM) {
		t.Fatal("the endpoint's CA does not parse")
	}
	tc := fastTransport
	tc.rootCAs = roots
	svc, err := newService(t.Context(), srv.URL, testTS, testLogger(t), tc)
	if err != nil {
		t.Fatal(err)
	}
	l, err := New(Config{Service: svc, Project: project, Network: network, Groups: testGroups})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lookup(t, l, "10.0.2.10"); err != nil {
		t.Fatalf("lookup over TLS: %v", err)
	}

	untrusted, err := newService(t.Context(), srv.URL, testTS, testLogger(t), fastTransport)
	if err != nil {
		t.Fatal(err)
	}
	l, err = New(Config{Service: untrusted, Project: project, Network: network, Groups: testGroups})
	if err != nil {
		t.Fatal(err)
	}
	_, err = lookup(t, l, "10.0.2.10")
	var certErr *tls.CertificateVerificationError
	if !errors.As(err, &certErr) || errors.Is(err, metadata.ErrNotFound) {
		t.Fatalf("lookup against an untrusted certificate: %v, want a certificate verification error", err)
	}
	if why := (&retryTransport{}).retryReason(t.Context(), nil, err); why != "" {
		t.Errorf("a certificate refusal would be retried (%s)", why)
	}
}

// TestResponseBound: an answer larger than the bound is refused, whether it says its length or not.
func TestResponseBound(t *testing.T) {
	const limit = 64 << 10
	huge := `{"kind":"compute#instanceAggregatedList","items":{},"padding":"` + strings.Repeat("x", 4*limit) + `"}`
	endpoint := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		if r.Header.Get("X-Chunked") == "" {
			w.Header().Set("Content-Length", fmt.Sprint(len(huge)))
			_, _ = w.Write([]byte(huge))
			return
		}
		// Flushed before the end: sent chunked, without a length.
		_, _ = w.Write([]byte(huge[:len(huge)/2]))
		w.(http.Flusher).Flush()
		_, _ = w.Write([]byte(huge[len(huge)/2:]))
	}))
	t.Cleanup(endpoint.Close)
	tc := fastTransport
	tc.maxBody = limit
	svc, err := newService(t.Context(), endpoint.URL, testTS, testLogger(t), tc)
	if err != nil {
		t.Fatal(err)
	}
	for _, how := range []string{"with Content-Length", "chunked"} {
		t.Run(how, func(t *testing.T) {
			call := svc.Instances.AggregatedList(project).Context(t.Context())
			if how == "chunked" {
				call.Header().Set("X-Chunked", "1")
			}
			_, err := call.Do()
			if !errors.Is(err, errResponseTooLarge) {
				t.Errorf("answer of %d bytes with a bound of %d: %v, want errResponseTooLarge", len(huge), limit, err)
			}
		})
	}
	// Within the bound, the same client reads answers whole.
	small := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write([]byte(`{"kind":"compute#instanceAggregatedList","items":{"zones/europe-west1-b":{"instances":[{"id":"7","name":"a"}]}}}`))
	}))
	t.Cleanup(small.Close)
	svc, err = newService(t.Context(), small.URL, testTS, testLogger(t), tc)
	if err != nil {
		t.Fatal(err)
	}
	out, err := svc.Instances.AggregatedList(project).Context(t.Context()).Do()
	if err != nil || out.Items["zones/europe-west1-b"].Instances[0].Id != 7 {
		t.Errorf("small answer: %+v, %v", out, err)
	}
}

// TestNoRetryOfWrites: only reads are retried; a POST that is not listManagedInstances is sent once.
func TestNoRetryOfWrites(t *testing.T) {
	var calls int
	endpoint := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls++
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = w.Write([]byte(`{"error":{"code":503,"message":"Internal error.","errors":[{"domain":"global","reason":"backendError"}]}}`))
	}))
	t.Cleanup(endpoint.Close)
	svc, err := newService(t.Context(), endpoint.URL, testTS, testLogger(t), fastTransport)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := svc.Instances.Stop(project, zoneB, "berth-workers-a").Context(t.Context()).Do(); err == nil {
		t.Fatal("stop succeeded against an endpoint that fails everything")
	}
	if calls != 1 {
		t.Errorf("instances.stop sent %d times, want once", calls)
	}
	calls = 0
	if _, err := svc.InstanceGroupManagers.ListManagedInstances(project, zoneB, "berth-workers").Context(t.Context()).Do(); err == nil {
		t.Fatal("listManagedInstances succeeded against an endpoint that fails everything")
	}
	if calls != maxAttempts {
		t.Errorf("listManagedInstances sent %d times, want %d", calls, maxAttempts)
	}
}

// TestNoRedirect: a redirect is an error, and the token never goes where it points.
func TestNoRedirect(t *testing.T) {
	var leaked []string
	var mu sync.Mutex
	elsewhere := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		leaked = append(leaked, r.Header.Get("Authorization"))
		mu.Unlock()
		_, _ = w.Write([]byte(`{"kind":"compute#instanceAggregatedList"}`))
	}))
	t.Cleanup(elsewhere.Close)
	endpoint := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, elsewhere.URL+r.URL.Path, http.StatusFound)
	}))
	t.Cleanup(endpoint.Close)
	svc, err := newService(t.Context(), endpoint.URL, testTS, testLogger(t), fastTransport)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := svc.Instances.AggregatedList(project).Context(t.Context()).Do(); err == nil {
		t.Error("a redirect was followed to an answer")
	}
	mu.Lock()
	defer mu.Unlock()
	if len(leaked) > 0 {
		t.Errorf("the redirect's target got %d requests, with Authorization %q", len(leaked), leaked)
	}
}

// TestThrottleReason: a 403 is retried only for the rate-limit reasons; its body reaches Google's client
// whole either way.
func TestThrottleReason(t *testing.T) {
	for _, tc := range []struct {
		body string
		want string
	}{
		{`{"error":{"code":403,"errors":[{"domain":"usageLimits","reason":"rateLimitExceeded"}]}}`, "rateLimitExceeded"},
		{`{"error":{"code":403,"errors":[{"domain":"usageLimits","reason":"userRateLimitExceeded"}]}}`, "userRateLimitExceeded"},
		{`{"error":{"code":403,"errors":[{"domain":"global","reason":"forbidden"}]}}`, ""},
		{`{"error":{"code":403,"errors":[{"domain":"usageLimits","reason":"quotaExceeded"}]}}`, ""},
		{`not json`, ""},
	} {
		if got := throttleReason([]byte(tc.body)); got != tc.want {
			t.Errorf("throttleReason(%s) = %q, want %q", tc.body, got, tc.want)
		}
	}

	// A long refusal is put back whole after the sniff.
	long := `{"error":{"code":403,"message":"` + strings.Repeat("m", 2*maxErrorSniff) + `","errors":[{"domain":"global","reason":"forbidden"}]}}`
	endpoint := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusForbidden)
		_, _ = w.Write([]byte(long))
	}))
	t.Cleanup(endpoint.Close)
	svc, err := newService(t.Context(), endpoint.URL, testTS, testLogger(t), fastTransport)
	if err != nil {
		t.Fatal(err)
	}
	_, err = svc.Instances.AggregatedList(project).Context(t.Context()).Do()
	ae, ok := apiError(methodAggregatedList, err).(*APIError)
	if !ok || ae.Reason != "forbidden" || len(ae.Message) > 300 {
		t.Errorf("long refusal: %v", err)
	}
}

// TestAddressNormalized: IPv4-mapped IPv6 addresses are looked up as their IPv4 address.
func TestAddressNormalized(t *testing.T) {
	srv := newServer(t)
	put(t, srv, node("berth-workers-a", zoneB, workGroup, "10.0.2.10"))
	l := newLookup(t, srv, nil)
	if _, err := l.InstanceByAddress(t.Context(), netip.MustParseAddr("::ffff:10.0.2.10")); err != nil {
		t.Errorf("IPv4-mapped address: %v", err)
	}
}

// outcomes counts what an apicalls.Counter is told.
type outcomes struct {
	mu sync.Mutex
	n  map[apicalls.Outcome]int
}

func (o *outcomes) Count(out apicalls.Outcome) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.n == nil {
		o.n = map[apicalls.Outcome]int{}
	}
	o.n[out]++
}

// TestCallsCounted: every attempt is counted, the retried ones included, and throttling (429, a 403 with a
// rate-limit reason) is told apart from errors (a 403 refusal, a 404, a 5xx).
func TestCallsCounted(t *testing.T) {
	answers := []struct {
		code int
		body string
	}{
		{http.StatusTooManyRequests, `{"error":{"code":429,"errors":[{"reason":"rateLimitExceeded"}]}}`},
		{http.StatusForbidden, `{"error":{"code":403,"errors":[{"domain":"usageLimits","reason":"rateLimitExceeded"}]}}`},
		{http.StatusServiceUnavailable, `{"error":{"code":503,"errors":[{"reason":"backendError"}]}}`},
		{http.StatusOK, `{"kind":"compute#instanceAggregatedList"}`},
		{http.StatusNotFound, `{"error":{"code":404,"errors":[{"reason":"notFound"}]}}`},
		{http.StatusForbidden, `{"error":{"code":403,"errors":[{"domain":"global","reason":"forbidden"}]}}`},
	}
	var mu sync.Mutex
	next := 0
	endpoint := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		a := answers[min(next, len(answers)-1)]
		next++
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(a.code)
		_, _ = w.Write([]byte(a.body))
	}))
	t.Cleanup(endpoint.Close)
	counted := &outcomes{}
	tc := fastTransport
	tc.calls = counted
	svc, err := newService(t.Context(), endpoint.URL, testTS, testLogger(t), tc)
	if err != nil {
		t.Fatal(err)
	}
	// One call, four attempts: throttled twice, a 503, then the answer.
	if _, err := svc.Instances.AggregatedList(project).Context(t.Context()).Do(); err != nil {
		t.Fatalf("aggregatedList after two throttled attempts and a 503: %v", err)
	}
	// A 404 and a refusal are final answers, each one attempt.
	for range 2 {
		if _, err := svc.Instances.GetShieldedInstanceIdentity(project, zoneB, "gone").Context(t.Context()).Do(); err == nil {
			t.Fatal("getShieldedInstanceIdentity succeeded against a 404 or a 403")
		}
	}
	want := map[apicalls.Outcome]int{apicalls.Throttled: 2, apicalls.Error: 3, apicalls.OK: 1}
	if !maps.Equal(counted.n, want) {
		t.Errorf("attempts counted %v, want %v", counted.n, want)
	}
}
