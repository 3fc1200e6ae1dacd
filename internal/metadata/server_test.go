package metadata

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"reflect"
	"regexp"
	"strings"
	"testing"
)

func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug}))
}

func labDocument() *Document {
	return &Document{
		UserData: UserData{ClusterName: "lab", JoinPort: 9000, JoinCAPin: testPin},
		Instances: []Instance{
			{Name: "cp-0", Role: RoleControlPlane, Addresses: []netip.Addr{netip.MustParseAddr("127.0.0.2")}, ImageID: "img-1"},
			{Name: "w-0", Role: RoleWorker, Addresses: []netip.Addr{netip.MustParseAddr("127.0.0.3"), netip.MustParseAddr("fd00::3")}},
		},
	}
}

// startServer serves doc on a real listener at 127.0.0.1 (httptest binds loopback only).
func startServer(t *testing.T, doc *Document) (*Server, *httptest.Server) {
	t.Helper()
	s := NewServer(doc, testLogger(t))
	ts := httptest.NewServer(s)
	t.Cleanup(ts.Close)
	return s, ts
}

func TestClientSelfFromSourceAddress(t *testing.T) {
	doc := labDocument()
	_, ts := startServer(t, doc)
	for _, want := range doc.Instances {
		t.Run(want.Name, func(t *testing.T) {
			c := &Client{BaseURL: ts.URL, LocalAddr: want.Addresses[0]}
			self, err := c.Self(t.Context())
			if err != nil {
				t.Fatalf("Self from %s: %v", want.Addresses[0], err)
			}
			if !reflect.DeepEqual(self.Instance, want) {
				t.Errorf("Self().Instance = %+v, want %+v", self.Instance, want)
			}
			if !reflect.DeepEqual(self.UserData, doc.UserData) {
				t.Errorf("Self().UserData = %+v, want %+v", self.UserData, doc.UserData)
			}
		})
	}
}

func TestClientSelfUnknownAddress(t *testing.T) {
	_, ts := startServer(t, labDocument())
	c := &Client{BaseURL: ts.URL, LocalAddr: netip.MustParseAddr("127.0.0.4")}
	_, err := c.Self(t.Context())
	if !errors.Is(err, ErrNotFound) {
		t.Fatalf("Self from an unknown address: error %v, want ErrNotFound", err)
	}
	if !strings.Contains(err.Error(), "127.0.0.4") {
		t.Errorf("error %q does not name the caller's address", err)
	}
}

func TestReplaceAddsNodeWhileRunning(t *testing.T) {
	doc := labDocument()
	s, ts := startServer(t, doc)
	c := &Client{BaseURL: ts.URL, LocalAddr: netip.MustParseAddr("127.0.0.5")}
	if _, err := c.Self(t.Context()); !errors.Is(err, ErrNotFound) {
		t.Fatalf("before Replace: error %v, want ErrNotFound", err)
	}
	doc.Instances = append(doc.Instances, Instance{Name: "w-1", Role: RoleWorker, Addresses: []netip.Addr{netip.MustParseAddr("127.0.0.5")}})
	s.Replace(doc)
	self, err := c.Self(t.Context())
	if err != nil {
		t.Fatalf("after Replace: %v", err)
	}
	if self.Instance.Name != "w-1" {
		t.Errorf("after Replace: name %q, want w-1", self.Instance.Name)
	}
}

func TestServerKeepsItsOwnCopy(t *testing.T) {
	doc := labDocument()
	_, ts := startServer(t, doc)
	doc.Instances[0].Name = "changed"
	doc.Instances[0].Addresses[0] = netip.MustParseAddr("127.0.0.9")
	inst, err := (&Client{BaseURL: ts.URL}).InstanceByAddress(t.Context(), netip.MustParseAddr("127.0.0.2"))
	if err != nil {
		t.Fatal(err)
	}
	if inst.Name != "cp-0" {
		t.Errorf("server followed a change to the caller's document: name %q", inst.Name)
	}
}

func TestClientControlPlanes(t *testing.T) {
	doc := labDocument()
	_, ts := startServer(t, doc)
	got, err := (&Client{BaseURL: ts.URL}).ControlPlanes(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if want := doc.Instances[:1]; !reflect.DeepEqual(got, want) {
		t.Errorf("ControlPlanes() = %+v, want %+v", got, want)
	}

	_, empty := startServer(t, &Document{UserData: doc.UserData})
	got, err = (&Client{BaseURL: empty.URL}).ControlPlanes(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 0 {
		t.Errorf("ControlPlanes() of an empty service = %+v", got)
	}
}

// A service that answers the role query with a worker must not make a worker a join endpoint.
func TestClientControlPlanesRefusesOtherRoles(t *testing.T) {
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("role") != string(RoleControlPlane) {
			t.Errorf("asked %q, want role=control-plane", r.URL.RawQuery)
		}
		json.NewEncoder(w).Encode(labDocument().Instances)
	}))
	t.Cleanup(ts.Close)
	_, err := (&Client{BaseURL: ts.URL}).ControlPlanes(t.Context())
	checkErr(t, err, `service answered with "w-0", whose role is "worker"`)
}

func TestServerListsByRole(t *testing.T) {
	_, ts := startServer(t, labDocument())
	for _, tt := range []struct {
		query string
		code  int
		want  string
	}{
		{"", http.StatusOK, `"cp-0".*"w-0"`},
		{"?role=worker", http.StatusOK, `^\[\{"name":"w-0"`},
		{"?role=control-plane", http.StatusOK, `^\[\{"name":"cp-0"`},
		{"?role=boss", http.StatusOK, `^\[\]$`},
		{"?role=worker&role=worker", http.StatusBadRequest, "more than once"},
		{"?role=worker&address=127.0.0.3", http.StatusBadRequest, "not both"},
	} {
		resp, err := http.Get(ts.URL + PathInstances + tt.query)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tt.code || !regexp.MustCompile(tt.want).Match(bytes.TrimSpace(body)) {
			t.Errorf("GET %s: %d %s, want %d matching %s", tt.query, resp.StatusCode, body, tt.code, tt.want)
		}
	}
}

func TestClientInstanceByAddress(t *testing.T) {
	_, ts := startServer(t, labDocument())
	c := &Client{BaseURL: ts.URL + "/"}
	tests := []struct {
		addr     string
		wantName string
	}{
		{addr: "127.0.0.2", wantName: "cp-0"},
		{addr: "127.0.0.3", wantName: "w-0"},
		{addr: "fd00::3", wantName: "w-0"},
		{addr: "::ffff:127.0.0.3", wantName: "w-0"},
		{addr: "127.0.0.1"},
	}
	for _, tt := range tests {
		t.Run(tt.addr, func(t *testing.T) {
			inst, err := c.InstanceByAddress(t.Context(), netip.MustParseAddr(tt.addr))
			if tt.wantName == "" {
				if !errors.Is(err, ErrNotFound) {
					t.Fatalf("error %v, want ErrNotFound", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if inst.Name != tt.wantName {
				t.Errorf("name %q, want %q", inst.Name, tt.wantName)
			}
		})
	}
	if _, err := c.InstanceByAddress(t.Context(), netip.Addr{}); err == nil {
		t.Error("InstanceByAddress accepted an empty address")
	}
}

func TestServerUnmapsIPv4MappedRemoteAddress(t *testing.T) {
	s := NewServer(labDocument(), testLogger(t))
	req := httptest.NewRequest(http.MethodGet, PathSelf, nil)
	req.RemoteAddr = "[::ffff:127.0.0.3]:41000"
	rec := httptest.NewRecorder()
	s.ServeHTTP(rec, req)
	if rec.Code != http.StatusOK {
		t.Fatalf("status %d, body %s", rec.Code, rec.Body)
	}
	var self Self
	if err := json.Unmarshal(rec.Body.Bytes(), &self); err != nil {
		t.Fatal(err)
	}
	if self.Instance.Name != "w-0" {
		t.Errorf("name %q, want w-0", self.Instance.Name)
	}
}

func TestServerRequests(t *testing.T) {
	_, ts := startServer(t, labDocument())
	tests := []struct {
		name       string
		method     string
		target     string
		wantStatus int
	}{
		{name: "self", method: http.MethodGet, target: PathSelf, wantStatus: http.StatusNotFound}, // the test dials from 127.0.0.1
		{name: "all", method: http.MethodGet, target: PathInstances, wantStatus: http.StatusOK},
		{name: "one", method: http.MethodGet, target: PathInstances + "?address=127.0.0.2", wantStatus: http.StatusOK},
		{name: "none", method: http.MethodGet, target: PathInstances + "?address=10.1.1.1", wantStatus: http.StatusNotFound},
		{name: "bad address", method: http.MethodGet, target: PathInstances + "?address=nope", wantStatus: http.StatusBadRequest},
		{name: "address twice", method: http.MethodGet, target: PathInstances + "?address=127.0.0.2&address=127.0.0.3", wantStatus: http.StatusBadRequest},
		{name: "unknown parameter", method: http.MethodGet, target: PathInstances + "?name=cp-0", wantStatus: http.StatusBadRequest},
		{name: "post", method: http.MethodPost, target: PathInstances, wantStatus: http.StatusMethodNotAllowed},
		{name: "put self", method: http.MethodPut, target: PathSelf, wantStatus: http.StatusMethodNotAllowed},
		{name: "delete", method: http.MethodDelete, target: PathInstances + "?address=127.0.0.2", wantStatus: http.StatusMethodNotAllowed},
		{name: "head", method: http.MethodHead, target: PathSelf, wantStatus: http.StatusMethodNotAllowed},
		{name: "unknown path", method: http.MethodGet, target: "/v1/other", wantStatus: http.StatusNotFound},
		{name: "root", method: http.MethodGet, target: "/", wantStatus: http.StatusNotFound},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req, err := http.NewRequestWithContext(t.Context(), tt.method, ts.URL+tt.target, nil)
			if err != nil {
				t.Fatal(err)
			}
			resp, err := ts.Client().Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			if resp.StatusCode != tt.wantStatus {
				t.Errorf("%s %s: status %d, want %d", tt.method, tt.target, resp.StatusCode, tt.wantStatus)
			}
			if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
				t.Errorf("Content-Type %q, want application/json", ct)
			}
			if tt.wantStatus == http.StatusMethodNotAllowed && resp.Header.Get("Allow") != http.MethodGet {
				t.Errorf("Allow header %q, want GET", resp.Header.Get("Allow"))
			}
		})
	}
}

// fakeService answers every request with a fixed status and body, standing in
// for a broken or hostile metadata service.
func fakeService(t *testing.T, status int, body string) *httptest.Server {
	t.Helper()
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(status)
		_, _ = w.Write([]byte(body))
	}))
	t.Cleanup(ts.Close)
	return ts
}

func TestClientRefusesBadResponses(t *testing.T) {
	cpJSON, err := json.Marshal(labDocument().Instances[0])
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name    string
		status  int
		body    string
		call    func(*Client) error
		wantErr string
	}{
		{
			name:   "body over 1 MiB",
			status: http.StatusOK,
			body:   `[` + strings.Repeat(" ", MaxDocumentSize) + `]`,
			call: func(c *Client) error {
				_, err := c.ControlPlanes(t.Context())
				return err
			},
			wantErr: "larger than 1048576 bytes",
		},
		{
			name:   "record for another address",
			status: http.StatusOK,
			body:   string(cpJSON),
			call: func(c *Client) error {
				_, err := c.InstanceByAddress(t.Context(), netip.MustParseAddr("127.0.0.3"))
				return err
			},
			wantErr: `answered with "cp-0", which does not have that address`,
		},
		{
			name:   "invalid record",
			status: http.StatusOK,
			body:   `{"name":"x","role":"boss","addresses":["127.0.0.3"]}`,
			call: func(c *Client) error {
				_, err := c.InstanceByAddress(t.Context(), netip.MustParseAddr("127.0.0.3"))
				return err
			},
			wantErr: "invalid record",
		},
		{
			name:   "self without user-data",
			status: http.StatusOK,
			body:   `{"instance":` + string(cpJSON) + `}`,
			call: func(c *Client) error {
				_, err := c.Self(t.Context())
				return err
			},
			wantErr: "invalid user-data",
		},
		{
			name:   "server error",
			status: http.StatusInternalServerError,
			body:   `{"error":"disk on fire"}`,
			call: func(c *Client) error {
				_, err := c.ControlPlanes(t.Context())
				return err
			},
			wantErr: "answered 500 Internal Server Error: disk on fire",
		},
		{
			name:   "not JSON",
			status: http.StatusOK,
			body:   `<html>`,
			call: func(c *Client) error {
				_, err := c.ControlPlanes(t.Context())
				return err
			},
			wantErr: "decoding response",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ts := fakeService(t, tt.status, tt.body)
			checkErr(t, tt.call(&Client{BaseURL: ts.URL}), tt.wantErr)
		})
	}
}

func TestClientHonoursContext(t *testing.T) {
	arrived, release := make(chan struct{}), make(chan struct{})
	ts := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {
		close(arrived)
		<-release
	}))
	t.Cleanup(ts.Close)
	t.Cleanup(func() { close(release) })

	ctx, cancel := context.WithCancel(t.Context())
	errc := make(chan error, 1)
	go func() {
		_, err := (&Client{BaseURL: ts.URL, LocalAddr: netip.MustParseAddr("127.0.0.2")}).Self(ctx)
		errc <- err
	}()
	<-arrived // the request is in flight; only the context can end it now
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Fatalf("error %v, want context.Canceled", err)
	}
}

func TestClientBadConfiguration(t *testing.T) {
	tests := []struct {
		name    string
		client  Client
		wantErr string
	}{
		{name: "no base URL", client: Client{}, wantErr: "not an http(s) URL"},
		{name: "other scheme", client: Client{BaseURL: "file:///etc/passwd"}, wantErr: "not an http(s) URL"},
		{
			name: "local address with a foreign transport",
			client: Client{
				BaseURL:    "http://127.0.0.1:1",
				HTTPClient: &http.Client{Transport: roundTripperFunc(func(*http.Request) (*http.Response, error) { return nil, errors.New("unused") })},
				LocalAddr:  netip.MustParseAddr("127.0.0.2"),
			},
			wantErr: "needs an *http.Transport",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := tt.client.ControlPlanes(t.Context())
			checkErr(t, err, tt.wantErr)
		})
	}
}

type roundTripperFunc func(*http.Request) (*http.Response, error)

func (f roundTripperFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }
