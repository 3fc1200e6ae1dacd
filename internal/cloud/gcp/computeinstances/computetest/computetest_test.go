package computetest

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"strings"
	"testing"

	compute "google.golang.org/api/compute/v1"
	"google.golang.org/api/googleapi"
	"google.golang.org/api/option"
)

func put(t *testing.T, s *Server, instances ...Instance) {
	t.Helper()
	if err := s.Put(instances...); err != nil {
		t.Fatal(err)
	}
}

func inst(name, zone, group, ip string) Instance {
	return Instance{Name: name, Zone: zone, Group: group, NICs: []NIC{{Network: "berth-net", IP: netip.MustParseAddr(ip)}}}
}

// client is Google's client against s, without authentication.
func client(t *testing.T, s *Server) *compute.Service {
	t.Helper()
	svc, err := compute.NewService(t.Context(), option.WithEndpoint(s.Endpoint), option.WithoutAuthentication())
	if err != nil {
		t.Fatal(err)
	}
	return svc
}

// get sends a raw request and decodes its JSON answer.
func get(t *testing.T, c *http.Client, method, url, token string) (int, map[string]any) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), method, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	var out map[string]any
	if err := json.Unmarshal(body, &out); err != nil {
		t.Fatalf("%s %s: answer is not JSON: %v\n%s", method, url, err, body)
	}
	return resp.StatusCode, out
}

// TestWireFormat checks the raw JSON: kinds, self-links, items keyed by scope with a warning for scopes
// without results on the page.
func TestWireFormat(t *testing.T) {
	s := New(t)
	put(t, s, inst("a", "europe-west1-b", "europe-west1/cp", "10.0.1.1"), inst("b", "europe-west1-c", "", "10.0.1.2"))
	code, doc := get(t, http.DefaultClient, "GET", s.Endpoint+"projects/"+s.Project+"/aggregated/instances?maxResults=1&alt=json&prettyPrint=false", "")
	if code != 200 {
		t.Fatalf("status %d: %v", code, doc)
	}
	if doc["kind"] != "compute#instanceAggregatedList" || doc["selfLink"] != selfLinkBase+"projects/berth-test/aggregated/instances" {
		t.Errorf("list kind %v, selfLink %v", doc["kind"], doc["selfLink"])
	}
	if doc["nextPageToken"] == nil {
		t.Error("one result a page of two: no nextPageToken")
	}
	items := doc["items"].(map[string]any)
	b := items["zones/europe-west1-b"].(map[string]any)["instances"].([]any)[0].(map[string]any)
	if b["kind"] != "compute#instance" || b["zone"] != selfLinkBase+"projects/berth-test/zones/europe-west1-b" || b["status"] != "RUNNING" {
		t.Errorf("instance %v", b)
	}
	if _, isString := b["id"].(string); !isString {
		t.Errorf("id %v is not a string: Compute Engine sends uint64 as strings", b["id"])
	}
	nic := b["networkInterfaces"].([]any)[0].(map[string]any)
	if nic["network"] != selfLinkBase+"projects/berth-test/global/networks/berth-net" || nic["networkIP"] != "10.0.1.1" || nic["name"] != "nic0" {
		t.Errorf("interface %v", nic)
	}
	md := b["metadata"].(map[string]any)["items"].([]any)[0].(map[string]any)
	if md["key"] != "created-by" || md["value"] != "projects/berth-test/regions/europe-west1/instanceGroupManagers/cp" {
		t.Errorf("metadata %v", md)
	}
	w := items["zones/europe-west1-c"].(map[string]any)["warning"].(map[string]any)
	if w["code"] != "NO_RESULTS_ON_PAGE" {
		t.Errorf("scope without results on the page: %v", items["zones/europe-west1-c"])
	}
}

// TestClient drives Google's Go client: pagination, filters, groups, identities, errors.
func TestClient(t *testing.T) {
	s := New(t)
	for i := range 7 {
		put(t, s, inst(fmt.Sprintf("w-%d", i), "europe-west1-b", "europe-west1-b/w", fmt.Sprintf("10.0.2.%d", i+1)))
	}
	put(t, s, inst("cp-0", "europe-west1-c", "europe-west1/cp", "10.0.1.1"))
	stopped := inst("cp-1", "europe-west1-d", "europe-west1/cp", "10.0.1.2")
	stopped.Status = "TERMINATED"
	stopped.Identity = &ShieldedIdentity{EKPub: "-----BEGIN PUBLIC KEY-----\nAA==\n-----END PUBLIC KEY-----\n", EKCert: "c"}
	put(t, s, stopped)
	svc := client(t, s)

	var names []string
	pages := 0
	err := svc.Instances.AggregatedList(s.Project).Filter("status = RUNNING").MaxResults(3).ReturnPartialSuccess(true).
		Pages(t.Context(), func(l *compute.InstanceAggregatedList) error {
			pages++
			for _, sl := range l.Items {
				for _, i := range sl.Instances {
					if i.Id == 0 {
						t.Errorf("%s has no id", i.Name)
					}
					names = append(names, i.Name)
				}
			}
			return nil
		})
	if err != nil {
		t.Fatal(err)
	}
	if len(names) != 8 || pages != 3 {
		t.Errorf("%d running instances in %d pages, want 8 in 3: %v", len(names), pages, names)
	}
	if got := s.Calls(AggregatedList); got != 3 {
		t.Errorf("%d aggregatedList calls, want 3", got)
	}
	for _, f := range []string{"status != RUNNING", "(status eq TERMINATED)", `name = "cp-1"`} {
		out, err := svc.Instances.AggregatedList(s.Project).Filter(f).Do()
		if err != nil {
			t.Fatal(err)
		}
		if l := out.Items["zones/europe-west1-d"].Instances; len(l) != 1 || l[0].Name != "cp-1" {
			t.Errorf("filter %q: %v", f, out.Items)
		}
	}

	// A pageless group answers everything whatever maxResults; a paginated one honours it.
	zonal, err := svc.InstanceGroupManagers.ListManagedInstances(s.Project, "europe-west1-b", "w").MaxResults(2).Do()
	if err != nil || len(zonal.ManagedInstances) != 7 || zonal.NextPageToken != "" {
		t.Fatalf("pageless zonal group: %+v, %v", zonal, err)
	}
	if m := zonal.ManagedInstances[0]; m.Id == 0 || !strings.HasSuffix(m.Instance, "/zones/europe-west1-b/instances/w-0") || m.InstanceStatus != "RUNNING" {
		t.Errorf("managed instance %+v", m)
	}
	if err := s.PutGroup(Group{Key: "europe-west1-b/w", Paginated: true}); err != nil {
		t.Fatal(err)
	}
	n := 0
	err = svc.InstanceGroupManagers.ListManagedInstances(s.Project, "europe-west1-b", "w").MaxResults(2).
		Pages(t.Context(), func(r *compute.InstanceGroupManagersListManagedInstancesResponse) error {
			n += len(r.ManagedInstances)
			return nil
		})
	if err != nil || n != 7 || s.Calls(ListManagedInstances) != 5 {
		t.Errorf("paginated group: %d instances in %d calls, %v", n, s.Calls(ListManagedInstances), err)
	}
	regional, err := svc.RegionInstanceGroupManagers.ListManagedInstances(s.Project, "europe-west1", "cp").Do()
	if err != nil || len(regional.ManagedInstances) != 2 {
		t.Errorf("regional group: %+v, %v", regional, err)
	}

	// Identities by name and by numeric id; an instance without one answers an empty identity.
	cp1, _ := s.Get("europe-west1-d", "cp-1")
	for _, ref := range []string{"cp-1", fmt.Sprint(cp1.ID)} {
		id, err := svc.Instances.GetShieldedInstanceIdentity(s.Project, "europe-west1-d", ref).Do()
		if err != nil || id.Kind != "compute#shieldedInstanceIdentity" || id.EncryptionKey == nil || id.EncryptionKey.EkCert != "c" {
			t.Errorf("identity of %s: %+v, %v", ref, id, err)
		}
	}
	empty, err := svc.Instances.GetShieldedInstanceIdentity(s.Project, "europe-west1-c", "cp-0").Do()
	if err != nil || empty.EncryptionKey != nil || empty.SigningKey != nil {
		t.Errorf("identity of an instance that is not a Shielded VM: %+v, %v", empty, err)
	}

	// Errors in Google's shape, as the client parses them.
	for _, tc := range []struct {
		name   string
		call   func() error
		code   int
		reason string
	}{
		{"unknown instance", func() error {
			_, err := svc.Instances.GetShieldedInstanceIdentity(s.Project, "europe-west1-b", "nope").Do()
			return err
		}, 404, "notFound"},
		{"unknown group", func() error {
			_, err := svc.RegionInstanceGroupManagers.ListManagedInstances(s.Project, "europe-west1", "nope").Do()
			return err
		}, 404, "notFound"},
		{"zonal group asked as regional", func() error {
			_, err := svc.RegionInstanceGroupManagers.ListManagedInstances(s.Project, "europe-west1-b", "w").Do()
			return err
		}, 404, "notFound"},
		{"other project", func() error {
			_, err := svc.Instances.AggregatedList("someone-else").Do()
			return err
		}, 404, "notFound"},
		{"bad filter", func() error {
			_, err := svc.Instances.AggregatedList(s.Project).Filter("labels.role = cp").Do()
			return err
		}, 400, "invalid"},
		{"maxResults too big", func() error {
			_, err := svc.Instances.AggregatedList(s.Project).MaxResults(501).Do()
			return err
		}, 400, "invalid"},
		{"bad page token", func() error {
			_, err := svc.Instances.AggregatedList(s.Project).PageToken("forged").Do()
			return err
		}, 400, "invalid"},
	} {
		err := tc.call()
		var ge *googleapi.Error
		if !errors.As(err, &ge) || ge.Code != tc.code || len(ge.Errors) != 1 || ge.Errors[0].Reason != tc.reason {
			t.Errorf("%s: %v, want %d %s", tc.name, err, tc.code, tc.reason)
		}
	}
}

func TestFaults(t *testing.T) {
	s := New(t)
	put(t, s, inst("a", "europe-west1-b", "", "10.0.1.1"))
	svc := client(t, s)
	list := func() error {
		_, err := svc.Instances.AggregatedList(s.Project).Do()
		return err
	}
	reasonOf := func(err error) (int, string) {
		var ge *googleapi.Error
		if !errors.As(err, &ge) || len(ge.Errors) == 0 {
			return 0, ""
		}
		return ge.Code, ge.Errors[0].Reason
	}

	s.FailNext(1, RateLimited)
	if code, reason := reasonOf(list()); code != 403 || reason != "rateLimitExceeded" {
		t.Errorf("RateLimited: %d %s", code, reason)
	}
	s.FailNext(1, TooManyRequests)
	if code, reason := reasonOf(list()); code != 429 || reason != "rateLimitExceeded" {
		t.Errorf("TooManyRequests: %d %s", code, reason)
	}
	s.FailNext(1, Unavailable)
	if code, _ := reasonOf(list()); code != 503 {
		t.Errorf("Unavailable: %d", code)
	}
	if err := list(); err != nil {
		t.Errorf("after the faults: %v", err)
	}

	// Every third request, 403 and 429 in turn.
	s.ThrottleEvery(3)
	seen := map[int]int{}
	for range 12 {
		code, _ := reasonOf(list())
		seen[code]++
	}
	s.ThrottleEvery(0)
	if seen[403] != 2 || seen[429] != 2 || seen[0] != 8 {
		t.Errorf("every third of 12 requests: %v", seen)
	}
	if s.Faults() != 3+4 {
		t.Errorf("%d faults counted, want 7", s.Faults())
	}

	s.Deny(AggregatedList)
	err := list()
	var ge *googleapi.Error
	if !errors.As(err, &ge) || ge.Code != 403 || ge.Errors[0].Reason != "forbidden" || !strings.Contains(ge.Message, "compute.instances.list") {
		t.Errorf("denied: %v", err)
	}
}

func TestUnreachable(t *testing.T) {
	s := New(t)
	put(t, s, inst("a", "europe-west1-b", "", "10.0.1.1"), inst("b", "europe-west1-c", "", "10.0.1.2"))
	s.SetUnreachable("europe-west1-c")
	svc := client(t, s)
	out, err := svc.Instances.AggregatedList(s.Project).ReturnPartialSuccess(true).Do()
	if err != nil {
		t.Fatal(err)
	}
	if len(out.Unreachables) != 1 || out.Unreachables[0] != "zones/europe-west1-c" || out.Items["zones/europe-west1-c"].Warning.Code != "UNREACHABLE" {
		t.Errorf("unreachables %v, items %v", out.Unreachables, out.Items)
	}
	if len(out.Items["zones/europe-west1-b"].Instances) != 1 || len(out.Items["zones/europe-west1-c"].Instances) != 0 {
		t.Errorf("items %v", out.Items)
	}
	if _, err := svc.Instances.AggregatedList(s.Project).Do(); err == nil {
		t.Error("without partial success, a zone that does not answer fails the list")
	}
}

func TestTokenAndTLS(t *testing.T) {
	s := NewWithOptions(t, Options{TLS: true, Token: "ya29.test", Project: "other-project"})
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(s.CACertPEM) {
		t.Fatal("CA does not parse")
	}
	c := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}}}
	url := s.Endpoint + "projects/other-project/aggregated/instances"
	if code, doc := get(t, c, "GET", url, "ya29.test"); code != 200 {
		t.Errorf("with the token: %d %v", code, doc)
	}
	code, doc := get(t, c, "GET", url, "ya29.wrong")
	if e, _ := doc["error"].(map[string]any); code != 401 || e["status"] != "UNAUTHENTICATED" {
		t.Errorf("with another token: %d %v", code, doc)
	}
	if s.Calls(AggregatedList) != 1 {
		t.Errorf("%d calls counted, want 1 (refused ones are not)", s.Calls(AggregatedList))
	}
	// Unknown paths and verbs are 404 in Google's shape.
	for _, tc := range []struct{ method, path string }{
		{"GET", "projects/other-project/zones/europe-west1-b/instanceGroupManagers/w/listManagedInstances"},
		{"POST", "projects/other-project/aggregated/instances"},
		{"GET", "projects/other-project/zones/europe-west1-b/instances"},
	} {
		code, doc := get(t, c, tc.method, s.Endpoint+tc.path, "ya29.test")
		if e, _ := doc["error"].(map[string]any); code != 404 || e["code"] != float64(404) {
			t.Errorf("%s %s: %d %v", tc.method, tc.path, code, doc)
		}
	}
}

func TestMutations(t *testing.T) {
	s := New(t)
	put(t, s, inst("a", "europe-west1-b", "", "10.0.1.1"))
	a, ok := s.Get("europe-west1-b", "a")
	if !ok || a.ID == 0 {
		t.Fatalf("Get after Put: %+v, %v", a, ok)
	}
	if err := s.SetGroup("europe-west1-b", "a", "europe-west1-b/w"); err != nil {
		t.Fatal(err)
	}
	if err := s.SetStatus("europe-west1-b", "a", "STOPPING"); err != nil {
		t.Fatal(err)
	}
	if err := s.SetIdentity("europe-west1-b", "a", &ShieldedIdentity{EKPub: "k"}); err != nil {
		t.Fatal(err)
	}
	a, _ = s.Get("europe-west1-b", "a")
	if a.Group != "europe-west1-b/w" || a.Status != "STOPPING" || a.Identity == nil || a.Identity.EKPub != "k" {
		t.Errorf("after the changes: %+v", a)
	}
	if err := s.Remove("europe-west1-b", "a"); err != nil {
		t.Fatal(err)
	}
	for _, err := range []error{
		s.Remove("europe-west1-b", "a"),
		s.SetGroup("europe-west1-b", "a", ""),
		s.Put(Instance{Name: "A", Zone: "europe-west1-b"}),
		s.Put(Instance{Name: "a", Zone: "europe-west1"}),
		s.PutGroup(Group{Key: "w"}),
	} {
		if err == nil {
			t.Error("a change of something that does not exist, or a bad name, was accepted")
		}
	}
}
