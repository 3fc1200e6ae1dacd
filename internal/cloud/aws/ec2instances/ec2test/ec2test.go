// Package ec2test is a local Amazon EC2 endpoint for tests. It speaks EC2's own wire format, the EC2 Query
// protocol (form-encoded requests with Action and Version, XML answers in the shapes of the EC2 API
// reference, EC2's error document), so that tests drive the official SDK, with its serializers,
// deserializers and retryer, exactly as against AWS.
//
// It serves DescribeInstances (filters applied for real, with pagination), DescribeAvailabilityZones,
// DescribeInstanceTopology and GetInstanceTpmEkPub (what Berth and the AWS cloud controller manager's node
// controllers call), holds the instances a test puts in it, counts calls per action, and can throttle, deny
// or hold calls. It is a test harness: no program may import it.
package ec2test

import (
	"cmp"
	"crypto/rand"
	"crypto/tls"
	"encoding/base64"
	"encoding/hex"
	"encoding/xml"
	"fmt"
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

// APIVersion is the EC2 API version the SDK sends.
const APIVersion = "2016-11-15"

const xmlns = "http://ec2.amazonaws.com/doc/" + APIVersion + "/"

// Actions this endpoint serves.
const (
	DescribeInstances         = "DescribeInstances"
	DescribeAvailabilityZones = "DescribeAvailabilityZones"
	DescribeInstanceTopology  = "DescribeInstanceTopology"
	GetInstanceTpmEkPub       = "GetInstanceTpmEkPub"
)

// Zones are the availability zones of the endpoint's region, with their zone ids (which differ between
// accounts on AWS).
var Zones = []struct{ Name, ID string }{
	{"us-east-1a", "use1-az4"}, {"us-east-1b", "use1-az6"}, {"us-east-1c", "use1-az1"},
}

// Limits EC2 applies to DescribeInstances.
const (
	MaxFilterValues = 200
	MinResults      = 5
	MaxResults      = 1000
)

// NoTPMCode is the error code GetInstanceTpmEkPub answers for an instance without an EK. EC2's documentation
// names none; this is EC2's code for operations a resource does not support.
const NoTPMCode = "UnsupportedOperation"

// Instance is an EC2 instance as the endpoint reports it.
type Instance struct {
	ID      string // i-…
	ImageID string // ami-…
	// State is the instance state name (pending, running, stopping, stopped, shutting-down, terminated);
	// empty means running.
	State    string
	VPCID    string
	SubnetID string
	// Zone is the instance's availability zone, one of Zones; empty means the first.
	Zone           string
	PrivateDNSName string
	// Interfaces are the private IPv4 addresses of the instance's network interfaces, by device index; the
	// first address of each is the interface's primary address, and the first interface's primary address
	// is the instance's.
	Interfaces [][]netip.Addr
	Tags       map[string]string
	// EK is the DER SubjectPublicKeyInfo GetInstanceTpmEkPub answers for KeyType rsa-2048; nil for an
	// instance without NitroTPM.
	EK []byte
	// EKKeyValue, if set, is sent as keyValue verbatim instead of EK's base64 (to send broken answers).
	EKKeyValue string
}

// Server is the endpoint. Its methods are safe for concurrent use.
type Server struct {
	// URL is the endpoint to give the SDK as BaseEndpoint.
	URL string
	// Region is the region requests must be signed for.
	Region string
	// CACertPEM is the CA of the endpoint's certificate, with Options.TLS; nil for plain http.
	CACertPEM []byte

	// Knobs throttle a share of requests (RequestLimitExceeded), deny actions (UnauthorizedOperation) and
	// hold requests.
	apifault.Knobs

	srv *httptest.Server

	mu        sync.Mutex
	instances map[string]Instance
	calls     map[string]int
	requests  map[string][]url.Values
	throttle  int
	throttled int
	tokens    map[string]pageToken
	keyIDs    map[string]bool
}

type pageToken struct {
	offset int
	query  string // the request's filters, which the token is valid for
}

// New starts an endpoint for region us-east-1 on loopback, plain http, that t closes when it ends.
func New(t testing.TB) *Server {
	t.Helper()
	return NewWithOptions(t, Options{})
}

// Options say where and how an endpoint serves.
type Options struct {
	// Addr is the address to listen on, such as a lab bridge's "10.250.0.1:7460"; a free port on 127.0.0.1
	// when empty.
	Addr string
	// TLS serves https, as EC2 does, with a certificate for Addr's host from a CA of the endpoint's own
	// (CACertPEM), which clients trust (the SDK through AWS_CA_BUNDLE). The SDK's clients, like Berth's,
	// refuse plain http to anything but loopback.
	TLS bool
}

// NewWithOptions starts an endpoint for region us-east-1 as o says, which t closes when it ends.
func NewWithOptions(t testing.TB, o Options) *Server {
	t.Helper()
	s, err := Start(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

// Start starts an endpoint for region us-east-1 as o says, for holders that are not a test themselves
// (a lab, which a test or a command keeps up); Close stops it.
func Start(o Options) (*Server, error) {
	s := &Server{
		Region:    "us-east-1",
		instances: map[string]Instance{},
		calls:     map[string]int{},
		requests:  map[string][]url.Values{},
		tokens:    map[string]pageToken{},
		keyIDs:    map[string]bool{},
	}
	s.srv = httptest.NewUnstartedServer(http.HandlerFunc(s.serve))
	if o.Addr != "" {
		ln, err := net.Listen("tcp", o.Addr)
		if err != nil {
			s.srv.Close()
			return nil, fmt.Errorf("ec2test: %w", err)
		}
		s.srv.Listener.Close()
		s.srv.Listener = ln
	}
	if !o.TLS {
		s.srv.Start()
		s.URL = s.srv.URL
		return s, nil
	}
	host, _, err := net.SplitHostPort(s.srv.Listener.Addr().String())
	if err != nil {
		s.srv.Close()
		return nil, fmt.Errorf("ec2test: %w", err)
	}
	cert, caPEM, err := tlstest.ServerCertificate(host, "ec2test CA")
	if err != nil {
		s.srv.Close()
		return nil, fmt.Errorf("ec2test: %w", err)
	}
	s.CACertPEM = caPEM
	s.srv.TLS = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	s.srv.StartTLS()
	s.URL = s.srv.URL
	return s, nil
}

// Close stops the endpoint; requests held (Hold) are released first, for Close waits for every request.
func (s *Server) Close() {
	s.Release()
	s.srv.Close()
}

// AccessKeyIDs are the access key ids that signed the requests so far, sorted: who called.
func (s *Server) AccessKeyIDs() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]string, 0, len(s.keyIDs))
	for id := range s.keyIDs {
		out = append(out, id)
	}
	slices.Sort(out)
	return out
}

// Put adds instances, replacing those with the same ids.
func (s *Server) Put(instances ...Instance) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, inst := range instances {
		inst.Interfaces = slices.Clone(inst.Interfaces)
		s.instances[inst.ID] = inst
	}
}

// SetState gives the instance with this id the state name (running, stopped, terminated, …), as EC2 does
// when it is started, stopped or terminated; it reports whether the endpoint has the instance.
func (s *Server) SetState(id, state string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	inst, ok := s.instances[id]
	if ok {
		inst.State = state
		s.instances[id] = inst
	}
	return ok
}

// Remove deletes the instances with these ids.
func (s *Server) Remove(ids ...string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, id := range ids {
		delete(s.instances, id)
	}
}

// Calls is how many requests of action arrived, throttled and refused ones included.
func (s *Server) Calls(action string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.calls[action]
}

// Requests returns the parameters of every request of action, in order of arrival.
func (s *Server) Requests(action string) []url.Values {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]url.Values, len(s.requests[action]))
	for i, v := range s.requests[action] {
		out[i] = cloneValues(v)
	}
	return out
}

// Throttled is how many requests were answered RequestLimitExceeded.
func (s *Server) Throttled() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.throttled
}

// ThrottleNext answers the next n requests (of any action) with RequestLimitExceeded.
func (s *Server) ThrottleNext(n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.throttle = n
}

// apiError is an error in EC2's shape.
type apiError struct {
	status  int
	code    string
	message string
}

func invalidParameter(format string, args ...any) *apiError {
	return &apiError{http.StatusBadRequest, "InvalidParameterValue", fmt.Sprintf(format, args...)}
}

// Credential scope of a SigV4 Authorization header: AKID/date/region/service/aws4_request.
var credentialScope = regexp.MustCompile(`^AWS4-HMAC-SHA256 Credential=([^/,]+)/\d{8}/([^/,]+)/([^/,]+)/aws4_request,`)

func (s *Server) serve(w http.ResponseWriter, r *http.Request) {
	requestID := newRequestID()
	if r.Method != http.MethodPost && r.Method != http.MethodGet {
		writeError(w, requestID, &apiError{http.StatusMethodNotAllowed, "InvalidHttpRequest", "The requested HTTP operation is not supported."})
		return
	}
	r.Body = http.MaxBytesReader(w, r.Body, 1<<20)
	if err := r.ParseForm(); err != nil {
		writeError(w, requestID, &apiError{http.StatusBadRequest, "MalformedQueryString", "The request could not be parsed."})
		return
	}
	form := r.Form
	action := form.Get("Action")

	// Signature checks stop at the scope: a request signed for another region or service is refused as
	// EC2 would, the signature itself is not recomputed.
	m := credentialScope.FindStringSubmatch(r.Header.Get("Authorization"))
	switch {
	case m == nil:
		writeError(w, requestID, &apiError{http.StatusUnauthorized, "AuthFailure", "AWS was not able to validate the provided access credentials"})
		return
	case m[2] != s.Region || m[3] != "ec2":
		writeError(w, requestID, &apiError{http.StatusUnauthorized, "AuthFailure",
			fmt.Sprintf("Credential should be scoped to a valid region and service ec2, not '%s/%s'", m[2], m[3])})
		return
	}

	throttle, denied, wait := s.Arrived(action)
	s.mu.Lock()
	s.keyIDs[m[1]] = true
	s.calls[action]++
	s.requests[action] = append(s.requests[action], cloneValues(form))
	if s.throttle > 0 {
		s.throttle--
		throttle = true
	}
	if throttle {
		s.throttled++
	}
	s.mu.Unlock()
	wait()
	switch {
	case throttle:
		writeError(w, requestID, &apiError{http.StatusServiceUnavailable, "RequestLimitExceeded", "Request limit exceeded."})
		return
	case form.Get("Version") != APIVersion:
		writeError(w, requestID, &apiError{http.StatusBadRequest, "InvalidParameterValue",
			fmt.Sprintf("Invalid API version %q", form.Get("Version"))})
		return
	case !slices.Contains([]string{DescribeInstances, DescribeAvailabilityZones, DescribeInstanceTopology, GetInstanceTpmEkPub}, action):
		writeError(w, requestID, &apiError{http.StatusBadRequest, "InvalidAction",
			fmt.Sprintf("The action %s is not valid for this web service.", action)})
		return
	case denied:
		writeError(w, requestID, &apiError{http.StatusForbidden, "UnauthorizedOperation",
			fmt.Sprintf("You are not authorized to perform this operation. User: arn:aws:sts::123456789012:assumed-role/berth-control-plane/i-0123456789abcdef0 is not authorized to perform: ec2:%s because no identity-based policy allows the ec2:%s action. Encoded authorization failure message: %s",
				action, action, strings.Repeat("AbCd", 300))})
		return
	}

	var (
		body any
		aerr *apiError
	)
	switch action {
	case DescribeInstances:
		body, aerr = s.describeInstances(form, requestID)
	case DescribeAvailabilityZones:
		body, aerr = s.describeAvailabilityZones(form, requestID)
	case DescribeInstanceTopology:
		// EC2 answers no topology for the instance types it has none for, which is every type ec2test reports.
		body = describeInstanceTopologyResponse{Xmlns: xmlns, RequestID: requestID}
	default:
		body, aerr = s.getInstanceTpmEkPub(form, requestID)
	}
	if aerr != nil {
		writeError(w, requestID, aerr)
		return
	}
	writeXML(w, http.StatusOK, body)
}

type filter struct {
	name   string
	values []string
	// The values compiled: plain ones in a set, those with wildcards as expressions.
	exact map[string]bool
	globs []*regexp.Regexp
}

func (f *filter) compile() {
	f.exact = map[string]bool{}
	for _, v := range f.values {
		if strings.ContainsAny(v, `*?\`) {
			f.globs = append(f.globs, globRegexp(v))
		} else {
			f.exact[v] = true
		}
	}
}

func (f *filter) match(v string) bool {
	if f.exact[v] {
		return true
	}
	for _, re := range f.globs {
		if re.MatchString(v) {
			return true
		}
	}
	return false
}

// parseFilters reads Filter.N.Name and Filter.N.Value.M.
func parseFilters(form url.Values) ([]filter, *apiError) {
	byIndex := map[int]*filter{}
	for key, vals := range form {
		rest, ok := strings.CutPrefix(key, "Filter.")
		if !ok {
			continue
		}
		idx, field, _ := strings.Cut(rest, ".")
		n, err := strconv.Atoi(idx)
		if err != nil || n < 1 {
			return nil, invalidParameter("The parameter %s is not recognized", key)
		}
		f := byIndex[n]
		if f == nil {
			f = &filter{}
			byIndex[n] = f
		}
		switch {
		case field == "Name":
			f.name = vals[0]
		case strings.HasPrefix(field, "Value."):
			m, err := strconv.Atoi(strings.TrimPrefix(field, "Value."))
			if err != nil || m < 1 {
				return nil, invalidParameter("The parameter %s is not recognized", key)
			}
			for len(f.values) < m {
				f.values = append(f.values, "")
			}
			f.values[m-1] = vals[0]
		default:
			return nil, invalidParameter("The parameter %s is not recognized", key)
		}
	}
	idxs := make([]int, 0, len(byIndex))
	for i := range byIndex {
		idxs = append(idxs, i)
	}
	slices.Sort(idxs)
	out := make([]filter, 0, len(idxs))
	for _, i := range idxs {
		f := byIndex[i]
		if f.name == "" {
			return nil, invalidParameter("The filter Filter.%d has no name", i)
		}
		if len(f.values) == 0 {
			return nil, invalidParameter("The filter '%s' has no values", f.name)
		}
		if len(f.values) > MaxFilterValues {
			return nil, invalidParameter("The maximum number of filter values specified on a single call is %d", MaxFilterValues)
		}
		f.compile()
		out = append(out, *f)
	}
	return out, nil
}

// fields returns what filter name refers to in inst: the values one of which must match.
func (inst *Instance) fields(name string) ([]string, bool) {
	if key, ok := strings.CutPrefix(name, "tag:"); ok {
		if v, ok := inst.Tags[key]; ok {
			return []string{v}, true
		}
		return nil, true
	}
	switch name {
	case "instance-id":
		return []string{inst.ID}, true
	case "image-id":
		return []string{inst.ImageID}, true
	case "instance-state-name":
		return []string{inst.state()}, true
	case "vpc-id":
		return []string{inst.VPCID}, true
	case "subnet-id":
		return []string{inst.SubnetID}, true
	case "private-dns-name":
		return []string{inst.PrivateDNSName}, true
	case "private-ip-address":
		// EC2: "This can only be used to filter by the primary IP address of the network interface".
		var out []string
		for _, nic := range inst.Interfaces {
			if len(nic) > 0 {
				out = append(out, nic[0].String())
			}
		}
		return out, true
	case "network-interface.addresses.private-ip-address":
		var out []string
		for _, nic := range inst.Interfaces {
			for _, a := range nic {
				out = append(out, a.String())
			}
		}
		return out, true
	case "tag-key":
		out := make([]string, 0, len(inst.Tags))
		for k := range inst.Tags {
			out = append(out, k)
		}
		return out, true
	}
	return nil, false
}

func (inst *Instance) state() string {
	if inst.State == "" {
		return "running"
	}
	return inst.State
}

// globRegexp compiles an EC2 filter value: * is any run of characters, ? one character, \ escapes.
func globRegexp(pattern string) *regexp.Regexp {
	var re strings.Builder
	re.WriteString("^")
	for i := 0; i < len(pattern); i++ {
		switch c := pattern[i]; c {
		case '*':
			re.WriteString(".*")
		case '?':
			re.WriteString(".")
		case '\\':
			if i+1 < len(pattern) {
				i++
				re.WriteString(regexp.QuoteMeta(pattern[i : i+1]))
			}
		default:
			re.WriteString(regexp.QuoteMeta(pattern[i : i+1]))
		}
	}
	re.WriteString("$")
	return regexp.MustCompile(re.String())
}

func (s *Server) describeInstances(form url.Values, requestID string) (any, *apiError) {
	filters, aerr := parseFilters(form)
	if aerr != nil {
		return nil, aerr
	}
	var ids []string
	for key, vals := range form {
		if strings.HasPrefix(key, "InstanceId.") {
			ids = append(ids, vals[0])
		}
	}
	maxResults := 0
	if v := form.Get("MaxResults"); v != "" {
		if len(ids) > 0 {
			return nil, invalidParameter("The parameter instancesSet cannot be used with the parameter maxResults")
		}
		n, err := strconv.Atoi(v)
		if err != nil || n < MinResults || n > MaxResults {
			return nil, invalidParameter("Value ( %s ) for parameter maxResults is invalid. Expecting a value between %d and %d.", v, MinResults, MaxResults)
		}
		maxResults = n
	}
	query := canonicalFilters(filters, ids)

	s.mu.Lock()
	defer s.mu.Unlock()
	offset := 0
	if tok := form.Get("NextToken"); tok != "" {
		pt, ok := s.tokens[tok]
		if !ok || pt.query != query {
			return nil, invalidParameter("The token '%s' is invalid.", tok)
		}
		offset = pt.offset
	}
	for _, f := range filters {
		probe := Instance{}
		if _, ok := probe.fields(f.name); !ok {
			return nil, invalidParameter("The filter '%s' is invalid", f.name)
		}
	}
	all := make([]string, 0, len(s.instances))
	for id := range s.instances {
		all = append(all, id)
	}
	slices.Sort(all)
	var matched []Instance
	for _, id := range all {
		inst := s.instances[id]
		if len(ids) > 0 && !slices.Contains(ids, id) {
			continue
		}
		if matches(&inst, filters) {
			matched = append(matched, inst)
		}
	}
	if len(ids) > 0 {
		for _, id := range ids {
			if _, ok := s.instances[id]; !ok {
				return nil, &apiError{http.StatusBadRequest, "InvalidInstanceID.NotFound", fmt.Sprintf("The instance ID '%s' does not exist", id)}
			}
		}
	}
	if offset > len(matched) {
		offset = len(matched)
	}
	page := matched[offset:]
	resp := describeInstancesResponse{Xmlns: xmlns, RequestID: requestID}
	if maxResults > 0 && len(page) > maxResults {
		page = page[:maxResults]
		tok := newToken()
		s.tokens[tok] = pageToken{offset: offset + maxResults, query: query}
		resp.NextToken = tok
	}
	for _, inst := range page {
		resp.Reservations.Items = append(resp.Reservations.Items, reservationXML{
			ReservationID: "r-" + strings.TrimPrefix(inst.ID, "i-"),
			OwnerID:       "123456789012",
			Instances:     itemsOf(instanceXMLOf(inst)),
		})
	}
	return resp, nil
}

func matches(inst *Instance, filters []filter) bool {
	for _, f := range filters {
		have, _ := inst.fields(f.name)
		if !slices.ContainsFunc(have, f.match) {
			return false
		}
	}
	return true
}

func canonicalFilters(filters []filter, ids []string) string {
	parts := make([]string, 0, len(filters)+1)
	for _, f := range filters {
		vals := slices.Clone(f.values)
		slices.Sort(vals)
		parts = append(parts, f.name+"="+strings.Join(vals, ","))
	}
	slices.Sort(parts)
	ids = slices.Clone(ids)
	slices.Sort(ids)
	return strings.Join(parts, ";") + "|" + strings.Join(ids, ",")
}

// describeAvailabilityZones answers the region's zones, or those of ZoneName.N; filters are not served.
func (s *Server) describeAvailabilityZones(form url.Values, requestID string) (any, *apiError) {
	var names []string
	for key, vals := range form {
		switch {
		case strings.HasPrefix(key, "ZoneName."):
			names = append(names, vals[0])
		case strings.HasPrefix(key, "Filter.") || strings.HasPrefix(key, "ZoneId."):
			return nil, invalidParameter("ec2test serves DescribeAvailabilityZones without filters or zone ids (%s)", key)
		}
	}
	resp := describeAvailabilityZonesResponse{Xmlns: xmlns, RequestID: requestID}
	for _, z := range Zones {
		if len(names) == 0 || slices.Contains(names, z.Name) {
			resp.Zones.Items = append(resp.Zones.Items, zoneXML{ZoneName: z.Name, ZoneID: z.ID, ZoneState: "available",
				ZoneType: "availability-zone", RegionName: s.Region, OptInStatus: "opt-in-not-required"})
		}
	}
	for _, n := range names {
		if !slices.ContainsFunc(Zones, func(z struct{ Name, ID string }) bool { return z.Name == n }) {
			return nil, invalidParameter("The zone '%s' does not exist.", n)
		}
	}
	return resp, nil
}

func (s *Server) getInstanceTpmEkPub(form url.Values, requestID string) (any, *apiError) {
	id, keyType, keyFormat := form.Get("InstanceId"), form.Get("KeyType"), form.Get("KeyFormat")
	switch {
	case id == "":
		return nil, &apiError{http.StatusBadRequest, "MissingParameter", "The request must contain the parameter InstanceId"}
	case keyType != "rsa-2048" && keyType != "ecc-sec-p384":
		return nil, invalidParameter("Value (%s) for parameter KeyType is invalid.", keyType)
	case keyFormat != "der" && keyFormat != "tpmt":
		return nil, invalidParameter("Value (%s) for parameter KeyFormat is invalid.", keyFormat)
	}
	s.mu.Lock()
	inst, ok := s.instances[id]
	s.mu.Unlock()
	switch {
	case !ok:
		return nil, &apiError{http.StatusBadRequest, "InvalidInstanceID.NotFound", fmt.Sprintf("The instance ID '%s' does not exist", id)}
	case inst.EK == nil && inst.EKKeyValue == "":
		return nil, &apiError{http.StatusBadRequest, NoTPMCode, fmt.Sprintf("The instance '%s' does not have NitroTPM enabled.", id)}
	case keyType != "rsa-2048" || keyFormat != "der":
		// The endpoint holds one key per instance, an RSA one in DER.
		return nil, &apiError{http.StatusBadRequest, "UnsupportedOperation", "ec2test serves KeyType rsa-2048, KeyFormat der only."}
	}
	value := inst.EKKeyValue
	if value == "" {
		value = base64.StdEncoding.EncodeToString(inst.EK)
	}
	return getInstanceTpmEkPubResponse{
		Xmlns: xmlns, RequestID: requestID, InstanceID: id, KeyType: keyType, KeyFormat: keyFormat, KeyValue: value,
	}, nil
}

// The XML shapes of the EC2 API reference.

type items[T any] struct {
	Items []T `xml:"item"`
}

func itemsOf[T any](v ...T) items[T] { return items[T]{Items: v} }

type describeInstancesResponse struct {
	XMLName      xml.Name              `xml:"DescribeInstancesResponse"`
	Xmlns        string                `xml:"xmlns,attr"`
	RequestID    string                `xml:"requestId"`
	Reservations items[reservationXML] `xml:"reservationSet"`
	NextToken    string                `xml:"nextToken,omitempty"`
}

type describeAvailabilityZonesResponse struct {
	XMLName   xml.Name       `xml:"DescribeAvailabilityZonesResponse"`
	Xmlns     string         `xml:"xmlns,attr"`
	RequestID string         `xml:"requestId"`
	Zones     items[zoneXML] `xml:"availabilityZoneInfo"`
}

type describeInstanceTopologyResponse struct {
	XMLName   xml.Name      `xml:"DescribeInstanceTopologyResponse"`
	Xmlns     string        `xml:"xmlns,attr"`
	RequestID string        `xml:"requestId"`
	Instances items[string] `xml:"instanceSet"`
}

type zoneXML struct {
	ZoneName    string `xml:"zoneName"`
	ZoneID      string `xml:"zoneId"`
	ZoneState   string `xml:"zoneState"`
	ZoneType    string `xml:"zoneType"`
	RegionName  string `xml:"regionName"`
	OptInStatus string `xml:"optInStatus"`
}

type placementXML struct {
	AvailabilityZone string `xml:"availabilityZone"`
	Tenancy          string `xml:"tenancy"`
}

type reservationXML struct {
	ReservationID string             `xml:"reservationId"`
	OwnerID       string             `xml:"ownerId"`
	Instances     items[instanceXML] `xml:"instancesSet"`
}

type instanceStateXML struct {
	Code int    `xml:"code"`
	Name string `xml:"name"`
}

type tagXML struct {
	Key   string `xml:"key"`
	Value string `xml:"value"`
}

type instanceXML struct {
	InstanceID        string                     `xml:"instanceId"`
	ImageID           string                     `xml:"imageId"`
	State             instanceStateXML           `xml:"instanceState"`
	PrivateDNSName    string                     `xml:"privateDnsName"`
	InstanceType      string                     `xml:"instanceType"`
	Placement         placementXML               `xml:"placement"`
	PrivateIPAddress  string                     `xml:"privateIpAddress,omitempty"`
	SubnetID          string                     `xml:"subnetId,omitempty"`
	VPCID             string                     `xml:"vpcId,omitempty"`
	Tags              items[tagXML]              `xml:"tagSet"`
	NetworkInterfaces items[networkInterfaceXML] `xml:"networkInterfaceSet"`
	BootMode          string                     `xml:"bootMode"`
	TpmSupport        string                     `xml:"tpmSupport,omitempty"`
}

type attachmentXML struct {
	AttachmentID     string `xml:"attachmentId"`
	DeviceIndex      int    `xml:"deviceIndex"`
	NetworkCardIndex int    `xml:"networkCardIndex"`
	Status           string `xml:"status"`
}

type privateIPXML struct {
	PrivateIPAddress string `xml:"privateIpAddress"`
	Primary          bool   `xml:"primary"`
}

type networkInterfaceXML struct {
	NetworkInterfaceID string              `xml:"networkInterfaceId"`
	SubnetID           string              `xml:"subnetId,omitempty"`
	VPCID              string              `xml:"vpcId,omitempty"`
	Status             string              `xml:"status"`
	PrivateIPAddress   string              `xml:"privateIpAddress"`
	Attachment         attachmentXML       `xml:"attachment"`
	PrivateIPAddresses items[privateIPXML] `xml:"privateIpAddressesSet"`
}

type getInstanceTpmEkPubResponse struct {
	XMLName    xml.Name `xml:"GetInstanceTpmEkPubResponse"`
	Xmlns      string   `xml:"xmlns,attr"`
	RequestID  string   `xml:"requestId"`
	InstanceID string   `xml:"instanceId"`
	KeyType    string   `xml:"keyType"`
	KeyFormat  string   `xml:"keyFormat"`
	KeyValue   string   `xml:"keyValue"`
}

type errorResponse struct {
	XMLName   xml.Name `xml:"Response"`
	Errors    []errXML `xml:"Errors>Error"`
	RequestID string   `xml:"RequestID"`
}

type errXML struct {
	Code    string `xml:"Code"`
	Message string `xml:"Message"`
}

var stateCodes = map[string]int{
	"pending": 0, "running": 16, "shutting-down": 32, "terminated": 48, "stopping": 64, "stopped": 80,
}

func instanceXMLOf(inst Instance) instanceXML {
	x := instanceXML{
		InstanceID:     inst.ID,
		ImageID:        inst.ImageID,
		State:          instanceStateXML{Code: stateCodes[inst.state()], Name: inst.state()},
		PrivateDNSName: inst.PrivateDNSName,
		InstanceType:   "m7i.large",
		Placement:      placementXML{AvailabilityZone: cmp.Or(inst.Zone, Zones[0].Name), Tenancy: "default"},
		SubnetID:       inst.SubnetID,
		VPCID:          inst.VPCID,
		BootMode:       "uefi",
	}
	if inst.EK != nil || inst.EKKeyValue != "" {
		x.TpmSupport = "v2.0"
	}
	keys := make([]string, 0, len(inst.Tags))
	for k := range inst.Tags {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		x.Tags.Items = append(x.Tags.Items, tagXML{Key: k, Value: inst.Tags[k]})
	}
	suffix := strings.TrimPrefix(inst.ID, "i-")
	for i, addrs := range inst.Interfaces {
		if len(addrs) == 0 {
			continue
		}
		nic := networkInterfaceXML{
			NetworkInterfaceID: fmt.Sprintf("eni-%s%d", suffix, i),
			SubnetID:           inst.SubnetID,
			VPCID:              inst.VPCID,
			Status:             "in-use",
			PrivateIPAddress:   addrs[0].String(),
			Attachment:         attachmentXML{AttachmentID: fmt.Sprintf("eni-attach-%s%d", suffix, i), DeviceIndex: i, Status: "attached"},
		}
		for j, a := range addrs {
			nic.PrivateIPAddresses.Items = append(nic.PrivateIPAddresses.Items, privateIPXML{PrivateIPAddress: a.String(), Primary: j == 0})
		}
		if i == 0 {
			x.PrivateIPAddress = addrs[0].String()
		}
		x.NetworkInterfaces.Items = append(x.NetworkInterfaces.Items, nic)
	}
	return x
}

func writeXML(w http.ResponseWriter, status int, body any) {
	out, err := xml.Marshal(body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/xml;charset=UTF-8")
	w.WriteHeader(status)
	_, _ = w.Write([]byte(xml.Header))
	_, _ = w.Write(out)
}

func writeError(w http.ResponseWriter, requestID string, e *apiError) {
	writeXML(w, e.status, errorResponse{Errors: []errXML{{Code: e.code, Message: e.message}}, RequestID: requestID})
}

func newRequestID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	h := hex.EncodeToString(b[:])
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}

func newToken() string {
	var b [24]byte
	_, _ = rand.Read(b[:])
	return base64.RawURLEncoding.EncodeToString(b[:])
}

func cloneValues(v url.Values) url.Values {
	c := make(url.Values, len(v))
	for k, vals := range v {
		c[k] = slices.Clone(vals)
	}
	return c
}
