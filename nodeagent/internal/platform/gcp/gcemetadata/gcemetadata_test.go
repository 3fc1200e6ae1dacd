package gcemetadata

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
	"golang.org/x/oauth2"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/test/clocktest"
	"github.com/berthlabs/berth/test/gcemetadatatest"
)

var testUserData = metadata.UserData{
	ClusterName:   "prod",
	JoinEndpoints: []string{"10.132.0.2:9443"},
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

// testInstance is gcemetadatatest's example instance, a worker, with testUserData as its node config.
func testInstance(t testing.TB) gcemetadatatest.Instance {
	inst := gcemetadatatest.Example()
	inst.NodeConfig = userDataJSON(t, testUserData)
	return inst
}

func wantSelf(role metadata.Role, ud metadata.UserData) *metadata.Self {
	return &metadata.Self{
		Instance: metadata.Instance{
			Name:      "berth-workers-7x2k",
			Role:      role,
			Addresses: []netip.Addr{netip.MustParseAddr("10.132.0.7")},
			ImageID:   "projects/berth-prod/global/images/berth-node-1-2-0",
			ID:        "projects/berth-prod/zones/europe-west1-b/instances/4520818434431224105",
		},
		UserData:   ud,
		ProviderID: "gce://berth-prod/europe-west1-b/berth-workers-7x2k",
	}
}

func TestNodeConfigKeyIsTheTestServers(t *testing.T) {
	if NodeConfigKey != gcemetadatatest.NodeConfigKey {
		t.Fatalf("NodeConfigKey = %q, the test server serves %q", NodeConfigKey, gcemetadatatest.NodeConfigKey)
	}
}

func TestSelf(t *testing.T) {
	controlPlane := testUserData
	controlPlane.Role = metadata.RoleControlPlane
	noEndpoints := testUserData
	noEndpoints.JoinEndpoints = nil
	big := strings.Repeat("x", 1<<20)
	withoutImage := wantSelf(metadata.RoleWorker, testUserData)
	withoutImage.Instance.ImageID = ""

	for _, tc := range []struct {
		name   string
		faults map[string]gcemetadatatest.Fault
		// nodeConfig replaces the attribute when set; noNodeConfig removes it.
		nodeConfig   string
		noNodeConfig bool
		want         *metadata.Self
		// wantIs is the sentinel the error wraps, if any; wantErr are parts of its message.
		wantIs  error
		wantErr []string
	}{
		{name: "worker by default", want: wantSelf(metadata.RoleWorker, testUserData)},
		{
			name:       "control plane from user-data",
			nodeConfig: string(userDataJSON(t, controlPlane)),
			want:       wantSelf(metadata.RoleControlPlane, controlPlane),
		},
		{
			name:   "no image",
			faults: map[string]gcemetadatatest.Fault{pathImage: {Status: http.StatusNotFound}},
			want:   withoutImage,
		},
		{
			name:   "empty image",
			faults: map[string]gcemetadatatest.Fault{pathImage: {Body: []byte{}}},
			want:   withoutImage,
		},
		{
			name:         "no node config",
			noNodeConfig: true,
			wantIs:       ErrNoUserData,
			wantErr:      []string{"reading instance/attributes/berth-node-config from the GCE metadata server", "give the instance template the metadata berth-node-config"},
		},
		{
			name:       "node config not JSON",
			nodeConfig: "1234,john,reboot,true",
			wantIs:     ErrBadUserData,
			wantErr:    []string{"reading instance/attributes/berth-node-config", "decoding user-data"},
		},
		{
			name:       "node config with an unknown field",
			nodeConfig: `{"clusterName":"prod","joinPort":9443,"joinToken":"x"}`,
			wantIs:     ErrBadUserData,
			wantErr:    []string{"unknown field"},
		},
		{
			name:       "node config is the cloud-config",
			nodeConfig: "#cloud-config\nwrite_files: []\n",
			wantIs:     ErrBadUserData,
			wantErr:    []string{"#cloud-config", "metadata berth-node-config is berth_node_config's json"},
		},
		{
			name:       "node config is base64",
			nodeConfig: base64.StdEncoding.EncodeToString(userDataJSON(t, testUserData)),
			wantIs:     ErrBadUserData,
			wantErr:    []string{"base64 of JSON", "not base64encode of it"},
		},
		{
			name:       "node config without join endpoints",
			nodeConfig: string(userDataJSON(t, noEndpoints)),
			wantIs:     ErrBadUserData,
			wantErr:    []string{"names no join endpoint"},
		},
		{
			name:    "instance id not a number",
			faults:  map[string]gcemetadatatest.Fault{pathID: {Body: []byte("i-0123456789abcdef0")}},
			wantErr: []string{`reading instance/id from the GCE metadata server: "i-0123456789abcdef0" is not a Compute Engine instance id`},
		},
		{
			name:    "instance id with a newline",
			faults:  map[string]gcemetadatatest.Fault{pathID: {Body: []byte("4520818434431224105\n")}},
			wantErr: []string{"is not a Compute Engine instance id"},
		},
		{
			name:    "instance name not RFC 1035",
			faults:  map[string]gcemetadatatest.Fault{pathName: {Body: []byte("Berth_Worker")}},
			wantErr: []string{`reading instance/name from the GCE metadata server: "Berth_Worker" is not a Compute Engine instance name`},
		},
		{
			name:    "instance name longer than 63",
			faults:  map[string]gcemetadatatest.Fault{pathName: {Body: []byte(strings.Repeat("a", 64))}},
			wantErr: []string{"is not a Compute Engine instance name"},
		},
		{
			name:    "zone without its project",
			faults:  map[string]gcemetadatatest.Fault{pathZone: {Body: []byte("europe-west1-b")}},
			wantErr: []string{`reading instance/zone from the GCE metadata server: "europe-west1-b" is not projects/<project number>/zones/<zone>`},
		},
		{
			name:    "zone with a path in its name",
			faults:  map[string]gcemetadatatest.Fault{pathZone: {Body: []byte("projects/731029385467/zones/europe-west1-b/instances/x")}},
			wantErr: []string{"is not projects/<project number>/zones/<zone>"},
		},
		{
			name:    "project id with a slash",
			faults:  map[string]gcemetadatatest.Fault{pathProjectID: {Body: []byte("berth/prod")}},
			wantErr: []string{`reading project/project-id from the GCE metadata server: "berth/prod" is not a project id`},
		},
		{
			name:    "address not IPv4",
			faults:  map[string]gcemetadatatest.Fault{pathIP: {Body: []byte("fd20:1::7")}},
			wantErr: []string{`reading instance/network-interfaces/0/ip from the GCE metadata server: "fd20:1::7" is not an IPv4 address`},
		},
		{
			name:    "address multicast",
			faults:  map[string]gcemetadatatest.Fault{pathIP: {Body: []byte("224.0.0.1")}},
			wantErr: []string{"address from instance/network-interfaces/0/ip", "multicast"},
		},
		{
			name:    "empty name",
			faults:  map[string]gcemetadatatest.Fault{pathName: {Body: []byte{}}},
			wantErr: []string{"reading instance/name from the GCE metadata server: the value is empty"},
		},
		{
			name:    "image with a control character",
			faults:  map[string]gcemetadatatest.Fault{pathImage: {Body: []byte("projects/p/global/images/\x1bx")}},
			wantErr: []string{"image from instance/image", "control characters"},
		},
		{
			name:    "missing value",
			faults:  map[string]gcemetadatatest.Fault{pathName: {Status: http.StatusNotFound}},
			wantErr: []string{"reading instance/name from the GCE metadata server: the metadata server has no such value (404 Not Found)"},
		},
		{
			// Google's error page, reduced to its text.
			name:    "forbidden",
			faults:  map[string]gcemetadatatest.Fault{pathZone: {Status: http.StatusForbidden}},
			wantErr: []string{"reading instance/zone from the GCE metadata server: the GCE metadata server answered 403 Forbidden: 403. That’s an error. Forbidden That’s all we know."},
		},
		{
			name:    "server error, body cut short",
			faults:  map[string]gcemetadatatest.Fault{pathName: {Status: http.StatusInternalServerError, Body: []byte(big)}},
			wantErr: []string{"reading instance/name from the GCE metadata server: the GCE metadata server answered 500 Internal Server Error: xxx", "x…"},
		},
		{
			name:    "value of 1 MiB",
			faults:  map[string]gcemetadatatest.Fault{pathName: {Body: []byte(big)}},
			wantErr: []string{"reading instance/name from the GCE metadata server: the GCE metadata server answered with more than 4096 bytes"},
		},
		{
			name:       "node config of 1 MiB",
			nodeConfig: big,
			wantErr:    []string{"reading instance/attributes/berth-node-config from the GCE metadata server: the GCE metadata server answered with more than 262144 bytes"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := gcemetadatatest.New(t, testInstance(t))
			for path, f := range tc.faults {
				srv.SetFault(path, f)
			}
			switch {
			case tc.noNodeConfig:
				srv.SetNodeConfig(nil)
			case tc.nodeConfig != "":
				srv.SetNodeConfig([]byte(tc.nodeConfig))
			}
			self, err := (&Client{Endpoint: srv.URL}).Self(context.Background())
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

func TestEndlessAnswerIsCutShort(t *testing.T) {
	srv := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Metadata-Flavor", "Google")
		chunk := []byte(strings.Repeat("x", 32<<10))
		for r.Context().Err() == nil {
			if _, err := w.Write(chunk); err != nil {
				return
			}
		}
	}))
	start := time.Now()
	_, err := (&Client{Endpoint: srv.URL, Timeout: 10 * time.Second}).Self(context.Background())
	if err == nil || !strings.Contains(err.Error(), "reading instance/id from the GCE metadata server: the GCE metadata server answered with more than 4096 bytes") {
		t.Fatalf("Self: %v, want the answer refused after 4096 bytes", err)
	}
	if elapsed := time.Since(start); elapsed > 5*time.Second {
		t.Fatalf("Self took %s, want the answer cut short at once", elapsed)
	}
}

func TestAnswerWithoutFlavorIsNotGCE(t *testing.T) {
	t.Run("a value", func(t *testing.T) {
		srv := gcemetadatatest.New(t, testInstance(t))
		srv.SetFault(pathID, gcemetadatatest.Fault{NoFlavor: true})
		_, err := (&Client{Endpoint: srv.URL}).Self(context.Background())
		if !errors.Is(err, ErrNotGCE) || !strings.Contains(err.Error(), "reading instance/id from the GCE metadata server") ||
			!strings.Contains(err.Error(), srv.URL+" answered 200 OK without Metadata-Flavor: Google") {
			t.Fatalf("Self: %v, want ErrNotGCE naming the path, the endpoint and the missing header", err)
		}
	})
	t.Run("a 404 for the node config", func(t *testing.T) {
		// Another cloud's metadata service answers 404 to GCE's paths: that is no answer about the attribute.
		srv := gcemetadatatest.New(t, testInstance(t))
		srv.SetFault(pathNodeConfig, gcemetadatatest.Fault{Status: http.StatusNotFound, NoFlavor: true})
		_, err := (&Client{Endpoint: srv.URL}).Self(context.Background())
		if !errors.Is(err, ErrNotGCE) || errors.Is(err, ErrNoUserData) {
			t.Fatalf("Self: %v, want ErrNotGCE and not ErrNoUserData", err)
		}
	})
	t.Run("another cloud's metadata service", func(t *testing.T) {
		srv := serve(t, http.NotFoundHandler())
		_, err := (&Client{Endpoint: srv.URL}).Self(context.Background())
		if !errors.Is(err, ErrNotGCE) || !strings.Contains(err.Error(), "404 Not Found without Metadata-Flavor") {
			t.Fatalf("Self: %v, want ErrNotGCE", err)
		}
	})
}

func TestGCEMetadataHost(t *testing.T) {
	srv := gcemetadatatest.New(t, testInstance(t))
	ctx := context.Background()

	t.Setenv(HostEnv, srv.Host)
	self, err := (&Client{}).Self(ctx)
	if err != nil {
		t.Fatalf("Self with %s=%s: %v", HostEnv, srv.Host, err)
	}
	if diff := cmp.Diff(wantSelf(metadata.RoleWorker, testUserData), self, equateAddr); diff != "" {
		t.Fatalf("Self (-want +got):\n%s", diff)
	}

	// The agent's explicit endpoint wins over the environment.
	t.Setenv(HostEnv, closedPort(t))
	if _, err := (&Client{Endpoint: srv.URL}).Self(ctx); err != nil {
		t.Fatalf("Self with an Endpoint and %s elsewhere: %v", HostEnv, err)
	}

	for _, host := range []string{"http://" + srv.Host, srv.Host + "/computeMetadata", "user@" + srv.Host} {
		t.Setenv(HostEnv, host)
		_, err := (&Client{}).Self(ctx)
		if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("%s=%q is not host[:port]", HostEnv, host)) {
			t.Errorf("%s=%q: Self: %v, want it refused", HostEnv, host, err)
		}
	}

	t.Setenv(HostEnv, "")
	if u, err := (&Client{}).endpoint(); err != nil || u.String() != DefaultEndpoint {
		t.Fatalf("endpoint without Endpoint and %s = %v, %v; want %s", HostEnv, u, err, DefaultEndpoint)
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

func TestUnreachable(t *testing.T) {
	endpoint := "http://" + closedPort(t)
	start := time.Now()
	_, err := (&Client{Endpoint: endpoint}).Self(context.Background())
	if !errors.Is(err, ErrUnreachable) || !strings.Contains(err.Error(), "reading instance/id from the GCE metadata server: GCE metadata server unreachable: no answer from "+endpoint) {
		t.Fatalf("Self: %v, want ErrUnreachable naming %s", err, endpoint)
	}
	if elapsed := time.Since(start); elapsed > 2*time.Second {
		t.Fatalf("Self took %s on a closed port, want it at once", elapsed)
	}
}

func TestEveryRequestHasATimeBound(t *testing.T) {
	// Far above a loopback request's time on a loaded machine, so that only the held request reaches it.
	const timeout = 2 * time.Second
	for _, path := range []string{pathZone, pathNodeConfig} {
		t.Run(path, func(t *testing.T) {
			srv := gcemetadatatest.New(t, testInstance(t))
			srv.SetFault(path, gcemetadatatest.Fault{Delay: time.Minute})
			// The HTTP client has no timeout of its own and the context no deadline: only the Client's bound ends the wait.
			c := &Client{Endpoint: srv.URL, HTTPClient: &http.Client{}, Timeout: timeout}
			start := time.Now()
			_, err := c.Self(context.Background())
			if elapsed := time.Since(start); elapsed > 10*timeout {
				t.Fatalf("Self took %s, want about %s", elapsed, timeout)
			}
			want := "reading " + path + " from the GCE metadata server: GCE metadata server unreachable: no answer from " + srv.URL + " within " + timeout.String()
			if !errors.Is(err, ErrUnreachable) || !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), want) {
				t.Fatalf("Self: %v, want ErrUnreachable after the deadline: %q", err, want)
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
		t.Errorf("the client followed a redirect to %s", r.URL)
	}))
	srv := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Metadata-Flavor", "Google")
		http.Redirect(w, r, elsewhere.URL+r.URL.Path, http.StatusTemporaryRedirect)
	}))
	// An HTTP client of the caller's, which would follow redirects: the Client does not let it.
	_, err := (&Client{Endpoint: srv.URL, HTTPClient: &http.Client{}}).Self(context.Background())
	if err == nil || !strings.Contains(err.Error(), "the GCE metadata server answered 307 Temporary Redirect") {
		t.Fatalf("Self: %v, want the redirect as an error", err)
	}
}

func TestDefaultHTTPClientHasNoProxy(t *testing.T) {
	if defaultHTTPClient.Transport.(*http.Transport).Proxy != nil {
		t.Fatal("the default HTTP client takes a proxy (from the environment): the metadata server is link-local, and refuses proxied requests")
	}
}

func TestPlacement(t *testing.T) {
	srv := gcemetadatatest.New(t, testInstance(t))
	c := &Client{Endpoint: srv.URL}
	project, zone, network, err := c.Placement(context.Background())
	if err != nil || project != "berth-prod" || zone != "europe-west1-b" || network != "berth" {
		t.Fatalf("Placement = %q, %q, %q, %v; want berth-prod, europe-west1-b, berth", project, zone, network, err)
	}

	srv.SetFault(pathNetwork, gcemetadatatest.Fault{Body: []byte("projects/999999999999/networks/shared")})
	project, zone, network, err = c.Placement(context.Background())
	if !errors.Is(err, ErrSharedVPC) || project != "berth-prod" || zone != "europe-west1-b" || network != "" {
		t.Errorf("network of another project: Placement = %q, %q, %q, %v; want the project and zone with ErrSharedVPC", project, zone, network, err)
	}

	for _, v := range []string{"berth", "projects/731029385467/networks/", "projects/berth-prod/networks/berth", "projects/731029385467/subnetworks/berth"} {
		srv.SetFault(pathNetwork, gcemetadatatest.Fault{Body: []byte(v)})
		_, _, network, err := c.Placement(context.Background())
		if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("reading instance/network-interfaces/0/network from the GCE metadata server: %q is not projects/<project number>/networks/<network>", v)) {
			t.Errorf("network %q: Placement = %q, %v; want it refused", v, network, err)
		}
	}
}

func TestDomainScopedProject(t *testing.T) {
	inst := testInstance(t)
	inst.ProjectID = "example.com:berth-prod"
	self, err := (&Client{Endpoint: gcemetadatatest.New(t, inst).URL}).Self(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if want := "projects/example.com:berth-prod/zones/europe-west1-b/instances/4520818434431224105"; self.Instance.ID != want {
		t.Fatalf("ID = %q, want %q", self.Instance.ID, want)
	}
}

func TestTokenReusedUntilShortlyBeforeItsEnd(t *testing.T) {
	srv := gcemetadatatest.New(t, testInstance(t))
	srv.SetToken("ya29.first", time.Hour)
	clk := clocktest.New(time.Date(2026, 11, 24, 12, 0, 0, 0, time.UTC))
	c := &Client{Endpoint: srv.URL, Now: clk.Now}
	ctx := context.Background()

	for _, step := range []struct {
		advance  time.Duration
		setToken string
		want     string
		// wantExpiry is after the clock's start.
		wantExpiry   time.Duration
		wantRequests int
	}{
		{0, "", "ya29.first", time.Hour, 1},
		{0, "", "ya29.first", time.Hour, 1},
		{time.Hour - tokenMargin - time.Second, "ya29.second", "ya29.first", time.Hour, 1},
		{time.Second, "", "ya29.second", 2*time.Hour - tokenMargin, 2}, // a minute before the end: replaced
		{time.Minute, "", "ya29.second", 2*time.Hour - tokenMargin, 2},
	} {
		clk.Advance(step.advance)
		if step.setToken != "" {
			srv.SetToken(step.setToken, time.Hour)
		}
		// A new source each time: the sources of one Client share its token.
		tok, err := c.TokenSource(ctx).Token()
		if err != nil {
			t.Fatalf("Token at %s: %v", clk.Now(), err)
		}
		start := time.Date(2026, 11, 24, 12, 0, 0, 0, time.UTC)
		if tok.AccessToken != step.want || tok.TokenType != "Bearer" || !tok.Expiry.Equal(start.Add(step.wantExpiry)) {
			t.Fatalf("Token at %s = %q %q expiring %s; want %q Bearer expiring %s", clk.Now(), tok.AccessToken, tok.TokenType, tok.Expiry, step.want, start.Add(step.wantExpiry))
		}
		if got := srv.TokenRequests(); got != step.wantRequests {
			t.Fatalf("at %s: %d token requests, want %d", clk.Now(), got, step.wantRequests)
		}
		// What a caller does with its token is not the Client's.
		tok.AccessToken = "changed"
	}
}

func TestConcurrentTokenCallersShareOneRequest(t *testing.T) {
	srv := gcemetadatatest.New(t, testInstance(t))
	src := (&Client{Endpoint: srv.URL}).TokenSource(context.Background())
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			if _, err := src.Token(); err != nil {
				t.Errorf("Token: %v", err)
			}
		})
	}
	wg.Wait()
	if got := srv.TokenRequests(); got != 1 {
		t.Fatalf("8 concurrent callers made %d token requests, want 1", got)
	}
}

func TestTokenAuthorizesRequests(t *testing.T) {
	srv := gcemetadatatest.New(t, testInstance(t))
	srv.SetToken("ya29.c.Kp8B-x_y~z+/==", time.Hour)
	got := make(chan string, 1)
	api := serve(t, http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) { got <- r.Header.Get("Authorization") }))
	ctx := context.Background()
	hc := oauth2.NewClient(ctx, (&Client{Endpoint: srv.URL}).TokenSource(ctx))
	resp, err := hc.Get(api.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if auth := <-got; auth != "Bearer ya29.c.Kp8B-x_y~z+/==" {
		t.Fatalf("the API got Authorization %q, want the metadata server's token", auth)
	}
}

func TestTokenRefused(t *testing.T) {
	for _, tc := range []struct {
		name    string
		fault   gcemetadatatest.Fault
		wantIs  error
		wantErr string
	}{
		{"no service account", gcemetadatatest.Fault{Status: http.StatusNotFound}, ErrNoServiceAccount, "give the control-plane nodes' instance template a service account"},
		{"not GCE", gcemetadatatest.Fault{Body: []byte(`{"access_token":"x","expires_in":3599,"token_type":"Bearer"}`), NoFlavor: true}, ErrNotGCE, "without Metadata-Flavor: Google"},
		{"not JSON", gcemetadatatest.Fault{Body: []byte("ya29.token")}, nil, "the answer is not a token's JSON"},
		{"empty token", gcemetadatatest.Fault{Body: []byte(`{"expires_in":3599,"token_type":"Bearer"}`)}, nil, "access_token is empty or has characters a bearer token cannot have"},
		{"token with a line break", gcemetadatatest.Fault{Body: []byte(`{"access_token":"ya29\r\nX-Injected: 1","expires_in":3599,"token_type":"Bearer"}`)}, nil, "access_token is empty or has characters"},
		{"not a bearer token", gcemetadatatest.Fault{Body: []byte(`{"access_token":"ya29.x","expires_in":3599,"token_type":"MAC"}`)}, nil, `token_type is "MAC", not Bearer`},
		{"no token type", gcemetadatatest.Fault{Body: []byte(`{"access_token":"ya29.x","expires_in":3599}`)}, nil, `token_type is "", not Bearer`},
		{"no expiry", gcemetadatatest.Fault{Body: []byte(`{"access_token":"ya29.x","token_type":"Bearer"}`)}, nil, "expires_in is 0 seconds, not from 1 to 86400"},
		{"expiry beyond any token", gcemetadatatest.Fault{Body: []byte(`{"access_token":"ya29.x","expires_in":9223372036854775807,"token_type":"Bearer"}`)}, nil, "expires_in is 9223372036854775807 seconds"},
		{"answer of 1 MiB", gcemetadatatest.Fault{Body: []byte(`{"access_token":"` + strings.Repeat("a", 1<<20) + `"}`)}, nil, "answered with more than 16384 bytes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := gcemetadatatest.New(t, testInstance(t))
			srv.SetFault(pathToken, tc.fault)
			_, err := (&Client{Endpoint: srv.URL}).TokenSource(context.Background()).Token()
			if err == nil || !strings.Contains(err.Error(), "reading instance/service-accounts/default/token from the GCE metadata server") ||
				!strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("Token: %v, want an error naming the path and %q", err, tc.wantErr)
			}
			if tc.wantIs != nil && !errors.Is(err, tc.wantIs) {
				t.Fatalf("Token: %v, want it to wrap %v", err, tc.wantIs)
			}
		})
	}
}

func TestRefusedTokenIsNotCached(t *testing.T) {
	srv := gcemetadatatest.New(t, testInstance(t))
	srv.SetFault(pathToken, gcemetadatatest.Fault{Status: http.StatusServiceUnavailable})
	src := (&Client{Endpoint: srv.URL}).TokenSource(context.Background())
	if _, err := src.Token(); err == nil || !strings.Contains(err.Error(), "answered 503 Service Unavailable") {
		t.Fatalf("Token: %v, want the 503", err)
	}
	srv.ClearFault(pathToken)
	if tok, err := src.Token(); err != nil || tok.AccessToken != "ya29.gcemetadatatest" {
		t.Fatalf("Token after the server recovered = %v, %v; want its token", tok, err)
	}
}

func serve(t testing.TB, h http.Handler) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}

// closedPort is a loopback host:port nothing listens on.
func closedPort(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}
