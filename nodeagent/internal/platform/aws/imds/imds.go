// Package imds gives a Berth node on EC2 its view of itself from the instance metadata service, IMDSv2
// only: its instance id, private DNS name, private address, AMI and availability zone (for its kubelet's
// provider ID), and the user-data its launch template carries (berth_node_config's json).
//
// The node trusts IMDS for where to go (the join endpoints, the join CA pin, its cluster's name) and for
// who to say it is, because nothing else on a fresh instance knows them. Nothing read here grants
// anything: the join service looks the instance up in EC2's API by the address the node connects from
// (package ec2instances), takes its name from the instance's PrivateDnsName, its role from its autoscaling
// group and its TPM from the NitroTPM EC2 reports for its instance id, and refuses a node that says
// otherwise. So this package only has to be honest about what it read and clear when it cannot read it:
// a node that cannot read IMDS cannot join, and the operator needs to know why.
//
// Only IMDSv2 is spoken: its session token, fetched with a PUT, keeps a server-side request forgery on the
// node from reading the metadata with a plain GET, and a launch template should require it
// (HttpTokens = required).
package imds

import (
	"bytes"
	"cmp"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/berthlabs/berth/internal/cloud/aws/ec2instances"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/nodeagent/internal/platform/metadatahttp"
)

// DefaultEndpoint is EC2's IMDS on its IPv4 link-local address.
const DefaultEndpoint = "http://169.254.169.254"

// The paths under /latest/ that Self reads.
const (
	pathInstanceID = "meta-data/instance-id"
	pathHostname   = "meta-data/local-hostname"
	pathIPv4       = "meta-data/local-ipv4"
	pathAMI        = "meta-data/ami-id"
	pathUserData   = "user-data"
	pathToken      = "api/token"
	pathRegion     = "meta-data/placement/region"
	pathZone       = "meta-data/placement/availability-zone"
	pathMAC        = "meta-data/mac"
)

const (
	headerToken    = "X-aws-ec2-metadata-token"
	headerTokenTTL = "X-aws-ec2-metadata-token-ttl-seconds"

	// tokenTTL is the longest session EC2 grants: a node reads IMDS at boot, and one token covers it.
	tokenTTL = 6 * time.Hour
	// tokenMargin is how long before its end a token is replaced, more than a request may take, so that no
	// request carries a token that expires on its way.
	tokenMargin = time.Minute

	// maxTokenSize is far above EC2's tokens (56 bytes); a larger answer is not a token.
	maxTokenSize = 512
	// maxValueSize bounds one meta-data value; the values read here are tens of bytes.
	maxValueSize = 64 << 10
	// maxUserDataSize is four times EC2's limit on user-data (16 KiB), which berth_node_config keeps to.
	maxUserDataSize = 64 << 10
	// maxExcerpt bounds how much of an error answer's body ends up in an error.
	maxExcerpt = 200

	// defaultTimeout bounds a request whose context has no earlier deadline: IMDS answers in
	// milliseconds, and a boot that waits on it must not stall when it does not.
	defaultTimeout = 5 * time.Second
)

// Errors an operator acts on differently; every error from Self that is one of them wraps it.
var (
	// ErrUnreachable: no HTTP answer from the endpoint at all (refused, timed out).
	ErrUnreachable = errors.New("IMDS unreachable")
	// ErrTokenRefused: IMDS refused to issue a session token, or refused one it had just issued.
	ErrTokenRefused = errors.New("IMDS refused a session token")
	// ErrNoUserData: the instance was launched without user-data.
	ErrNoUserData = errors.New("the instance has no user-data")
	// ErrBadUserData: the user-data is not a valid berth_node_config json.
	ErrBadUserData = errors.New("the user-data is not berth_node_config's json")
)

// defaultHTTPClient never uses a proxy from the environment (IMDS is link-local: a proxy could only answer
// in its name) and follows no redirect (IMDS never sends one; following it would send the token elsewhere).
// Its timeout is only a backstop above any sane Client.Timeout, which bounds each request.
var defaultHTTPClient = func() *http.Client {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.Proxy = nil
	return &http.Client{
		Transport:     t,
		Timeout:       time.Minute,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}
}()

// Client reads a node's own record from EC2's IMDS. It is safe for concurrent use; one token serves every
// request until shortly before it expires.
type Client struct {
	// Endpoint is IMDS's root, DefaultEndpoint when empty.
	Endpoint string
	// HTTPClient is used for requests; nil means one without proxy and without redirects.
	HTTPClient *http.Client
	// Timeout bounds each request when ctx has no earlier deadline; 5 s when zero.
	Timeout time.Duration
	// Now is the clock a token's expiry is measured by; time.Now when nil.
	Now func() time.Time

	mu      sync.Mutex
	token   string
	expires time.Time
}

// Self reads the node's instance record and user-data. The role is the user-data's (one launch template
// per role), worker when it names none.
func (c *Client) Self(ctx context.Context) (*metadata.Self, error) {
	var id, name, ipv4, ami, zone string
	for _, v := range []struct {
		path string
		dst  *string
	}{{pathInstanceID, &id}, {pathHostname, &name}, {pathIPv4, &ipv4}, {pathAMI, &ami}, {pathZone, &zone}} {
		b, err := c.get(ctx, v.path, maxValueSize)
		if err != nil {
			return nil, err
		}
		if len(b) == 0 {
			return nil, fmt.Errorf("reading %s from IMDS: the value is empty", v.path)
		}
		*v.dst = string(b)
	}
	raw, err := c.get(ctx, pathUserData, maxUserDataSize)
	if err != nil {
		return nil, err
	}
	ud, err := parseUserData(raw)
	if err != nil {
		return nil, fmt.Errorf("reading %s from IMDS: %w", pathUserData, err)
	}

	addr, err := netip.ParseAddr(ipv4)
	if err != nil || !addr.Is4() {
		return nil, fmt.Errorf("reading %s from IMDS: %q is not an IPv4 address", pathIPv4, ipv4)
	}
	inst := metadata.Instance{
		Name:      name,
		Role:      cmp.Or(ud.Role, metadata.RoleWorker),
		Addresses: []netip.Addr{addr},
		ImageID:   ami,
		ID:        id,
	}
	if err := inst.Validate(); err != nil {
		return nil, fmt.Errorf("instance record from IMDS (name from %s, address from %s, image from %s, id from %s): %w",
			pathHostname, pathIPv4, pathAMI, pathInstanceID, err)
	}
	if !ec2instances.IsInstanceID(id) {
		return nil, fmt.Errorf("reading %s from IMDS: %q is not an EC2 instance id", pathInstanceID, id)
	}
	if !zonePattern.MatchString(zone) {
		return nil, fmt.Errorf("reading %s from IMDS: %q is not an availability zone name", pathZone, zone)
	}
	return &metadata.Self{Instance: inst, UserData: ud, ProviderID: ProviderID(zone, id)}, nil
}

// zonePattern matches availability zone names (us-east-1a) and Local or Wavelength Zone names
// (us-east-1-bos-1a, us-east-1-wl1-bos-wlz-1): what may stand in a provider ID's path.
var zonePattern = regexp.MustCompile(`\A[a-z]{2}(-[a-z0-9]+)+\z`)

// ProviderID is the spec.providerID the AWS cloud controller manager knows an instance by.
func ProviderID(zone, instanceID string) string {
	return "aws:///" + zone + "/" + instanceID
}

// Placement reads the region and the VPC of the instance's primary network interface: where a join service
// on a control-plane node looks nodes up unless configured otherwise.
func (c *Client) Placement(ctx context.Context) (region, vpcID string, err error) {
	var mac []byte
	for _, v := range []struct {
		path string
		dst  *[]byte
	}{{pathRegion, nil}, {pathMAC, &mac}} {
		b, err := c.get(ctx, v.path, maxValueSize)
		if err != nil {
			return "", "", err
		}
		if len(b) == 0 {
			return "", "", fmt.Errorf("reading %s from IMDS: the value is empty", v.path)
		}
		if v.dst == nil {
			region = string(b)
		} else {
			*v.dst = b
		}
	}
	if _, err := net.ParseMAC(string(mac)); err != nil {
		return "", "", fmt.Errorf("reading %s from IMDS: %q is not a MAC address", pathMAC, mac)
	}
	vpcPath := "meta-data/network/interfaces/macs/" + string(mac) + "/vpc-id"
	vpc, err := c.get(ctx, vpcPath, maxValueSize)
	if err != nil {
		return "", "", err
	}
	if !strings.HasPrefix(string(vpc), "vpc-") {
		return "", "", fmt.Errorf("reading %s from IMDS: %q is not a VPC id", vpcPath, vpc)
	}
	return region, string(vpc), nil
}

// ControlPlanes implements the node's metadata reader: a node on EC2 cannot list other instances (that
// needs EC2's API and credentials), so it finds the join service through the user-data's join endpoints.
func (c *Client) ControlPlanes(context.Context) ([]metadata.Instance, error) { return nil, nil }

// parseUserData is metadata.ParseUserData with the mistakes a launch template is likely to make named, and
// join endpoints required.
func parseUserData(raw []byte) (metadata.UserData, error) {
	ud, err := metadata.ParseUserData(raw)
	if err != nil {
		trimmed := bytes.TrimSpace(raw)
		switch {
		case bytes.HasPrefix(trimmed, []byte("#cloud-config")):
			return metadata.UserData{}, fmt.Errorf("%w: it is a #cloud-config document (berth_node_config's cloud_init, for bare metal); on EC2 the launch template's user_data is berth_node_config's json", ErrBadUserData)
		case isBase64JSON(trimmed):
			return metadata.UserData{}, fmt.Errorf("%w: it is base64 of JSON, encoded once too often (the launch template takes base64encode(json), not base64 of that)", ErrBadUserData)
		}
		return metadata.UserData{}, fmt.Errorf("%w: %w", ErrBadUserData, err)
	}
	if len(ud.JoinEndpoints) == 0 {
		return metadata.UserData{}, fmt.Errorf("%w: it names no join endpoint, and a node on EC2 finds the join service only there (set join_endpoints in berth_node_config)", ErrBadUserData)
	}
	return ud, nil
}

func isBase64JSON(b []byte) bool {
	dec, err := base64.StdEncoding.DecodeString(string(b))
	return err == nil && json.Valid(dec)
}

// get reads /latest/<path> with a session token, at most limit bytes. A 401 means IMDS no longer knows the
// token (it restarted, or the token outlived it): one new token is fetched and the request repeated.
func (c *Client) get(ctx context.Context, path string, limit int64) ([]byte, error) {
	token, err := c.sessionToken(ctx, "")
	if err != nil {
		return nil, fmt.Errorf("reading %s from IMDS: %w", path, err)
	}
	body, err := c.getWith(ctx, path, limit, token)
	if errors.Is(err, errStaleToken) {
		if token, err = c.sessionToken(ctx, token); err == nil {
			body, err = c.getWith(ctx, path, limit, token)
		}
		if errors.Is(err, errStaleToken) {
			err = fmt.Errorf("%w: it answered 401 Unauthorized to a token it had just issued", ErrTokenRefused)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("reading %s from IMDS: %w", path, err)
	}
	return body, nil
}

// errStaleToken is a 401 to a GET: the token is to be replaced.
var errStaleToken = errors.New("token not accepted")

func (c *Client) getWith(ctx context.Context, path string, limit int64, token string) ([]byte, error) {
	resp, body, err := c.do(ctx, http.MethodGet, path, headerToken, token, limit)
	if err != nil {
		return nil, err
	}
	switch {
	case resp.StatusCode == http.StatusUnauthorized:
		return nil, errStaleToken
	case resp.StatusCode == http.StatusNotFound && path == pathUserData:
		return nil, fmt.Errorf("%w (404 Not Found): give the launch template berth_node_config's json as its user_data", ErrNoUserData)
	case resp.StatusCode < 200 || resp.StatusCode > 299:
		return nil, fmt.Errorf("IMDS answered %s: %s", status(resp), excerpt(body))
	case int64(len(body)) > limit:
		return nil, fmt.Errorf("IMDS answered with more than %d bytes, more than such a value can be", limit)
	}
	return body, nil
}

// sessionToken returns the cached token unless it is stale (refused by IMDS) or near its end, else a new
// one. The lock is held while a new one is fetched so that concurrent readers share it.
func (c *Client) sessionToken(ctx context.Context, stale string) (string, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.now()
	if c.token != "" && c.token != stale && now.Before(c.expires) {
		return c.token, nil
	}
	c.token = ""
	ttl := strconv.Itoa(int(tokenTTL / time.Second))
	resp, body, err := c.do(ctx, http.MethodPut, pathToken, headerTokenTTL, ttl, maxTokenSize)
	if err != nil {
		return "", err
	}
	switch {
	case resp.StatusCode == http.StatusUnauthorized || resp.StatusCode == http.StatusForbidden:
		return "", fmt.Errorf("%w: PUT /latest/%s answered %s (%s): IMDS may be disabled for the instance (HttpEndpoint), or the PUT response hop limit (HttpPutResponseHopLimit) too low for this process",
			ErrTokenRefused, pathToken, status(resp), excerpt(body))
	case resp.StatusCode < 200 || resp.StatusCode > 299:
		return "", fmt.Errorf("%w: PUT /latest/%s answered %s: %s", ErrTokenRefused, pathToken, status(resp), excerpt(body))
	case len(body) > maxTokenSize:
		return "", fmt.Errorf("%w: its answer to PUT /latest/%s is longer than %d bytes, not a token", ErrTokenRefused, pathToken, maxTokenSize)
	case len(body) == 0 || bytes.ContainsFunc(body, func(r rune) bool { return r <= ' ' || r >= 0x7f }):
		return "", fmt.Errorf("%w: its answer to PUT /latest/%s is empty or has characters a header cannot carry", ErrTokenRefused, pathToken)
	}
	c.token, c.expires = string(body), now.Add(tokenTTL-tokenMargin)
	return c.token, nil
}

// do sends one request with one header, bounded in time and in the bytes it reads (limit+1, so that the
// caller sees an answer too long). A request that gets no answer is ErrUnreachable, unless ctx itself
// ended first: then it is ctx's error.
func (c *Client) do(ctx context.Context, method, path, header, value string, limit int64) (*http.Response, []byte, error) {
	endpoint := cmp.Or(c.Endpoint, DefaultEndpoint)
	base, err := url.Parse(endpoint)
	if err != nil || (base.Scheme != "http" && base.Scheme != "https") || base.Host == "" {
		return nil, nil, fmt.Errorf("IMDS endpoint %q is not an http URL with a host", endpoint)
	}
	u := base.JoinPath("latest", path)

	req, err := http.NewRequestWithContext(ctx, method, u.String(), nil)
	if err != nil {
		return nil, nil, fmt.Errorf("building the IMDS request: %w", err)
	}
	req.Header.Set(header, value)
	server, hint := endpoint, ""
	if method == http.MethodPut {
		// EC2 drops the token's answer after HttpPutResponseHopLimit hops: from a container, the PUT then
		// times out while everything else about IMDS is fine.
		server += " to PUT /latest/" + path
		hint = " (from a container, the PUT response hop limit HttpPutResponseHopLimit may be too low: the answer never arrives)"
	}
	hc := metadatahttp.Client{HTTP: cmp.Or(c.HTTPClient, defaultHTTPClient), Timeout: cmp.Or(c.Timeout, defaultTimeout), Unreachable: ErrUnreachable}
	return hc.Do(req, server, limit, hint)
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

// excerpt is the start of an error answer's body, on one line and printable, for an error message.
func excerpt(body []byte) string {
	s := strings.Map(func(r rune) rune {
		if r < 0x20 || r == 0x7f {
			return ' '
		}
		return r
	}, strings.ToValidUTF8(string(body), ""))
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > maxExcerpt {
		s = strings.ToValidUTF8(s[:maxExcerpt], "") + "…"
	}
	return cmp.Or(s, "no body")
}
