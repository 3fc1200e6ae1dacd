package gcemetadatatest

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"cloud.google.com/go/compute/metadata"
	"github.com/google/go-cmp/cmp"
	"golang.org/x/oauth2/google"
)

// noRedirects is a client that shows the server's answers as they are.
var noRedirects = &http.Client{
	Transport:     &http.Transport{},
	CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
}

type answer struct {
	status int
	header http.Header
	body   string
}

func get(t *testing.T, url string, header map[string]string) answer {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := noRedirects.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return answer{resp.StatusCode, resp.Header, string(body)}
}

// flavored is the request header GCE requires.
var flavored = map[string]string{"Metadata-Flavor": "Google"}

func testInstance() Instance {
	inst := Example()
	inst.NodeConfig = []byte(`{"clusterName":"prod"}`)
	return inst
}

func TestWireFormat(t *testing.T) {
	srv := New(t, testInstance())
	v1 := srv.URL + Prefix

	for _, tc := range []struct {
		name       string
		url        string
		header     map[string]string
		wantStatus int
		wantType   string
		// wantBody is the whole body, or with wantIn a part of it.
		wantBody string
		wantIn   bool
	}{
		{"root, without the header", srv.URL + "/", nil, http.StatusOK, "application/text", "computeMetadata/\n", false},
		{"without the header", v1 + "instance/id", nil, http.StatusForbidden, "text/html; charset=UTF-8",
			"Your client does not have permission to get URL <code>/computeMetadata/v1/instance/id</code> from this server. Missing Metadata-Flavor:Google header.", true},
		{"with the wrong header", v1 + "instance/id", map[string]string{"Metadata-Flavor": "google"}, http.StatusForbidden, "text/html; charset=UTF-8", "Missing Metadata-Flavor:Google header.", true},
		{"through a proxy", v1 + "instance/id", map[string]string{"Metadata-Flavor": "Google", "X-Forwarded-For": "10.0.0.9"}, http.StatusForbidden, "text/html; charset=UTF-8", "X-Forwarded-For", true},
		{"instance id", v1 + "instance/id", flavored, http.StatusOK, "application/text", "4520818434431224105", false},
		{"instance id as JSON", v1 + "instance/id?alt=json", flavored, http.StatusOK, "application/json", "4520818434431224105", false},
		{"name as JSON", v1 + "instance/name?alt=json", flavored, http.StatusOK, "application/json", `"berth-workers-7x2k"`, false},
		{"zone", v1 + "instance/zone", flavored, http.StatusOK, "application/text", "projects/731029385467/zones/europe-west1-b", false},
		{"hostname", v1 + "instance/hostname", flavored, http.StatusOK, "application/text", "berth-workers-7x2k.europe-west1-b.c.berth-prod.internal", false},
		{"network", v1 + "instance/network-interfaces/0/network", flavored, http.StatusOK, "application/text", "projects/731029385467/networks/berth", false},
		{"node config", v1 + "instance/attributes/berth-node-config", flavored, http.StatusOK, "application/text", `{"clusterName":"prod"}`, false},
		{"scopes, one a line", v1 + "instance/service-accounts/default/scopes", flavored, http.StatusOK, "application/text", "https://www.googleapis.com/auth/cloud-platform\n", false},
		{"a listing", v1 + "instance/network-interfaces/0/", flavored, http.StatusOK, "application/text", "ip\nnetwork\n", false},
		{"a listing as JSON", v1 + "instance/service-accounts/?alt=json", flavored, http.StatusOK, "application/json", `["731029385467-compute@developer.gserviceaccount.com/","default/"]`, false},
		{"a directory without its slash", v1 + "instance/attributes?alt=json", flavored, http.StatusMovedPermanently, "text/html; charset=utf-8", "", false},
		{"a value with a slash", v1 + "instance/id/", flavored, http.StatusNotFound, "text/html; charset=UTF-8", "was not found on this server", true},
		{"unknown", v1 + "instance/attributes/startup-script", flavored, http.StatusNotFound, "text/html; charset=UTF-8",
			"The requested URL <code>/computeMetadata/v1/instance/attributes/startup-script</code> was not found on this server.", true},
		{"bad alt", v1 + "instance/id?alt=xml", flavored, http.StatusBadRequest, "text/html; charset=UTF-8", "Invalid alt parameter.", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := get(t, tc.url, tc.header)
			if a.status != tc.wantStatus || a.header.Get("Content-Type") != tc.wantType {
				t.Fatalf("GET %s: %d %s, want %d %s\n%s", tc.url, a.status, a.header.Get("Content-Type"), tc.wantStatus, tc.wantType, a.body)
			}
			if got := a.header.Get("Metadata-Flavor") + "|" + a.header.Get("Server"); got != "Google|Metadata Server for VM" {
				t.Errorf("Metadata-Flavor|Server = %q, want GCE's", got)
			}
			if tc.wantIn && !strings.Contains(a.body, tc.wantBody) || !tc.wantIn && tc.wantStatus != http.StatusMovedPermanently && a.body != tc.wantBody {
				t.Errorf("body %q, want %q", a.body, tc.wantBody)
			}
			if tc.wantStatus == http.StatusMovedPermanently && a.header.Get("Location") != "/computeMetadata/v1/instance/attributes/?alt=json" {
				t.Errorf("Location %q, want the directory's listing", a.header.Get("Location"))
			}
		})
	}
}

func TestRecursive(t *testing.T) {
	srv := New(t, testInstance())
	a := get(t, srv.URL+Prefix+"instance/?recursive=true", flavored)
	if a.status != http.StatusOK || a.header.Get("Content-Type") != "application/json" {
		t.Fatalf("recursive listing: %d %s\n%s", a.status, a.header.Get("Content-Type"), a.body)
	}
	var got map[string]any
	dec := json.NewDecoder(strings.NewReader(a.body))
	dec.UseNumber()
	if err := dec.Decode(&got); err != nil {
		t.Fatal(err)
	}
	account := map[string]any{
		"aliases": []any{"default"},
		"email":   "731029385467-compute@developer.gserviceaccount.com",
		"scopes":  []any{"https://www.googleapis.com/auth/cloud-platform"},
	}
	want := map[string]any{
		"id":         json.Number("4520818434431224105"),
		"name":       "berth-workers-7x2k",
		"hostname":   "berth-workers-7x2k.europe-west1-b.c.berth-prod.internal",
		"zone":       "projects/731029385467/zones/europe-west1-b",
		"image":      "projects/berth-prod/global/images/berth-node-1-2-0",
		"attributes": map[string]any{"berth-node-config": `{"clusterName":"prod"}`},
		"networkInterfaces": []any{
			map[string]any{"ip": "10.132.0.7", "network": "projects/731029385467/networks/berth"},
		},
		"serviceAccounts": map[string]any{"default": account, "731029385467-compute@developer.gserviceaccount.com": account},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("recursive instance/ (-want +got):\n%s", diff)
	}

	a = get(t, srv.URL+Prefix+"project/?recursive=true", flavored)
	if a.body != `{"attributes":{},"numericProjectId":731029385467,"projectId":"berth-prod"}` {
		t.Fatalf("recursive project/: %s", a.body)
	}
}

func TestChanges(t *testing.T) {
	srv := New(t, testInstance())
	node := srv.URL + Prefix + "instance/attributes/berth-node-config"

	srv.SetNodeConfig(nil)
	if a := get(t, node, flavored); a.status != http.StatusNotFound {
		t.Fatalf("node config removed: %d %s", a.status, a.body)
	}
	srv.SetNodeConfig([]byte("#cloud-config\n"))
	if a := get(t, node, flavored); a.status != http.StatusOK || a.body != "#cloud-config\n" {
		t.Fatalf("node config set: %d %q", a.status, a.body)
	}

	srv.SetFault("instance/id", Fault{Status: http.StatusServiceUnavailable, NoFlavor: true})
	if a := get(t, srv.URL+Prefix+"instance/id", flavored); a.status != http.StatusServiceUnavailable || a.header.Get("Metadata-Flavor") != "" ||
		!strings.Contains(a.body, "Service Unavailable") {
		t.Fatalf("fault: %d %v %q", a.status, a.header, a.body)
	}
	srv.SetFault("instance/id", Fault{Body: []byte("not-a-number")})
	if a := get(t, srv.URL+Prefix+"instance/id", flavored); a.status != http.StatusOK || a.body != "not-a-number" {
		t.Fatalf("fault with a body: %d %q", a.status, a.body)
	}
	srv.ClearFault("instance/id")
	if a := get(t, srv.URL+Prefix+"instance/id", flavored); a.body != "4520818434431224105" {
		t.Fatalf("fault cleared: %d %q", a.status, a.body)
	}

	srv.SetFault("instance/name", Fault{Delay: time.Minute})
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+Prefix+"instance/name", nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Metadata-Flavor", "Google")
	if resp, err := noRedirects.Do(req); err == nil {
		resp.Body.Close()
		t.Fatalf("a delayed answer came at once: %d", resp.StatusCode)
	}
}

func TestToken(t *testing.T) {
	srv := New(t, testInstance())
	for _, path := range []string{
		"instance/service-accounts/default/token",
		"instance/service-accounts/default/token?scopes=https://www.googleapis.com/auth/compute.readonly",
		"instance/service-accounts/731029385467-compute@developer.gserviceaccount.com/token",
	} {
		a := get(t, srv.URL+Prefix+path, flavored)
		if a.status != http.StatusOK || a.header.Get("Content-Type") != "application/json" ||
			a.body != `{"access_token":"ya29.gcemetadatatest","expires_in":3599,"token_type":"Bearer"}` {
			t.Fatalf("GET %s: %d %s %s", path, a.status, a.header.Get("Content-Type"), a.body)
		}
	}
	srv.SetToken("ya29.other", 10*time.Minute)
	if a := get(t, srv.URL+Prefix+"instance/service-accounts/default/token", flavored); a.body != `{"access_token":"ya29.other","expires_in":600,"token_type":"Bearer"}` {
		t.Fatalf("token after SetToken: %s", a.body)
	}
	// Refused requests issue nothing.
	get(t, srv.URL+Prefix+"instance/service-accounts/default/token", nil)
	if n := srv.TokenRequests(); n != 4 {
		t.Fatalf("TokenRequests = %d, want 4", n)
	}
}

// TestGooglesClient reads the server with Google's own metadata client and token source, through
// GCE_METADATA_HOST as they take it: what they read is what GCE would have given them.
func TestGooglesClient(t *testing.T) {
	srv := New(t, testInstance())
	t.Setenv("GCE_METADATA_HOST", srv.Host)
	ctx := context.Background()
	c := metadata.NewWithOptions(&metadata.Options{Client: &http.Client{Transport: &http.Transport{}, Timeout: 10 * time.Second}})

	for _, tc := range []struct {
		name string
		get  func(context.Context) (string, error)
		want string
	}{
		{"InstanceID", c.InstanceIDWithContext, "4520818434431224105"},
		{"InstanceName", c.InstanceNameWithContext, "berth-workers-7x2k"},
		{"Hostname", c.HostnameWithContext, "berth-workers-7x2k.europe-west1-b.c.berth-prod.internal"},
		{"Zone", c.ZoneWithContext, "europe-west1-b"},
		{"ProjectID", c.ProjectIDWithContext, "berth-prod"},
		{"NumericProjectID", c.NumericProjectIDWithContext, "731029385467"},
		{"InternalIP", c.InternalIPWithContext, "10.132.0.7"},
		{"Email", func(ctx context.Context) (string, error) { return c.EmailWithContext(ctx, "") }, "731029385467-compute@developer.gserviceaccount.com"},
		{"InstanceAttributeValue", func(ctx context.Context) (string, error) {
			return c.InstanceAttributeValueWithContext(ctx, "berth-node-config")
		}, `{"clusterName":"prod"}`},
	} {
		if got, err := tc.get(ctx); err != nil || got != tc.want {
			t.Errorf("%s = %q, %v; want %q", tc.name, got, err, tc.want)
		}
	}
	if attrs, err := c.InstanceAttributesWithContext(ctx); err != nil || !cmp.Equal(attrs, []string{"berth-node-config"}) {
		t.Errorf("InstanceAttributes = %q, %v", attrs, err)
	}
	if scopes, err := c.ScopesWithContext(ctx, ""); err != nil || !cmp.Equal(scopes, []string{"https://www.googleapis.com/auth/cloud-platform"}) {
		t.Errorf("Scopes = %q, %v", scopes, err)
	}
	_, err := c.InstanceAttributeValueWithContext(ctx, "startup-script")
	if _, ok := err.(metadata.NotDefinedError); !ok {
		t.Errorf("an attribute the instance has not: %v, want metadata.NotDefinedError", err)
	}

	tok, err := google.ComputeTokenSource("", "https://www.googleapis.com/auth/compute.readonly").Token()
	if err != nil || tok.AccessToken != "ya29.gcemetadatatest" || tok.Type() != "Bearer" || time.Until(tok.Expiry) < 55*time.Minute {
		t.Fatalf("Google's token source: %+v, %v", tok, err)
	}
}
