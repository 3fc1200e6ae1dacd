package imds

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/test/clocktest"
)

var testUserData = metadata.UserData{
	ClusterName:   "prod",
	JoinEndpoints: []string{"join.prod.internal:9443"},
	JoinPort:      9443,
	JoinCAPin:     "sha256:" + strings.Repeat("ab", 32),
}

// equateAddr compares addresses by value (netip.Addr's fields are unexported).
var equateAddr = cmp.Comparer(func(a, b netip.Addr) bool { return a == b })

func userDataJSON(t testing.TB, ud metadata.UserData) []byte {
	t.Helper()
	b, err := json.Marshal(ud)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// fake is an IMDSv2 of the test's own: it issues numbered tokens, answers only requests with a token it
// issued and has not forgotten, and serves values by path under /latest/.
type fake struct {
	mu     sync.Mutex
	values map[string][]byte
	// status, when set for a path, is answered instead of the value, with the value as body.
	status map[string]int
	valid  map[string]bool
	issued int
	gets   int
}

func newFake(t testing.TB) *fake {
	return &fake{
		values: map[string][]byte{
			"meta-data/instance-id":                 []byte("i-0123456789abcdef0"),
			"meta-data/local-hostname":              []byte("ip-10-0-1-23.eu-west-1.compute.internal"),
			"meta-data/local-ipv4":                  []byte("10.0.1.23"),
			"meta-data/ami-id":                      []byte("ami-0a887e401f7654935"),
			"meta-data/placement/availability-zone": []byte("eu-west-1b"),
			"user-data":                             userDataJSON(t, testUserData),
		},
		status: map[string]int{},
		valid:  map[string]bool{},
	}
}

func (f *fake) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	path := strings.TrimPrefix(r.URL.Path, "/latest/")
	if path == "api/token" {
		if r.Method != http.MethodPut || r.Header.Get("X-aws-ec2-metadata-token-ttl-seconds") != "21600" {
			http.Error(w, "bad token request", http.StatusBadRequest)
			return
		}
		f.issued++
		token := fmt.Sprintf("AQAEAtoken-%d==", f.issued)
		f.valid[token] = true
		fmt.Fprint(w, token)
		return
	}
	f.gets++
	if !f.valid[r.Header.Get("X-aws-ec2-metadata-token")] {
		http.Error(w, "401 - Unauthorized", http.StatusUnauthorized)
		return
	}
	value, ok := f.values[path]
	if code := f.status[path]; code != 0 {
		w.WriteHeader(code)
		_, _ = w.Write(value)
		return
	}
	if !ok {
		http.NotFound(w, r)
		return
	}
	_, _ = w.Write(value)
}

// forget drops every token, as an IMDS that restarted.
func (f *fake) forget() {
	f.mu.Lock()
	defer f.mu.Unlock()
	clear(f.valid)
}

func (f *fake) counts() (issued, gets int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.issued, f.gets
}

func serve(t testing.TB, h http.Handler) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}

func wantSelf(role metadata.Role, ud metadata.UserData) *metadata.Self {
	return &metadata.Self{
		Instance: metadata.Instance{
			Name:      "ip-10-0-1-23.eu-west-1.compute.internal",
			Role:      role,
			Addresses: []netip.Addr{netip.MustParseAddr("10.0.1.23")},
			ImageID:   "ami-0a887e401f7654935",
			ID:        "i-0123456789abcdef0",
		},
		UserData:   ud,
		ProviderID: "aws:///eu-west-1b/i-0123456789abcdef0",
	}
}

func TestSelf(t *testing.T) {
	controlPlane := testUserData
	controlPlane.Role = metadata.RoleControlPlane
	noEndpoints := testUserData
	noEndpoints.JoinEndpoints = nil
	big := strings.Repeat("x", 1<<20)

	for _, tc := range []struct {
		name   string
		values map[string]string
		status map[string]int
		want   *metadata.Self
		// wantIs is the sentinel the error wraps, if any; wantErr are parts of its message.
		wantIs  error
		wantErr []string
	}{
		{name: "worker by default", want: wantSelf(metadata.RoleWorker, testUserData)},
		{
			name:   "control plane from user-data",
			values: map[string]string{"user-data": string(userDataJSON(t, controlPlane))},
			want:   wantSelf(metadata.RoleControlPlane, controlPlane),
		},
		{
			name:    "no user-data",
			values:  map[string]string{"user-data": ""},
			status:  map[string]int{"user-data": http.StatusNotFound},
			wantIs:  ErrNoUserData,
			wantErr: []string{"reading user-data from IMDS", "404", "berth_node_config's json as its user_data"},
		},
		{
			name:    "user-data not JSON",
			values:  map[string]string{"user-data": "1234,john,reboot,true"},
			wantIs:  ErrBadUserData,
			wantErr: []string{"reading user-data from IMDS", "decoding user-data"},
		},
		{
			name:    "user-data with an unknown field",
			values:  map[string]string{"user-data": `{"clusterName":"prod","joinPort":9443,"joinToken":"x"}`},
			wantIs:  ErrBadUserData,
			wantErr: []string{"unknown field"},
		},
		{
			name:    "user-data is the cloud-config",
			values:  map[string]string{"user-data": "#cloud-config\nwrite_files: []\n"},
			wantIs:  ErrBadUserData,
			wantErr: []string{"#cloud-config", "user_data is berth_node_config's json"},
		},
		{
			name:    "user-data encoded twice",
			values:  map[string]string{"user-data": base64.StdEncoding.EncodeToString(userDataJSON(t, testUserData))},
			wantIs:  ErrBadUserData,
			wantErr: []string{"encoded once too often"},
		},
		{
			name:    "user-data without join endpoints",
			values:  map[string]string{"user-data": string(userDataJSON(t, noEndpoints))},
			wantIs:  ErrBadUserData,
			wantErr: []string{"names no join endpoint"},
		},
		{
			name:    "host name not a node name",
			values:  map[string]string{"meta-data/local-hostname": "IP_10.Corp.Example"},
			wantErr: []string{"name from meta-data/local-hostname", `instance name "IP_10.Corp.Example" is not a DNS-1123 subdomain`},
		},
		{
			name:    "address not IPv4",
			values:  map[string]string{"meta-data/local-ipv4": "fd00::23"},
			wantErr: []string{`reading meta-data/local-ipv4 from IMDS: "fd00::23" is not an IPv4 address`},
		},
		{
			name:    "address multicast",
			values:  map[string]string{"meta-data/local-ipv4": "224.0.0.1"},
			wantErr: []string{"address from meta-data/local-ipv4", "multicast"},
		},
		{
			name:    "empty instance id",
			values:  map[string]string{"meta-data/instance-id": ""},
			wantErr: []string{"reading meta-data/instance-id from IMDS: the value is empty"},
		},
		{
			name:    "instance id with a newline",
			values:  map[string]string{"meta-data/instance-id": "i-0123\n"},
			wantErr: []string{"id from meta-data/instance-id", "control characters"},
		},
		{
			name:    "instance id not EC2's",
			values:  map[string]string{"meta-data/instance-id": "i-0123/../x"},
			wantErr: []string{`reading meta-data/instance-id from IMDS: "i-0123/../x" is not an EC2 instance id`},
		},
		{
			name:    "zone not a zone name",
			values:  map[string]string{"meta-data/placement/availability-zone": "eu-west-1b/../i-0"},
			wantErr: []string{`reading meta-data/placement/availability-zone from IMDS: "eu-west-1b/../i-0" is not an availability zone name`},
		},
		{
			name:   "Local Zone",
			values: map[string]string{"meta-data/placement/availability-zone": "us-east-1-bos-1a"},
			want: func() *metadata.Self {
				s := wantSelf(metadata.RoleWorker, testUserData)
				s.ProviderID = "aws:///us-east-1-bos-1a/i-0123456789abcdef0"
				return s
			}(),
		},
		{
			name:    "missing value",
			status:  map[string]int{"meta-data/ami-id": http.StatusNotFound},
			values:  map[string]string{"meta-data/ami-id": "<html>\n<title>404 - Not Found</title>\x1b</html>"},
			wantErr: []string{"reading meta-data/ami-id from IMDS: IMDS answered 404 Not Found: <html> <title>404 - Not Found</title> </html>"},
		},
		{
			name:    "server error, body cut short",
			status:  map[string]int{"meta-data/local-hostname": http.StatusInternalServerError},
			values:  map[string]string{"meta-data/local-hostname": big},
			wantErr: []string{"reading meta-data/local-hostname from IMDS: IMDS answered 500 Internal Server Error: xxx", "x…"},
		},
		{
			name:    "value of 1 MiB",
			values:  map[string]string{"meta-data/local-hostname": big},
			wantErr: []string{"reading meta-data/local-hostname from IMDS: IMDS answered with more than 65536 bytes"},
		},
		{
			name:    "user-data of 1 MiB",
			values:  map[string]string{"user-data": big},
			wantErr: []string{"reading user-data from IMDS: IMDS answered with more than 65536 bytes"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFake(t)
			for p, v := range tc.values {
				f.values[p] = []byte(v)
			}
			for p, code := range tc.status {
				f.status[p] = code
			}
			c := &Client{Endpoint: serve(t, f).URL}
			self, err := c.Self(context.Background())
			if len(tc.wantErr) == 0 {
				if err != nil {
					t.Fatalf("Self: %v", err)
				}
				if diff := cmp.Diff(tc.want, self, equateAddr); diff != "" {
					t.Fatalf("Self (-want +got):\n%s", diff)
				}
				return
			}
			if err == nil {
				t.Fatalf("Self succeeded with %+v, want an error", self)
			}
			if tc.wantIs != nil && !errors.Is(err, tc.wantIs) {
				t.Errorf("error %q does not wrap %q", err, tc.wantIs)
			}
			for _, want := range tc.wantErr {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not contain %q", err, want)
				}
			}
			if len(err.Error()) > 1000 {
				t.Errorf("error is %d bytes long, want the server's answer cut short", len(err.Error()))
			}
		})
	}
}

func TestTokenReusedUntilShortlyBeforeItsEnd(t *testing.T) {
	f := newFake(t)
	clk := clocktest.New(time.Date(2026, 11, 24, 12, 0, 0, 0, time.UTC))
	c := &Client{Endpoint: serve(t, f).URL, Now: clk.Now}

	for _, step := range []struct {
		advance    time.Duration
		wantIssued int
	}{
		{0, 1},
		{time.Hour, 1},
		{tokenTTL - tokenMargin - time.Hour - time.Second, 1},
		{time.Second, 2}, // a minute before the end: replaced
		{time.Minute, 2},
	} {
		clk.Advance(step.advance)
		if _, err := c.Self(context.Background()); err != nil {
			t.Fatalf("Self at %s: %v", clk.Now(), err)
		}
		if issued, _ := f.counts(); issued != step.wantIssued {
			t.Fatalf("at %s: IMDS issued %d tokens, want %d", clk.Now(), issued, step.wantIssued)
		}
	}
}

func TestUnauthorizedGetsOneNewToken(t *testing.T) {
	f := newFake(t)
	c := &Client{Endpoint: serve(t, f).URL}
	ctx := context.Background()
	if _, err := c.Self(ctx); err != nil {
		t.Fatal(err)
	}
	f.forget() // IMDS restarted: the cached token is unknown to it
	if _, err := c.Self(ctx); err != nil {
		t.Fatalf("Self after IMDS forgot the token: %v", err)
	}
	if issued, _ := f.counts(); issued != 2 {
		t.Fatalf("IMDS issued %d tokens, want 2: one, then one after the 401", issued)
	}
}

func TestUnauthorizedTwiceIsTokenRefused(t *testing.T) {
	var mu sync.Mutex
	var puts, gets int
	srv := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		if r.Method == http.MethodPut {
			puts++
			fmt.Fprintf(w, "token-%d", puts)
			return
		}
		gets++
		http.Error(w, "401 - Unauthorized", http.StatusUnauthorized)
	}))
	_, err := (&Client{Endpoint: srv.URL}).Self(context.Background())
	if !errors.Is(err, ErrTokenRefused) || !strings.Contains(err.Error(), "reading meta-data/instance-id from IMDS") ||
		!strings.Contains(err.Error(), "token it had just issued") {
		t.Fatalf("Self: %v, want ErrTokenRefused for a fresh token, naming the path", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if puts != 2 || gets != 2 {
		t.Fatalf("client made %d PUTs and %d GETs, want 2 and 2: one new token, one retry", puts, gets)
	}
}

func TestTokenRequestRefused(t *testing.T) {
	for _, tc := range []struct {
		name    string
		status  int
		body    string
		wantErr []string
	}{
		{"forbidden", http.StatusForbidden, "Forbidden", []string{"PUT /latest/api/token answered 403 Forbidden (Forbidden)", "HttpEndpoint", "HttpPutResponseHopLimit"}},
		{"unauthorized", http.StatusUnauthorized, "", []string{"answered 401 Unauthorized (no body)", "HttpPutResponseHopLimit"}},
		{"bad request", http.StatusBadRequest, "Bad Request", []string{"PUT /latest/api/token answered 400 Bad Request: Bad Request"}},
		{"token too long", http.StatusOK, strings.Repeat("A", 1<<20), []string{"longer than 512 bytes"}},
		{"token empty", http.StatusOK, "", []string{"empty or has characters a header cannot carry"}},
		{"token with a line break", http.StatusOK, "AQAE\r\nX-Injected: 1", []string{"empty or has characters a header cannot carry"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.Method != http.MethodPut {
					t.Errorf("client sent %s %s without a token", r.Method, r.URL.Path)
				}
				w.WriteHeader(tc.status)
				fmt.Fprint(w, tc.body)
			}))
			_, err := (&Client{Endpoint: srv.URL}).Self(context.Background())
			if !errors.Is(err, ErrTokenRefused) {
				t.Fatalf("Self: %v, want ErrTokenRefused", err)
			}
			for _, want := range tc.wantErr {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not contain %q", err, want)
				}
			}
		})
	}
}

func TestUnreachable(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	endpoint := "http://" + ln.Addr().String()
	ln.Close()
	_, err = (&Client{Endpoint: endpoint}).Self(context.Background())
	if !errors.Is(err, ErrUnreachable) || !strings.Contains(err.Error(), "no answer from "+endpoint) {
		t.Fatalf("Self: %v, want ErrUnreachable naming %s", err, endpoint)
	}
}

func TestEveryRequestHasATimeBound(t *testing.T) {
	// Far above a loopback request's time on a loaded machine, so that only the held request reaches it.
	const timeout = 2 * time.Second
	f := newFake(t)
	hangPut := make(chan struct{}, 1)
	hangGet := make(chan struct{}, 1)
	srv := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hang := hangGet
		if r.Method == http.MethodPut {
			hang = hangPut
		}
		select {
		case <-hang:
			<-r.Context().Done()
		default:
			f.ServeHTTP(w, r)
		}
	}))

	for _, tc := range []struct {
		name    string
		hang    chan struct{}
		wantErr []string
	}{
		{"token request", hangPut, []string{"no answer from " + srv.URL + " to PUT /latest/api/token within " + timeout.String(), "HttpPutResponseHopLimit"}},
		{"value request", hangGet, []string{"reading meta-data/instance-id from IMDS: IMDS unreachable: no answer from " + srv.URL + " within " + timeout.String()}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.hang <- struct{}{}
			// The HTTP client has no timeout of its own and the context no deadline: only the Client's bound ends the wait.
			c := &Client{Endpoint: srv.URL, HTTPClient: &http.Client{}, Timeout: timeout}
			start := time.Now()
			_, err := c.Self(context.Background())
			if elapsed := time.Since(start); elapsed > 10*timeout {
				t.Fatalf("Self took %s, want about %s", elapsed, timeout)
			}
			if !errors.Is(err, ErrUnreachable) || !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("Self: %v, want ErrUnreachable after the deadline", err)
			}
			for _, want := range tc.wantErr {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not contain %q", err, want)
				}
			}
		})
	}
}

func TestCallersCancellationIsNotUnreachable(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	srv := serve(t, http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
		cancel()
		<-r.Context().Done()
	}))
	_, err := (&Client{Endpoint: srv.URL}).Self(ctx)
	if !errors.Is(err, context.Canceled) || errors.Is(err, ErrUnreachable) {
		t.Fatalf("Self: %v, want the caller's cancellation and not ErrUnreachable", err)
	}
}

func TestRedirectNotFollowed(t *testing.T) {
	elsewhere := serve(t, http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
		t.Errorf("the client followed a redirect to %s with token %q", r.URL, r.Header.Get("X-aws-ec2-metadata-token"))
	}))
	f := newFake(t)
	srv := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet {
			http.Redirect(w, r, elsewhere.URL+r.URL.Path, http.StatusTemporaryRedirect)
			return
		}
		f.ServeHTTP(w, r)
	}))
	_, err := (&Client{Endpoint: srv.URL}).Self(context.Background())
	if err == nil || !strings.Contains(err.Error(), "IMDS answered 307 Temporary Redirect") {
		t.Fatalf("Self: %v, want the redirect as an error", err)
	}
}

func TestEndpointMustBeHTTP(t *testing.T) {
	for _, endpoint := range []string{"169.254.169.254", "file:///etc/passwd", "http://"} {
		_, err := (&Client{Endpoint: endpoint}).Self(context.Background())
		if err == nil || !strings.Contains(err.Error(), "is not an http URL with a host") {
			t.Errorf("Endpoint %q: Self: %v, want it refused", endpoint, err)
		}
	}
}

func TestConcurrentReadersShareOneToken(t *testing.T) {
	f := newFake(t)
	c := &Client{Endpoint: serve(t, f).URL}
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			if _, err := c.Self(context.Background()); err != nil {
				t.Errorf("Self: %v", err)
			}
		})
	}
	wg.Wait()
	if issued, _ := f.counts(); issued != 1 {
		t.Fatalf("IMDS issued %d tokens to 8 concurrent readers, want 1", issued)
	}
}
