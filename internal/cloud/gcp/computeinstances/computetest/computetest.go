// Package computetest is a local Compute Engine endpoint for tests and labs. It speaks the Compute Engine
// API's own wire format (the REST paths under /compute/v1/, JSON in the shapes of the API reference with
// their kind fields and self-links, Google's error document), so that callers drive Google's Go client,
// with its URL building, encoding and error parsing, exactly as against Google.
//
// It serves instances.aggregatedList (the status and name filters, maxResults and page tokens honoured,
// per-zone warnings and unreachable zones as Compute Engine sends them), getShieldedInstanceIdentity, and
// listManagedInstances of zonal and regional managed instance groups (pageless, or paginated when the
// group says so, as Compute Engine's listManagedInstancesResults does). The fields parameter is accepted
// and ignored: the whole resource is sent, which a client must cope with anyway. It holds the instances
// and groups a caller puts in it, counts calls per method, and can check a bearer token, throttle
// (429, and 403 rateLimitExceeded), fail (503), deny or hold calls. It is a test harness: no program but a
// lab may import it.
package computetest

import (
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"maps"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/berthlabs/berth/test/apifault"
	"github.com/berthlabs/berth/test/tlstest"
)

// BasePath is the path Compute Engine's v1 API lives under; Server.Endpoint ends with it.
const BasePath = "/compute/v1/"

// DefaultProject is the project an endpoint serves unless Options name another.
const DefaultProject = "berth-test"

// selfLinkBase is what Compute Engine starts every resource URL with, whichever endpoint was asked.
const selfLinkBase = "https://www.googleapis.com/compute/v1/"

// Methods this endpoint serves, as Calls and Requests name them (Compute Engine's own method ids).
const (
	AggregatedList              = "compute.instances.aggregatedList"
	GetShieldedInstanceIdentity = "compute.instances.getShieldedInstanceIdentity"
	ListManagedInstances        = "compute.instanceGroupManagers.listManagedInstances"
	RegionListManagedInstances  = "compute.regionInstanceGroupManagers.listManagedInstances"
)

// MaxResults is Compute Engine's largest (and default) maxResults.
const MaxResults = 500

// permissions are the IAM permissions Compute Engine names when it refuses each method.
var permissions = map[string]string{
	AggregatedList:              "compute.instances.list",
	GetShieldedInstanceIdentity: "compute.instances.getShieldedInstanceIdentity",
	ListManagedInstances:        "compute.instanceGroupManagers.get",
	RegionListManagedInstances:  "compute.instanceGroupManagers.get",
}

// NIC is a network interface of an instance.
type NIC struct {
	// Network is a network name of the endpoint's project, or projects/<project>/global/networks/<name>.
	Network string
	// IP is the interface's internal address (networkIP).
	IP netip.Addr
}

// ShieldedIdentity is what getShieldedInstanceIdentity answers for an instance, each field PEM as Compute
// Engine sends it ("PUBLIC KEY" keys, "CERTIFICATE" certificates); empty fields are left out.
type ShieldedIdentity struct {
	EKPub, EKCert string // encryptionKey
	AKPub, AKCert string // signingKey
}

// Instance is a Compute Engine instance as the endpoint reports it. Names are unique in a zone.
type Instance struct {
	Name string
	Zone string // such as "europe-west1-b"
	// ID is the numeric instance id; Put assigns one to an instance without.
	ID uint64
	// Status is RUNNING when empty; STAGING, STOPPING, TERMINATED, SUSPENDED… otherwise.
	Status string
	// NICs are nic0, nic1, … in order.
	NICs []NIC
	// Group is the managed instance group that created the instance, "<region or zone>/<name>"; empty for
	// none. The group then lists it, and its metadata names it in created-by (unless Metadata sets that).
	Group string
	// Metadata are the instance's metadata items, which anyone allowed compute.instances.setMetadata can
	// write.
	Metadata map[string]string
	// Identity is its vTPM's identity; nil for an instance that is not a Shielded VM, whose identity is
	// empty.
	Identity *ShieldedIdentity
}

// Group is a managed instance group.
type Group struct {
	// Key is "<region or zone>/<name>": a regional group lists its instances in every zone of the region, a
	// zonal one those of its zone.
	Key string
	// Paginated makes listManagedInstances honour maxResults and page tokens (listManagedInstancesResults
	// PAGINATED); otherwise it answers every instance at once (PAGELESS, Compute Engine's default).
	Paginated bool
}

// Fault is an error the endpoint answers instead of serving a request.
type Fault int

// Faults, with Compute Engine's status, reason and message for each.
const (
	// RateLimited is 403 with reason rateLimitExceeded: Compute Engine's answer when a per-minute rate
	// quota of the project is spent.
	RateLimited Fault = iota + 1
	// TooManyRequests is 429 RESOURCE_EXHAUSTED, reason rateLimitExceeded.
	TooManyRequests
	// Unavailable is 503 with reason backendError.
	Unavailable
)

// Options say where and how an endpoint serves.
type Options struct {
	// Addr is the address to listen on, such as a lab bridge's "10.250.0.1:7470"; a free port on 127.0.0.1
	// when empty.
	Addr string
	// TLS serves https, as Compute Engine does, with a certificate for Addr's host from a CA of the
	// endpoint's own (CACertPEM). Berth's client, like Google's clients, refuses plain http to anything but
	// loopback; a process trusts the CA through SSL_CERT_FILE.
	TLS bool
	// Project is the one project the endpoint serves; DefaultProject when empty.
	Project string
	// Token, if set, is the OAuth access token every request must carry ("Authorization: Bearer <Token>");
	// others are answered 401 as Compute Engine does.
	Token string
}

// Server is the endpoint. Its methods are safe for concurrent use.
type Server struct {
	// URL is the endpoint's root, such as http://127.0.0.1:39113.
	URL string
	// Endpoint is URL + BasePath, what Google's client takes with option.WithEndpoint.
	Endpoint string
	// Project is the project served.
	Project string
	// CACertPEM is the CA of the endpoint's certificate, with Options.TLS; nil for plain http.
	CACertPEM []byte

	// Knobs throttle a share of requests (403 rateLimitExceeded or 429, at random), deny methods (403
	// forbidden, as for a missing IAM permission) and hold requests.
	apifault.Knobs

	token string
	srv   *httptest.Server

	mu          sync.Mutex
	instances   map[string]*Instance // by zone/name
	groups      map[string]Group
	unreachable map[string]bool
	nextID      uint64
	calls       map[string]int
	requests    map[string][]url.Values
	total       int
	faultNext   int
	faultKind   Fault
	every       int
	faults      int
	tokens      map[string]pageToken
}

type pageToken struct {
	offset int
	query  string // what the token is valid for
}

// New starts an endpoint on loopback, plain http, that t closes when it ends.
func New(t testing.TB) *Server {
	t.Helper()
	return NewWithOptions(t, Options{})
}

// NewWithOptions starts an endpoint as o says, which t closes when it ends.
func NewWithOptions(t testing.TB, o Options) *Server {
	t.Helper()
	s, err := Start(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

// Start starts an endpoint as o says, for holders that are not a test themselves (a lab, which a test or a
// command keeps up); Close stops it.
func Start(o Options) (*Server, error) {
	if o.Project == "" {
		o.Project = DefaultProject
	}
	s := &Server{
		Project:     o.Project,
		token:       o.Token,
		instances:   map[string]*Instance{},
		groups:      map[string]Group{},
		unreachable: map[string]bool{},
		nextID:      4_700_000_000_000_000_000,
		calls:       map[string]int{},
		requests:    map[string][]url.Values{},
		tokens:      map[string]pageToken{},
	}
	s.srv = httptest.NewUnstartedServer(http.HandlerFunc(s.serve))
	if o.Addr != "" {
		ln, err := net.Listen("tcp", o.Addr)
		if err != nil {
			s.srv.Close()
			return nil, fmt.Errorf("computetest: %w", err)
		}
		s.srv.Listener.Close()
		s.srv.Listener = ln
	}
	if o.TLS {
		host, _, err := net.SplitHostPort(s.srv.Listener.Addr().String())
		if err != nil {
			s.srv.Close()
			return nil, fmt.Errorf("computetest: %w", err)
		}
		cert, caPEM, err := tlstest.ServerCertificate(host, "computetest CA")
		if err != nil {
			s.srv.Close()
			return nil, fmt.Errorf("computetest: %w", err)
		}
		s.CACertPEM = caPEM
		s.srv.TLS = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
		s.srv.StartTLS()
	} else {
		s.srv.Start()
	}
	s.URL = s.srv.URL
	s.Endpoint = s.URL + BasePath
	return s, nil
}

// Close stops the endpoint; requests held (Hold) are released first, for Close waits for every request.
func (s *Server) Close() {
	s.Release()
	s.srv.Close()
}

func pemEncode(typ string, der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der})
}

// PublicKeyPEM is pub as Compute Engine sends keys: a PEM "PUBLIC KEY" block of its SubjectPublicKeyInfo.
func PublicKeyPEM(pub any) (string, error) {
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		return "", err
	}
	return string(pemEncode("PUBLIC KEY", der)), nil
}

// CertificatePEM is a DER certificate as Compute Engine sends certificates.
func CertificatePEM(der []byte) string {
	return string(pemEncode("CERTIFICATE", der))
}

var (
	zonePattern   = regexp.MustCompile(`^[a-z]+-[a-z]+[0-9]+-[a-z]$`)
	regionPattern = regexp.MustCompile(`^[a-z]+-[a-z]+[0-9]+$`)
	namePattern   = regexp.MustCompile(`^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$`)
)

// Put adds instances, replacing those with the same zone and name, and gives those without an id one.
func (s *Server) Put(instances ...Instance) error {
	for _, inst := range instances {
		if !namePattern.MatchString(inst.Name) || !zonePattern.MatchString(inst.Zone) {
			return fmt.Errorf("computetest: instance %q in zone %q: not a name and a zone", inst.Name, inst.Zone)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, inst := range instances {
		c := inst.clone()
		if c.ID == 0 {
			s.nextID++
			c.ID = s.nextID
		}
		s.instances[c.Zone+"/"+c.Name] = c
	}
	return nil
}

func (inst *Instance) clone() *Instance {
	c := *inst
	c.NICs = slices.Clone(inst.NICs)
	c.Metadata = maps.Clone(inst.Metadata)
	if inst.Identity != nil {
		id := *inst.Identity
		c.Identity = &id
	}
	return &c
}

// Get returns the instance named name in zone, with the id Put gave it.
func (s *Server) Get(zone, name string) (Instance, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	inst, ok := s.instances[zone+"/"+name]
	if !ok {
		return Instance{}, false
	}
	return *inst.clone(), true
}

// Remove deletes an instance, as instances.delete does once done.
func (s *Server) Remove(zone, name string) error {
	return s.update(zone, name, nil)
}

// SetStatus changes an instance's status (RUNNING, STOPPING, TERMINATED…).
func (s *Server) SetStatus(zone, name, status string) error {
	return s.update(zone, name, func(inst *Instance) { inst.Status = status })
}

// SetGroup makes the managed instance group group (empty for none) list the instance.
func (s *Server) SetGroup(zone, name, group string) error {
	return s.update(zone, name, func(inst *Instance) { inst.Group = group })
}

// SetIdentity changes what getShieldedInstanceIdentity answers for the instance; nil makes it answer an
// empty identity, as for an instance that is not a Shielded VM.
func (s *Server) SetIdentity(zone, name string, id *ShieldedIdentity) error {
	return s.update(zone, name, func(inst *Instance) {
		if id == nil {
			inst.Identity = nil
			return
		}
		c := *id
		inst.Identity = &c
	})
}

// update changes an instance, or removes it when change is nil.
func (s *Server) update(zone, name string, change func(*Instance)) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	key := zone + "/" + name
	inst, ok := s.instances[key]
	if !ok {
		return fmt.Errorf("computetest: no instance %q in zone %q", name, zone)
	}
	if change == nil {
		delete(s.instances, key)
		return nil
	}
	change(inst)
	return nil
}

// PutGroup creates or changes a managed instance group. A group that an instance names exists without;
// PutGroup makes an empty one, or a paginated one.
func (s *Server) PutGroup(g Group) error {
	if _, _, _, err := parseGroupKey(g.Key); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.groups[g.Key] = g
	return nil
}

func parseGroupKey(key string) (location, name string, zonal bool, err error) {
	location, name, ok := strings.Cut(key, "/")
	switch {
	case !ok || !namePattern.MatchString(name):
		return "", "", false, fmt.Errorf("computetest: group %q is not <region or zone>/<name>", key)
	case zonePattern.MatchString(location):
		return location, name, true, nil
	case regionPattern.MatchString(location):
		return location, name, false, nil
	}
	return "", "", false, fmt.Errorf("computetest: group %q: %q is neither a region nor a zone", key, location)
}

// SetUnreachable makes aggregatedList miss the instances of these zones, as when a zone does not answer:
// with returnPartialSuccess it lists them as unreachable, without it fails. No zones restores them all.
func (s *Server) SetUnreachable(zones ...string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.unreachable = map[string]bool{}
	for _, z := range zones {
		s.unreachable[z] = true
	}
}

// Calls is how many requests of method arrived (throttled, failed and refused ones included, those without
// the right token not).
func (s *Server) Calls(method string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.calls[method]
}

// Requests returns the query parameters of every request of method, in order of arrival.
func (s *Server) Requests(method string) []url.Values {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]url.Values, len(s.requests[method]))
	for i, v := range s.requests[method] {
		out[i] = cloneValues(v)
	}
	return out
}

// Faults is how many requests were answered with a fault (FailNext, ThrottleEvery, ThrottleFraction).
func (s *Server) Faults() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.faults
}

// FailNext answers the next n requests (of any method) with f.
func (s *Server) FailNext(n int, f Fault) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.faultNext, s.faultKind = n, f
}

// ThrottleEvery answers every nth request (counting every request that arrives) as throttled, 403
// rateLimitExceeded and 429 in turn; 0 stops it.
func (s *Server) ThrottleEvery(n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.every = n
}

// apiError is an error in Google's shape.
type apiError struct {
	code    int
	status  string // google.rpc code name
	domain  string
	reason  string
	message string
}

func (e *apiError) write(w http.ResponseWriter) {
	type item struct {
		Message string `json:"message"`
		Domain  string `json:"domain"`
		Reason  string `json:"reason"`
	}
	type body struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
		Errors  []item `json:"errors"`
		Status  string `json:"status,omitempty"`
	}
	writeJSON(w, e.code, map[string]body{"error": {
		Code: e.code, Message: e.message, Status: e.status,
		Errors: []item{{Message: e.message, Domain: e.domain, Reason: e.reason}},
	}})
}

func notFound(resource string) *apiError {
	return &apiError{http.StatusNotFound, "NOT_FOUND", "global", "notFound", fmt.Sprintf("The resource '%s' was not found", resource)}
}

func invalid(field, value, why string) *apiError {
	return &apiError{http.StatusBadRequest, "INVALID_ARGUMENT", "global", "invalid",
		fmt.Sprintf("Invalid value for field '%s': '%s'. %s", field, value, why)}
}

func (s *Server) faultError(f Fault) *apiError {
	switch f {
	case RateLimited:
		return &apiError{http.StatusForbidden, "PERMISSION_DENIED", "usageLimits", "rateLimitExceeded",
			"Quota exceeded for quota metric 'Read requests' and limit 'Read requests per minute' of service 'compute.googleapis.com' for consumer 'project_number:123456789012'."}
	case TooManyRequests:
		return &apiError{http.StatusTooManyRequests, "RESOURCE_EXHAUSTED", "usageLimits", "rateLimitExceeded",
			"Quota exceeded for quota metric 'Read requests' and limit 'Read requests per minute per region' of service 'compute.googleapis.com' for consumer 'project_number:123456789012'."}
	}
	return &apiError{http.StatusServiceUnavailable, "UNAVAILABLE", "global", "backendError", "Internal error. Please try again."}
}

// route is a request's method and path parameters.
type route struct {
	method   string
	project  string
	location string // zone or region
	resource string // instance or group
}

var (
	aggregatedPath = regexp.MustCompile(`^projects/([^/]+)/aggregated/instances$`)
	identityPath   = regexp.MustCompile(`^projects/([^/]+)/zones/([^/]+)/instances/([^/]+)/getShieldedInstanceIdentity$`)
	zonalMIGPath   = regexp.MustCompile(`^projects/([^/]+)/zones/([^/]+)/instanceGroupManagers/([^/]+)/listManagedInstances$`)
	regionMIGPath  = regexp.MustCompile(`^projects/([^/]+)/regions/([^/]+)/instanceGroupManagers/([^/]+)/listManagedInstances$`)
)

func parseRoute(r *http.Request) (route, bool) {
	path, ok := strings.CutPrefix(r.URL.Path, BasePath)
	if !ok {
		return route{}, false
	}
	for _, p := range []struct {
		re     *regexp.Regexp
		verb   string
		method string
	}{
		{aggregatedPath, http.MethodGet, AggregatedList},
		{identityPath, http.MethodGet, GetShieldedInstanceIdentity},
		{zonalMIGPath, http.MethodPost, ListManagedInstances},
		{regionMIGPath, http.MethodPost, RegionListManagedInstances},
	} {
		m := p.re.FindStringSubmatch(path)
		if m == nil || r.Method != p.verb {
			continue
		}
		rt := route{method: p.method, project: m[1]}
		if len(m) > 2 {
			rt.location, rt.resource = m[2], m[3]
		}
		return rt, true
	}
	return route{}, false
}

func (s *Server) serve(w http.ResponseWriter, r *http.Request) {
	rt, ok := parseRoute(r)
	if !ok {
		// Compute Engine answers unknown paths and methods 404, in its own shape.
		notFound(strings.TrimPrefix(r.URL.Path, BasePath)).write(w)
		return
	}
	if s.token != "" && r.Header.Get("Authorization") != "Bearer "+s.token {
		(&apiError{http.StatusUnauthorized, "UNAUTHENTICATED", "global", "required",
			"Request is missing required authentication credential. Expected OAuth 2 access token, login cookie or other valid authentication credential."}).write(w)
		return
	}
	query := r.URL.Query()

	throttled, denied, wait := s.Arrived(rt.method)
	s.mu.Lock()
	s.total++
	s.calls[rt.method]++
	s.requests[rt.method] = append(s.requests[rt.method], cloneValues(query))
	var fault Fault
	switch {
	case s.faultNext > 0:
		s.faultNext--
		fault = s.faultKind
	case s.every > 0 && s.total%s.every == 0:
		fault = RateLimited
		if (s.total/s.every)%2 == 0 {
			fault = TooManyRequests
		}
	case throttled:
		fault = RateLimited
		if mrand.IntN(2) == 0 {
			fault = TooManyRequests
		}
	}
	if fault != 0 {
		s.faults++
	}
	s.mu.Unlock()
	wait()
	switch {
	case fault != 0:
		s.faultError(fault).write(w)
		return
	case rt.project != s.Project:
		notFound("projects/" + rt.project).write(w)
		return
	case denied:
		resource := "projects/" + rt.project
		if rt.location != "" {
			resource = fmt.Sprintf("projects/%s/%s/%s", rt.project, scopeKind(rt), rt.location)
		}
		(&apiError{http.StatusForbidden, "PERMISSION_DENIED", "global", "forbidden",
			fmt.Sprintf("Required '%s' permission for '%s'", permissions[rt.method], resource)}).write(w)
		return
	}

	var (
		body any
		aerr *apiError
	)
	switch rt.method {
	case AggregatedList:
		body, aerr = s.aggregatedList(query)
	case GetShieldedInstanceIdentity:
		body, aerr = s.shieldedIdentity(rt)
	default:
		body, aerr = s.listManagedInstances(rt, query)
	}
	if aerr != nil {
		aerr.write(w)
		return
	}
	writeJSON(w, http.StatusOK, body)
}

func scopeKind(rt route) string {
	if rt.method == RegionListManagedInstances {
		return "regions"
	}
	return "zones"
}

// filter is one expression of Compute Engine's list filter syntax, on status or name:
// "status = RUNNING", "name != x", "(status eq RUNNING)". eq and ne take regular expressions, matched
// against the whole value.
type filter struct {
	field  string
	negate bool
	match  func(string) bool
}

var filterPattern = regexp.MustCompile(`^\(?\s*(status|name)\s*(=|!=|eq|ne)\s*(?:"([^"]*)"|'([^']*)'|([^\s()"']+))\s*\)?$`)

func parseFilter(expr string) (*filter, *apiError) {
	expr = strings.TrimSpace(expr)
	if expr == "" {
		return nil, nil
	}
	m := filterPattern.FindStringSubmatch(expr)
	if m == nil {
		return nil, invalid("filter", expr, "Invalid list filter expression.")
	}
	value := m[3] + m[4] + m[5]
	f := &filter{field: m[1], negate: m[2] == "!=" || m[2] == "ne"}
	if m[2] == "eq" || m[2] == "ne" {
		re, err := regexp.Compile("^(?:" + value + ")$")
		if err != nil {
			return nil, invalid("filter", expr, "Invalid regular expression.")
		}
		f.match = re.MatchString
	} else {
		f.match = func(v string) bool { return v == value }
	}
	return f, nil
}

func (f *filter) keep(inst *Instance) bool {
	if f == nil {
		return true
	}
	v := inst.Name
	if f.field == "status" {
		v = inst.status()
	}
	return f.match(v) != f.negate
}

func (inst *Instance) status() string {
	if inst.Status == "" {
		return "RUNNING"
	}
	return inst.Status
}

func parseMaxResults(query url.Values) (int, *apiError) {
	v := query.Get("maxResults")
	if v == "" {
		return MaxResults, nil
	}
	n, err := strconv.Atoi(v)
	switch {
	case err != nil || n < 0:
		return 0, invalid("maxResults", v, "Must be a non-negative integer.")
	case n > MaxResults:
		return 0, invalid("maxResults", v, fmt.Sprintf("Must be less than or equal to %d", MaxResults))
	case n == 0:
		return MaxResults, nil
	}
	return n, nil
}

// pageOffset reads pageToken, valid only for the query that made it.
func (s *Server) pageOffset(query url.Values, sig string) (int, *apiError) {
	tok := query.Get("pageToken")
	if tok == "" {
		return 0, nil
	}
	pt, ok := s.tokens[tok]
	if !ok || pt.query != sig {
		return 0, invalid("pageToken", tok, "Invalid page token.")
	}
	return pt.offset, nil
}

func (s *Server) newPageToken(offset int, sig string) string {
	var b [24]byte
	_, _ = rand.Read(b[:])
	tok := base64.RawURLEncoding.EncodeToString(b[:])
	s.tokens[tok] = pageToken{offset: offset, query: sig}
	return tok
}

func (s *Server) aggregatedList(query url.Values) (any, *apiError) {
	f, aerr := parseFilter(query.Get("filter"))
	if aerr != nil {
		return nil, aerr
	}
	maxResults, aerr := parseMaxResults(query)
	if aerr != nil {
		return nil, aerr
	}
	partial := query.Get("returnPartialSuccess") == "true"
	sig := "aggregated|" + query.Get("filter") + "|" + strconv.FormatBool(partial)

	s.mu.Lock()
	defer s.mu.Unlock()
	offset, aerr := s.pageOffset(query, sig)
	if aerr != nil {
		return nil, aerr
	}
	var unreachable []string
	for z := range s.unreachable {
		unreachable = append(unreachable, z)
	}
	slices.Sort(unreachable)
	if len(unreachable) > 0 && !partial {
		return nil, &apiError{http.StatusServiceUnavailable, "UNAVAILABLE", "global", "backendError",
			fmt.Sprintf("The zone 'projects/%s/zones/%s' is currently unavailable.", s.Project, unreachable[0])}
	}
	zones := map[string]bool{}
	var matched []*Instance
	for _, inst := range s.instances {
		zones[inst.Zone] = true
		if !s.unreachable[inst.Zone] && f.keep(inst) {
			matched = append(matched, inst)
		}
	}
	slices.SortFunc(matched, func(a, b *Instance) int {
		return strings.Compare(a.Zone+"/"+a.Name, b.Zone+"/"+b.Name)
	})
	offset = min(offset, len(matched))
	page := matched[offset:]
	resp := aggregatedListJSON{
		Kind:     "compute#instanceAggregatedList",
		ID:       "projects/" + s.Project + "/aggregated/instances",
		Items:    map[string]scopedListJSON{},
		SelfLink: selfLinkBase + "projects/" + s.Project + "/aggregated/instances",
	}
	if len(page) > maxResults {
		page = page[:maxResults]
		resp.NextPageToken = s.newPageToken(offset+maxResults, sig)
	}
	for _, inst := range page {
		scope := "zones/" + inst.Zone
		l := resp.Items[scope]
		l.Instances = append(l.Instances, s.instanceJSON(inst))
		resp.Items[scope] = l
	}
	for z := range zones {
		scope := "zones/" + z
		if _, ok := resp.Items[scope]; ok {
			continue
		}
		w := &warningJSON{Code: "NO_RESULTS_ON_PAGE", Message: fmt.Sprintf("There are no results for scope '%s' on this page.", scope),
			Data: []warningDataJSON{{Key: "scope", Value: scope}}}
		if s.unreachable[z] {
			w = &warningJSON{Code: "UNREACHABLE", Message: fmt.Sprintf("Scope '%s' is unreachable.", scope),
				Data: []warningDataJSON{{Key: "scope", Value: scope}}}
		}
		resp.Items[scope] = scopedListJSON{Warning: w}
	}
	for _, z := range unreachable {
		resp.Unreachables = append(resp.Unreachables, "zones/"+z)
	}
	return resp, nil
}

func (s *Server) networkLink(network string) string {
	if strings.HasPrefix(network, "projects/") {
		return selfLinkBase + network
	}
	return selfLinkBase + "projects/" + s.Project + "/global/networks/" + network
}

func (s *Server) instanceJSON(inst *Instance) instanceJSON {
	zoneLink := selfLinkBase + "projects/" + s.Project + "/zones/" + inst.Zone
	region := inst.Zone[:strings.LastIndexByte(inst.Zone, '-')]
	out := instanceJSON{
		Kind:              "compute#instance",
		ID:                strconv.FormatUint(inst.ID, 10),
		CreationTimestamp: "2026-01-05T09:12:44.305-08:00",
		Name:              inst.Name,
		MachineType:       zoneLink + "/machineTypes/n2d-standard-2",
		Status:            inst.status(),
		Zone:              zoneLink,
		SelfLink:          zoneLink + "/instances/" + inst.Name,
		Metadata:          metadataJSON{Kind: "compute#metadata", Fingerprint: "9hQk0yzWg2c="},
		ShieldedInstanceConfig: shieldedConfigJSON{
			EnableSecureBoot: false, EnableVtpm: inst.Identity != nil, EnableIntegrityMonitoring: inst.Identity != nil,
		},
	}
	for i, nic := range inst.NICs {
		n := nicJSON{
			Kind:        "compute#networkInterface",
			Name:        "nic" + strconv.Itoa(i),
			Network:     s.networkLink(nic.Network),
			Subnetwork:  selfLinkBase + "projects/" + s.Project + "/regions/" + region + "/subnetworks/" + lastSegment(nic.Network),
			StackType:   "IPV4_ONLY",
			Fingerprint: "Q2M1zUJ5lVU=",
		}
		if nic.IP.IsValid() {
			n.NetworkIP = nic.IP.String()
		}
		out.NetworkInterfaces = append(out.NetworkInterfaces, n)
	}
	md := map[string]string{}
	if inst.Group != "" {
		md["created-by"] = s.groupPath(inst.Group)
	}
	for k, v := range inst.Metadata {
		md[k] = v
	}
	for _, k := range slices.Sorted(maps.Keys(md)) {
		out.Metadata.Items = append(out.Metadata.Items, metadataItemJSON{Key: k, Value: md[k]})
	}
	return out
}

// groupPath is a group's path as created-by names it (Compute Engine writes the project's number there;
// the endpoint has none and writes its id).
func (s *Server) groupPath(key string) string {
	location, name, zonal, err := parseGroupKey(key)
	if err != nil {
		return key
	}
	scope := "regions"
	if zonal {
		scope = "zones"
	}
	return "projects/" + s.Project + "/" + scope + "/" + location + "/instanceGroupManagers/" + name
}

func (s *Server) shieldedIdentity(rt route) (any, *apiError) {
	s.mu.Lock()
	defer s.mu.Unlock()
	resource := "projects/" + rt.project + "/zones/" + rt.location + "/instances/" + rt.resource
	inst := s.instances[rt.location+"/"+rt.resource]
	if inst == nil {
		// The instance parameter is a name or a numeric id.
		if id, err := strconv.ParseUint(rt.resource, 10, 64); err == nil {
			for _, cand := range s.instances {
				if cand.Zone == rt.location && cand.ID == id {
					inst = cand
				}
			}
		}
	}
	if inst == nil {
		return nil, notFound(resource)
	}
	out := shieldedIdentityJSON{Kind: "compute#shieldedInstanceIdentity"}
	if id := inst.Identity; id != nil {
		if id.EKPub != "" || id.EKCert != "" {
			out.EncryptionKey = &identityEntryJSON{EKPub: id.EKPub, EKCert: id.EKCert}
		}
		if id.AKPub != "" || id.AKCert != "" {
			out.SigningKey = &identityEntryJSON{EKPub: id.AKPub, EKCert: id.AKCert}
		}
	}
	return out, nil
}

func (s *Server) listManagedInstances(rt route, query url.Values) (any, *apiError) {
	key := rt.location + "/" + rt.resource
	sig := "managed|" + key
	scope := "zones"
	if rt.method == RegionListManagedInstances {
		scope = "regions"
	}
	resource := "projects/" + rt.project + "/" + scope + "/" + rt.location + "/instanceGroupManagers/" + rt.resource
	_, _, zonal, err := parseGroupKey(key)
	if err != nil || zonal != (scope == "zones") {
		return nil, notFound(resource)
	}

	s.mu.Lock()
	defer s.mu.Unlock()
	g, exists := s.groups[key]
	var members []*Instance
	for _, inst := range s.instances {
		if inst.Group == key {
			exists = true
			members = append(members, inst)
		}
	}
	if !exists {
		return nil, notFound(resource)
	}
	slices.SortFunc(members, func(a, b *Instance) int { return strings.Compare(a.Zone+"/"+a.Name, b.Zone+"/"+b.Name) })
	resp := managedListJSON{}
	if g.Paginated {
		maxResults, aerr := parseMaxResults(query)
		if aerr != nil {
			return nil, aerr
		}
		offset, aerr := s.pageOffset(query, sig)
		if aerr != nil {
			return nil, aerr
		}
		members = members[min(offset, len(members)):]
		if len(members) > maxResults {
			members = members[:maxResults]
			resp.NextPageToken = s.newPageToken(offset+maxResults, sig)
		}
	}
	for _, inst := range members {
		action := "NONE"
		switch inst.status() {
		case "STAGING", "PROVISIONING":
			action = "CREATING"
		case "STOPPING", "TERMINATED":
			action = "RECREATING"
		}
		resp.ManagedInstances = append(resp.ManagedInstances, managedInstanceJSON{
			Instance:       selfLinkBase + "projects/" + s.Project + "/zones/" + inst.Zone + "/instances/" + inst.Name,
			ID:             strconv.FormatUint(inst.ID, 10),
			InstanceStatus: inst.status(),
			CurrentAction:  action,
			Name:           inst.Name,
			Version:        &versionJSON{InstanceTemplate: selfLinkBase + "projects/" + s.Project + "/global/instanceTemplates/" + rt.resource + "-template"},
		})
	}
	return resp, nil
}

// The JSON shapes of the Compute Engine API reference, the fields the endpoint fills.

type aggregatedListJSON struct {
	Kind          string                    `json:"kind"`
	ID            string                    `json:"id"`
	Items         map[string]scopedListJSON `json:"items"`
	NextPageToken string                    `json:"nextPageToken,omitempty"`
	SelfLink      string                    `json:"selfLink"`
	Unreachables  []string                  `json:"unreachables,omitempty"`
}

type scopedListJSON struct {
	Instances []instanceJSON `json:"instances,omitempty"`
	Warning   *warningJSON   `json:"warning,omitempty"`
}

type warningJSON struct {
	Code    string            `json:"code"`
	Message string            `json:"message"`
	Data    []warningDataJSON `json:"data,omitempty"`
}

type warningDataJSON struct {
	Key   string `json:"key"`
	Value string `json:"value"`
}

type instanceJSON struct {
	Kind                   string             `json:"kind"`
	ID                     string             `json:"id"`
	CreationTimestamp      string             `json:"creationTimestamp"`
	Name                   string             `json:"name"`
	MachineType            string             `json:"machineType"`
	Status                 string             `json:"status"`
	Zone                   string             `json:"zone"`
	NetworkInterfaces      []nicJSON          `json:"networkInterfaces"`
	Metadata               metadataJSON       `json:"metadata"`
	ShieldedInstanceConfig shieldedConfigJSON `json:"shieldedInstanceConfig"`
	SelfLink               string             `json:"selfLink"`
}

type nicJSON struct {
	Kind        string `json:"kind"`
	Name        string `json:"name"`
	Network     string `json:"network"`
	Subnetwork  string `json:"subnetwork"`
	NetworkIP   string `json:"networkIP,omitempty"`
	StackType   string `json:"stackType"`
	Fingerprint string `json:"fingerprint"`
}

type metadataJSON struct {
	Kind        string             `json:"kind"`
	Fingerprint string             `json:"fingerprint"`
	Items       []metadataItemJSON `json:"items,omitempty"`
}

type metadataItemJSON struct {
	Key   string `json:"key"`
	Value string `json:"value"`
}

type shieldedConfigJSON struct {
	EnableSecureBoot          bool `json:"enableSecureBoot"`
	EnableVtpm                bool `json:"enableVtpm"`
	EnableIntegrityMonitoring bool `json:"enableIntegrityMonitoring"`
}

type shieldedIdentityJSON struct {
	Kind          string             `json:"kind"`
	EncryptionKey *identityEntryJSON `json:"encryptionKey,omitempty"`
	SigningKey    *identityEntryJSON `json:"signingKey,omitempty"`
}

type identityEntryJSON struct {
	EKPub  string `json:"ekPub,omitempty"`
	EKCert string `json:"ekCert,omitempty"`
}

type managedListJSON struct {
	ManagedInstances []managedInstanceJSON `json:"managedInstances,omitempty"`
	NextPageToken    string                `json:"nextPageToken,omitempty"`
}

type managedInstanceJSON struct {
	Instance       string       `json:"instance"`
	ID             string       `json:"id"`
	InstanceStatus string       `json:"instanceStatus"`
	CurrentAction  string       `json:"currentAction"`
	Name           string       `json:"name"`
	Version        *versionJSON `json:"version,omitempty"`
}

type versionJSON struct {
	InstanceTemplate string `json:"instanceTemplate"`
}

func writeJSON(w http.ResponseWriter, status int, body any) {
	out, err := json.Marshal(body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json; charset=UTF-8")
	w.WriteHeader(status)
	_, _ = w.Write(out)
}

func lastSegment(s string) string {
	return s[strings.LastIndexByte(s, '/')+1:]
}

func cloneValues(v url.Values) url.Values {
	c := make(url.Values, len(v))
	for k, vals := range v {
		c[k] = slices.Clone(vals)
	}
	return c
}
