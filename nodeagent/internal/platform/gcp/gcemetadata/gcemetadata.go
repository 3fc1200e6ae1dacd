// Package gcemetadata gives a Berth node on Compute Engine its view of itself from GCE's metadata server:
// its instance id, name and zone, its project, its primary internal address and image, the
// berth-node-config attribute its instance template carries (berth_node_config's json), where it is
// (project, zone, network) and its service account's access tokens.
//
// The node trusts the metadata server for where to go (the join endpoints, the join CA pin, its cluster's
// name) and for who to say it is, because nothing else on a fresh instance knows them. Nothing read here
// grants anything: the join service looks the instance up in the Compute API by the address the node
// connects from, takes its role from the managed instance group that created it and its TPM from the
// Shielded VM identity Compute Engine reports for it, and refuses a node that says otherwise. So this
// package only has to be honest about what it read and clear when it cannot read it: a node that cannot
// read its metadata cannot join, and the operator needs to know why.
//
// Every request carries Metadata-Flavor: Google, which GCE requires so that a server-side request forgery
// on the node (a plain GET it is tricked into) cannot read the metadata, and every answer must carry it
// back: an answer without it is not from GCE's metadata server (another cloud's metadata service at
// 169.254.169.254, a proxy), and nothing in it is believed.
//
// The requests are made here rather than through Google's client (cloud.google.com/go/compute/metadata),
// which reads answers of any size, never checks an answer's Metadata-Flavor, retries on a schedule of its
// own and takes its endpoint only from the process's environment: the few GETs below are bounded in size
// and time, take their endpoint from the agent's configuration, and are not retried here, because the
// agent retries reading its metadata as a whole (metadata.WaitSelf) and logs why each attempt failed.
package gcemetadata

import (
	"bytes"
	"cmp"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/oauth2"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/nodeagent/internal/platform/metadatahttp"
)

// DefaultEndpoint is GCE's metadata server on its link-local address; it also answers as
// http://metadata.google.internal, a name only GCE's DNS resolves.
const DefaultEndpoint = "http://169.254.169.254"

// HostEnv is the environment variable that Google's clients take the metadata server's host[:port] from
// (no scheme). The agent passes its endpoint explicitly (Client.Endpoint); the variable is honoured when it
// does not, so that tools and tests that follow Google's convention reach the same server.
const HostEnv = "GCE_METADATA_HOST"

// NodeConfigKey is the instance metadata key that holds berth_node_config's json; the instance template
// sets it.
const NodeConfigKey = "berth-node-config"

// The paths under /computeMetadata/v1/ that are read.
const (
	pathID         = "instance/id"
	pathName       = "instance/name"
	pathZone       = "instance/zone"
	pathProjectID  = "project/project-id"
	pathIP         = "instance/network-interfaces/0/ip"
	pathNetwork    = "instance/network-interfaces/0/network"
	pathImage      = "instance/image"
	pathNodeConfig = "instance/attributes/" + NodeConfigKey
	pathToken      = "instance/service-accounts/default/token"
)

const (
	flavorHeader = "Metadata-Flavor"
	flavor       = "Google"

	// maxValueSize bounds one value; the values read here are tens of bytes, an image's path a few
	// hundred.
	maxValueSize = 4 << 10
	// maxNodeConfigSize is GCE's limit on one metadata value (256 KB); berth_node_config's json is a
	// few hundred bytes.
	maxNodeConfigSize = 256 << 10
	// maxTokenAnswer bounds the token's JSON; Google's access tokens are at most 2048 bytes.
	maxTokenAnswer = 16 << 10
	// maxExcerpt bounds how much of an error answer's body ends up in an error.
	maxExcerpt = 200

	// defaultTimeout bounds a request whose context has no earlier deadline: the metadata server answers
	// in milliseconds, and a boot that waits on it must not stall when it does not.
	defaultTimeout = 5 * time.Second

	// tokenMargin is how long before its expiry a token is replaced, more than a request that carries it
	// may take. GCE's metadata server replaces the token it hands out minutes before that token's end
	// (Google's own token source counts on four), so asking again within this margin gets a fresh one.
	tokenMargin = time.Minute
	// maxTokenLifetime is far above GCE's tokens (an hour); a longer one is not GCE's, and would overflow
	// a time.Duration if large enough.
	maxTokenLifetime = 24 * time.Hour
)

// Errors an operator acts on differently; every error from this package that is one of them wraps it.
var (
	// ErrUnreachable: no HTTP answer from the endpoint at all (refused, timed out).
	ErrUnreachable = errors.New("GCE metadata server unreachable")
	// ErrNotGCE: the endpoint answered without Metadata-Flavor: Google, so it is not GCE's metadata server.
	ErrNotGCE = errors.New("not GCE's metadata server")
	// ErrNoUserData: the instance has no berth-node-config attribute.
	ErrNoUserData = errors.New("the instance has no " + NodeConfigKey + " attribute")
	// ErrBadUserData: the berth-node-config attribute is not a valid berth_node_config json.
	ErrBadUserData = errors.New("the " + NodeConfigKey + " attribute is not berth_node_config's json")
	// ErrNoServiceAccount: the instance has no service account, so no access token.
	ErrNoServiceAccount = errors.New("the instance has no service account")
)

// errNotDefined is a 404: the metadata server has no such value.
var errNotDefined = errors.New("the metadata server has no such value (404 Not Found)")

// defaultHTTPClient never uses a proxy from the environment (the metadata server is link-local: a proxy
// could only answer in its name, and GCE refuses proxied requests). Its timeout is only a backstop above
// any sane Client.Timeout, which bounds each request.
var defaultHTTPClient = func() *http.Client {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.Proxy = nil
	return &http.Client{Transport: t, Timeout: time.Minute}
}()

// Client reads a node's own record from GCE's metadata server. It is safe for concurrent use; its token
// sources share one cached token.
type Client struct {
	// Endpoint is the metadata server's root, http://host[:port]. When empty it is http://$GCE_METADATA_HOST
	// if that is set, else DefaultEndpoint.
	Endpoint string
	// HTTPClient is used for requests, never following a redirect; nil means one without proxy.
	HTTPClient *http.Client
	// Timeout bounds each request when ctx has no earlier deadline; 5 s when zero.
	Timeout time.Duration
	// Now is the clock a token's expiry is measured by; time.Now when nil.
	Now func() time.Time

	mu         sync.Mutex
	token      *oauth2.Token
	tokenUntil time.Time
}

// Self reads the node's instance record and user-data. The node's name is its instance name, as GKE and
// the GCE cloud provider name nodes; its id is "projects/<project id>/zones/<zone>/instances/<instance id>",
// the form the join service's Compute lookup gives the same instance; its role is the user-data's (one
// instance template per role), worker when it names none.
func (c *Client) Self(ctx context.Context) (*metadata.Self, error) {
	id, err := c.getValue(ctx, pathID)
	if err != nil {
		return nil, err
	}
	if n, err := strconv.ParseUint(id, 10, 64); err != nil || strconv.FormatUint(n, 10) != id {
		return nil, fmt.Errorf("reading %s from the GCE metadata server: %q is not a Compute Engine instance id (a number)", pathID, id)
	}
	name, err := c.getValue(ctx, pathName)
	if err != nil {
		return nil, err
	}
	if !resourceName.MatchString(name) {
		return nil, fmt.Errorf("reading %s from the GCE metadata server: %q is not a Compute Engine instance name (RFC 1035: a lowercase letter, then lowercase letters, digits and hyphens, at most 63)", pathName, name)
	}
	project, zone, _, err := c.projectAndZone(ctx)
	if err != nil {
		return nil, err
	}
	ip, err := c.getValue(ctx, pathIP)
	if err != nil {
		return nil, err
	}
	addr, err := netip.ParseAddr(ip)
	if err != nil || !addr.Is4() {
		return nil, fmt.Errorf("reading %s from the GCE metadata server: %q is not an IPv4 address (the primary network interface's internal one)", pathIP, ip)
	}
	// An instance made from a disk or a snapshot has no image: its image id stays empty.
	image, err := c.get(ctx, pathImage, maxValueSize)
	if err != nil && !errors.Is(err, errNotDefined) {
		return nil, err
	}

	raw, err := c.get(ctx, pathNodeConfig, maxNodeConfigSize)
	if errors.Is(err, errNotDefined) {
		return nil, fmt.Errorf("reading %s from the GCE metadata server: %w: give the instance template the metadata %s = berth_node_config's json",
			pathNodeConfig, ErrNoUserData, NodeConfigKey)
	}
	if err != nil {
		return nil, err
	}
	ud, err := parseUserData(raw)
	if err != nil {
		return nil, fmt.Errorf("reading %s from the GCE metadata server: %w", pathNodeConfig, err)
	}

	inst := metadata.Instance{
		Name:      name,
		Role:      cmp.Or(ud.Role, metadata.RoleWorker),
		Addresses: []netip.Addr{addr},
		ImageID:   string(image),
		ID:        InstanceID(project, zone, id),
	}
	if err := inst.Validate(); err != nil {
		return nil, fmt.Errorf("instance record from the GCE metadata server (name from %s, address from %s, image from %s, id from %s, %s and %s): %w",
			pathName, pathIP, pathImage, pathProjectID, pathZone, pathID, err)
	}
	return &metadata.Self{Instance: inst, UserData: ud, ProviderID: ProviderID(project, zone, name)}, nil
}

// ProviderID is the spec.providerID the GCP cloud controller manager knows an instance by: unlike
// InstanceID, by its name.
func ProviderID(project, zone, name string) string {
	return "gce://" + project + "/" + zone + "/" + name
}

// InstanceID is a Compute Engine instance's id as Berth records it: "projects/<project id>/zones/<zone>/
// instances/<instance id>", its Compute API path with its numeric id, which no later instance of the same
// name shares.
func InstanceID(project, zone, id string) string {
	return "projects/" + project + "/zones/" + zone + "/instances/" + id
}

// ErrSharedVPC says that the instance's primary network belongs to another project (a Shared VPC host),
// which the metadata server names only by number: the Compute API needs the host project's id.
var ErrSharedVPC = errors.New("the network is a Shared VPC network of another project")

// Placement reads the instance's project id, its zone's name and the name of its primary network
// interface's network: where a join service on a control-plane node looks nodes up unless configured
// otherwise. A network of another project gives the project and zone with an error wrapping ErrSharedVPC.
func (c *Client) Placement(ctx context.Context) (project, zone, network string, err error) {
	project, zone, number, err := c.projectAndZone(ctx)
	if err != nil {
		return "", "", "", err
	}
	v, err := c.getValue(ctx, pathNetwork)
	if err != nil {
		return "", "", "", err
	}
	networkNumber, network, ok := cutResourcePath(v, "networks")
	if !ok {
		return "", "", "", fmt.Errorf("reading %s from the GCE metadata server: %q is not projects/<project number>/networks/<network>", pathNetwork, v)
	}
	if networkNumber != number {
		return project, zone, "", fmt.Errorf("%w: this instance (project %s, number %s) has its primary interface on network %q of project number %s", ErrSharedVPC, project, number, network, networkNumber)
	}
	return project, zone, network, nil
}

// ControlPlanes implements the node's metadata reader: a node on Compute Engine cannot list other
// instances (that needs the Compute API and credentials), so it finds the join service through the
// user-data's join endpoints.
func (c *Client) ControlPlanes(context.Context) ([]metadata.Instance, error) { return nil, nil }

// TokenSource gives the access tokens of the instance's default service account, for Google's API clients
// (option.WithTokenSource): the join service on a control-plane node calls the Compute API with them, with
// the scopes the instance template gave the account. The sources of one Client share one token, reused
// until shortly before it expires (by the Client's clock, so not through oauth2.ReuseTokenSource, which
// keeps its own); ctx bounds the requests of every Token call.
func (c *Client) TokenSource(ctx context.Context) oauth2.TokenSource {
	return tokenSource{c: c, ctx: ctx}
}

type tokenSource struct {
	c   *Client
	ctx context.Context
}

func (s tokenSource) Token() (*oauth2.Token, error) { return s.c.accessToken(s.ctx) }

// accessToken returns the cached token unless it is near its end, else a new one. The lock is held while
// a new one is fetched so that concurrent callers share it.
func (c *Client) accessToken(ctx context.Context) (*oauth2.Token, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.now()
	if c.token != nil && now.Before(c.tokenUntil) {
		return copyToken(c.token), nil
	}
	c.token = nil
	body, err := c.get(ctx, pathToken, maxTokenAnswer)
	if errors.Is(err, errNotDefined) {
		return nil, fmt.Errorf("reading %s from the GCE metadata server: %w: give the control-plane nodes' instance template a service account that may read the instances of its project",
			pathToken, ErrNoServiceAccount)
	}
	if err != nil {
		return nil, err
	}
	var answer struct {
		AccessToken string `json:"access_token"`
		ExpiresIn   int64  `json:"expires_in"`
		TokenType   string `json:"token_type"`
	}
	if err := json.Unmarshal(body, &answer); err != nil {
		return nil, fmt.Errorf("reading %s from the GCE metadata server: the answer is not a token's JSON: %w", pathToken, err)
	}
	switch {
	case !isBearerToken(answer.AccessToken):
		return nil, fmt.Errorf("reading %s from the GCE metadata server: access_token is empty or has characters a bearer token cannot have", pathToken)
	case !strings.EqualFold(answer.TokenType, "Bearer"):
		return nil, fmt.Errorf("reading %s from the GCE metadata server: token_type is %.40q, not Bearer", pathToken, answer.TokenType)
	case answer.ExpiresIn <= 0 || answer.ExpiresIn > int64(maxTokenLifetime/time.Second):
		return nil, fmt.Errorf("reading %s from the GCE metadata server: expires_in is %d seconds, not from 1 to %d", pathToken, answer.ExpiresIn, int64(maxTokenLifetime/time.Second))
	}
	expiry := now.Add(time.Duration(answer.ExpiresIn) * time.Second)
	c.token = &oauth2.Token{AccessToken: answer.AccessToken, TokenType: "Bearer", Expiry: expiry}
	c.tokenUntil = expiry.Add(-tokenMargin)
	return copyToken(c.token), nil
}

// copyToken keeps the cached token the Client's own: its callers may change theirs.
func copyToken(t *oauth2.Token) *oauth2.Token {
	return &oauth2.Token{AccessToken: t.AccessToken, TokenType: t.TokenType, Expiry: t.Expiry}
}

// isBearerToken reports whether s is an RFC 6750 b64token, which is all a header carries safely.
func isBearerToken(s string) bool {
	body := strings.TrimRight(s, "=")
	if body == "" {
		return false
	}
	for _, r := range body {
		if !('a' <= r && r <= 'z' || 'A' <= r && r <= 'Z' || '0' <= r && r <= '9' || strings.ContainsRune("-._~+/", r)) {
			return false
		}
	}
	return true
}

// resourceName is a Compute Engine resource's name (RFC 1035): instances, zones, networks.
var resourceName = regexp.MustCompile(`^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$`)

// projectID is a project id, 6 to 30 characters, with the domain some older projects are scoped to
// ("example.com:berth").
var projectID = regexp.MustCompile(`^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?:)?[a-z][-a-z0-9]{4,28}[a-z0-9]$`)

// projectAndZone reads the project's id and the zone's name.
func (c *Client) projectAndZone(ctx context.Context) (project, zone, number string, err error) {
	project, err = c.getValue(ctx, pathProjectID)
	if err != nil {
		return "", "", "", err
	}
	if !projectID.MatchString(project) {
		return "", "", "", fmt.Errorf("reading %s from the GCE metadata server: %q is not a project id", pathProjectID, project)
	}
	v, err := c.getValue(ctx, pathZone)
	if err != nil {
		return "", "", "", err
	}
	number, zone, ok := cutResourcePath(v, "zones")
	if !ok {
		return "", "", "", fmt.Errorf("reading %s from the GCE metadata server: %q is not projects/<project number>/zones/<zone>", pathZone, v)
	}
	return project, zone, number, nil
}

// cutResourcePath returns the project number and the name in "projects/<project number>/<collection>/<name>",
// the form the metadata server gives zones and networks in.
func cutResourcePath(v, collection string) (number, name string, ok bool) {
	parts := strings.Split(v, "/")
	if len(parts) != 4 || parts[0] != "projects" || parts[2] != collection || !resourceName.MatchString(parts[3]) {
		return "", "", false
	}
	if n, err := strconv.ParseUint(parts[1], 10, 64); err != nil || strconv.FormatUint(n, 10) != parts[1] {
		return "", "", false
	}
	return parts[1], parts[3], true
}

// parseUserData is metadata.ParseUserData with the mistakes an instance template is likely to make named,
// and join endpoints required.
func parseUserData(raw []byte) (metadata.UserData, error) {
	ud, err := metadata.ParseUserData(raw)
	if err != nil {
		trimmed := bytes.TrimSpace(raw)
		switch {
		case bytes.HasPrefix(trimmed, []byte("#cloud-config")):
			return metadata.UserData{}, fmt.Errorf("%w: it is a #cloud-config document (berth_node_config's cloud_init, for bare metal); on Compute Engine the instance template's metadata %s is berth_node_config's json",
				ErrBadUserData, NodeConfigKey)
		case isBase64JSON(trimmed):
			return metadata.UserData{}, fmt.Errorf("%w: it is base64 of JSON: Compute Engine metadata values are text, so %s takes berth_node_config's json as it is, not base64encode of it",
				ErrBadUserData, NodeConfigKey)
		}
		return metadata.UserData{}, fmt.Errorf("%w: %w", ErrBadUserData, err)
	}
	if len(ud.JoinEndpoints) == 0 {
		return metadata.UserData{}, fmt.Errorf("%w: it names no join endpoint, and a node on Compute Engine finds the join service only there (set join_endpoints in berth_node_config)", ErrBadUserData)
	}
	return ud, nil
}

func isBase64JSON(b []byte) bool {
	dec, err := base64.StdEncoding.DecodeString(string(b))
	return err == nil && json.Valid(dec)
}

// getValue reads a value that must be there and not empty.
func (c *Client) getValue(ctx context.Context, path string) (string, error) {
	b, err := c.get(ctx, path, maxValueSize)
	if err != nil {
		return "", err
	}
	if len(b) == 0 {
		return "", fmt.Errorf("reading %s from the GCE metadata server: the value is empty", path)
	}
	return string(b), nil
}

// get reads /computeMetadata/v1/<path>, at most limit bytes. A 404 is errNotDefined.
func (c *Client) get(ctx context.Context, path string, limit int64) ([]byte, error) {
	body, err := c.fetch(ctx, path, limit)
	if err != nil {
		return nil, fmt.Errorf("reading %s from the GCE metadata server: %w", path, err)
	}
	return body, nil
}

// fetch is get without the path in its errors.
func (c *Client) fetch(ctx context.Context, path string, limit int64) ([]byte, error) {
	base, err := c.endpoint()
	if err != nil {
		return nil, err
	}
	resp, body, err := c.do(ctx, base, path, limit)
	if err != nil {
		return nil, err
	}
	// The flavor is checked before anything else in the answer is believed, a 404 included: another
	// cloud's metadata service answers 404 to every GCE path.
	switch {
	case resp.Header.Get(flavorHeader) != flavor:
		return nil, fmt.Errorf("%w: %s answered %s without %s: %s (is this node on Compute Engine, with nothing in between?)",
			ErrNotGCE, base, status(resp), flavorHeader, flavor)
	case resp.StatusCode == http.StatusNotFound:
		return nil, errNotDefined
	case resp.StatusCode < 200 || resp.StatusCode > 299:
		return nil, fmt.Errorf("the GCE metadata server answered %s: %s", status(resp), excerpt(body))
	case int64(len(body)) > limit:
		return nil, fmt.Errorf("the GCE metadata server answered with more than %d bytes, more than such a value can be", limit)
	}
	return body, nil
}

// endpoint is Endpoint, else $GCE_METADATA_HOST, else DefaultEndpoint, checked to be an http URL of a host.
func (c *Client) endpoint() (*url.URL, error) {
	endpoint := c.Endpoint
	if endpoint == "" {
		if host := os.Getenv(HostEnv); host != "" {
			// Google's clients put the variable between "http://" and the path, so it is host[:port].
			if u, err := url.Parse("http://" + host); err != nil || u.Host != host || u.User != nil {
				return nil, fmt.Errorf("%s=%q is not host[:port] (Google's clients take it without a scheme or a path)", HostEnv, host)
			}
			endpoint = "http://" + host
		}
	}
	endpoint = cmp.Or(endpoint, DefaultEndpoint)
	u, err := url.Parse(endpoint)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("GCE metadata endpoint %q is not an http URL with a host", endpoint)
	}
	return u, nil
}

// do sends one GET, bounded in time and in the bytes it reads (limit+1, so that the caller sees an answer
// too long). A request that gets no answer is ErrUnreachable, unless ctx itself ended first: then it is
// ctx's error.
func (c *Client) do(ctx context.Context, base *url.URL, path string, limit int64) (*http.Response, []byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base.JoinPath("computeMetadata", "v1", path).String(), nil)
	if err != nil {
		return nil, nil, fmt.Errorf("building the request to the GCE metadata server: %w", err)
	}
	req.Header.Set(flavorHeader, flavor)
	hc := metadatahttp.Client{HTTP: c.httpClient(), Timeout: cmp.Or(c.Timeout, defaultTimeout), Unreachable: ErrUnreachable}
	return hc.Do(req, base.String(), limit, "")
}

// httpClient is HTTPClient (or the default) made to follow no redirect, whoever built it: GCE sends
// redirects only for directories, never read here, and the answer must come from the server asked.
func (c *Client) httpClient() *http.Client {
	hc := *cmp.Or(c.HTTPClient, defaultHTTPClient)
	hc.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	return &hc
}

// status is the answer's status without the server's reason phrase, which could carry anything.
func status(resp *http.Response) string {
	return strconv.Itoa(resp.StatusCode) + " " + http.StatusText(resp.StatusCode)
}

func (c *Client) now() time.Time {
	if c.Now != nil {
		return c.Now()
	}
	return time.Now()
}

// htmlNoise is what of Google's HTML error pages says nothing: style sheet, title and tags. The sentence
// that matters ("The requested URL … was not found on this server.") is the page's text.
var htmlNoise = regexp.MustCompile(`(?is)<style\b.*?</style>|<title\b.*?</title>|<[^>]*>`)

// excerpt is the start of an error answer's body, as text on one line and printable, for an error message.
func excerpt(body []byte) string {
	s := strings.ToValidUTF8(string(body), "")
	if strings.HasPrefix(strings.TrimSpace(s), "<") {
		s = htmlNoise.ReplaceAllString(s, " ")
	}
	s = strings.Map(func(r rune) rune {
		if r < 0x20 || r == 0x7f {
			return ' '
		}
		return r
	}, s)
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > maxExcerpt {
		s = strings.ToValidUTF8(s[:maxExcerpt], "") + "…"
	}
	return cmp.Or(s, "no body")
}
