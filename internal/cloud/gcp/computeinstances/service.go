package computeinstances

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"golang.org/x/oauth2"
	compute "google.golang.org/api/compute/v1"
	"google.golang.org/api/googleapi"
	"google.golang.org/api/option"

	"github.com/berthlabs/berth/internal/cloud/apicalls"
)

// Bounds of every request to Compute Engine.
const (
	// MaxResponseBytes bounds one response body (decompressed): a page of 500 instances with the partial
	// response this package asks for is well below 1 MiB, a whole one (every field) a few MiB, and a
	// group's pageless listManagedInstances holds at most a few thousand short entries. A broken or hostile
	// endpoint cannot make the join service hold more.
	MaxResponseBytes = 32 << 20
	// DefaultRequestTimeout bounds one attempt, its body included: Compute Engine answers a page in well
	// under a second, so an attempt that takes this long is stuck and is better tried again.
	DefaultRequestTimeout = 30 * time.Second
)

// Retries. Google's generated clients retry nothing but uploads, and Compute Engine throttles per project
// and per minute, in a bucket shared with everything else of the project (the console, Terraform, the
// cloud controller manager, autoscalers): it answers 403 with reason rateLimitExceeded (or 429), and the
// quota refills at the start of the next minute. A read is tried up to 8 times, with full-jitter
// exponential backoff: a random wait below a ceiling that doubles from 100 ms to a cap of 5 s. The waits
// of one request add up to about 6 s on average and never more than 11.3 s, within the join service's
// exchange timeout, and concurrent callers do not retry in step. A quota spent for the rest of a minute
// outlasts them: the call then fails, and the next lookup tries again. Only reads are retried: GETs and
// listManagedInstances, a POST that changes nothing.
const (
	maxAttempts = 8
	baseBackoff = 100 * time.Millisecond
	maxBackoff  = 5 * time.Second
)

// maxErrorSniff bounds how much of a 403's body is read to tell throttling from a refusal; Google's error
// documents are a few hundred bytes.
const maxErrorSniff = 64 << 10

// transportConfig is what NewService fixes and tests shorten or extend.
type transportConfig struct {
	requestTimeout time.Duration
	baseBackoff    time.Duration
	maxBackoff     time.Duration
	maxBody        int64
	rootCAs        *x509.CertPool // nil: the system's roots
	// calls, if set, counts every attempt by outcome.
	calls apicalls.Counter
}

var defaultTransport = transportConfig{
	requestTimeout: DefaultRequestTimeout,
	baseBackoff:    baseBackoff,
	maxBackoff:     maxBackoff,
	maxBody:        MaxResponseBytes,
}

// NewService returns Google's Compute Engine client, authenticated by ts (the node's service account,
// from the metadata server), with the bounds and retries above. endpoint, if set, replaces Google's
// (https://compute.googleapis.com/compute/v1/): a Private Service Connect endpoint or a test endpoint. It
// must be https, or http to a loopback address; an endpoint without a path gets the API's /compute/v1/.
// log receives the retries (Debug) and the requests that stayed throttled (Warn); nil discards them.
// calls, if set, counts every request by outcome, each retry included: the retries absorb throttling that
// only the count of throttled attempts then shows.
//
// An environment proxy (HTTPS_PROXY) is used, as Google's own clients do: a control-plane node whose only
// way out is a proxy must still reach the API, and the proxy gains nothing from it, for TLS runs end to end
// to Google's certificate through it (the proxy sees the host name, not the token or the answers). Plain
// http goes only to loopback, which Go never sends through a proxy.
func NewService(ctx context.Context, endpoint string, ts oauth2.TokenSource, log *slog.Logger, calls apicalls.Counter) (*compute.Service, error) {
	tc := defaultTransport
	tc.calls = calls
	return newService(ctx, endpoint, ts, log, tc)
}

func newService(ctx context.Context, endpoint string, ts oauth2.TokenSource, log *slog.Logger, tc transportConfig) (*compute.Service, error) {
	if ts == nil {
		return nil, errors.New("Compute Engine client: no token source")
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	opts := []option.ClientOption{option.WithHTTPClient(newHTTPClient(ts, log, tc))}
	if endpoint != "" {
		base, err := checkEndpoint(endpoint)
		if err != nil {
			return nil, fmt.Errorf("Compute Engine client: %w", err)
		}
		opts = append(opts, option.WithEndpoint(base))
	}
	svc, err := compute.NewService(ctx, opts...)
	if err != nil {
		return nil, fmt.Errorf("Compute Engine client: %w", err)
	}
	svc.UserAgent = "berth-join-service"
	return svc, nil
}

// newHTTPClient stacks, outermost first: the token (once per call, not per retry: a token source that
// fails is not asked again eight times), the response bound (so that no retry can lift it), the retries
// with their per-attempt timeout, and a transport of its own. With option.WithHTTPClient Google's client
// uses the client as it is and ignores its auth options, which is why the token is added here and not with
// option.WithTokenSource. Redirects are not followed: Compute Engine sends none, and the token transport
// would put the token on a request to wherever a redirect points.
func newHTTPClient(ts oauth2.TokenSource, log *slog.Logger, tc transportConfig) *http.Client {
	base := http.DefaultTransport.(*http.Transport).Clone()
	base.TLSClientConfig = &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: tc.rootCAs}
	base.MaxIdleConnsPerHost = 8
	return &http.Client{
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
		Transport: &oauth2.Transport{
			Source: oauth2.ReuseTokenSource(nil, ts),
			Base: &boundedTransport{limit: tc.maxBody, next: &retryTransport{
				next: base, log: log.With("subsystem", "compute-api"), timeout: tc.requestTimeout,
				base: tc.baseBackoff, cap: tc.maxBackoff, calls: tc.calls,
			}},
		},
	}
}

// checkEndpoint refuses endpoints whose answers anyone on the path could forge (the answers give roles,
// and requests carry the service account's token), and returns the base URL the client resolves paths
// against: with a trailing slash, for url.ResolveReference drops a last segment without one
// ("…/compute/v1" + "projects/p" is "…/compute/projects/p").
func checkEndpoint(endpoint string) (string, error) {
	u, err := url.Parse(endpoint)
	if err != nil {
		return "", fmt.Errorf("endpoint %q is not a URL: %w", bounded(endpoint), err)
	}
	if u.Host == "" || u.User != nil || u.RawQuery != "" || u.Fragment != "" || u.Opaque != "" {
		return "", fmt.Errorf("endpoint %q is not scheme://host[:port][/path]", bounded(endpoint))
	}
	switch u.Scheme {
	case "https":
	case "http":
		if ip := net.ParseIP(u.Hostname()); !(ip != nil && ip.IsLoopback() || u.Hostname() == "localhost") {
			return "", fmt.Errorf("endpoint %q is plain http to a host that is not loopback: anyone on the path could answer", bounded(endpoint))
		}
	default:
		return "", fmt.Errorf("endpoint %q: scheme is not https", bounded(endpoint))
	}
	switch {
	case u.Path == "" || u.Path == "/":
		u.Path = "/compute/v1/"
	case !strings.HasSuffix(u.Path, "/"):
		u.Path += "/"
	}
	return u.String(), nil
}

// errResponseTooLarge is what reading a response beyond the bound gives.
var errResponseTooLarge = errors.New("response is larger than the join service accepts")

// boundedTransport cuts every response body at limit bytes: reading beyond it fails.
type boundedTransport struct {
	limit int64
	next  http.RoundTripper
}

func (t *boundedTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := t.next.RoundTrip(req)
	if err != nil {
		return nil, err
	}
	if resp.ContentLength > t.limit {
		resp.Body.Close()
		return nil, fmt.Errorf("Compute Engine's answer to %s is %d bytes: %w (%d bytes)", req.URL.Path, resp.ContentLength, errResponseTooLarge, t.limit)
	}
	resp.Body = &limitedBody{rc: resp.Body, left: t.limit, limit: t.limit, path: req.URL.Path}
	return resp, nil
}

type limitedBody struct {
	rc    io.ReadCloser
	left  int64
	limit int64
	path  string
}

func (b *limitedBody) Read(p []byte) (int, error) {
	if b.left <= 0 {
		// At the bound: one more byte means the body is too long, none means it ended there.
		var probe [1]byte
		n, err := b.rc.Read(probe[:])
		if n > 0 {
			return 0, fmt.Errorf("Compute Engine's answer to %s: %w (%d bytes)", b.path, errResponseTooLarge, b.limit)
		}
		return 0, err
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, err := b.rc.Read(p)
	b.left -= int64(n)
	return n, err
}

func (b *limitedBody) Close() error { return b.rc.Close() }

// retryTransport gives each attempt its own timeout and tries reads again that Compute Engine throttled,
// that failed on its side (5xx), or that failed on the way (a reset connection, a stuck attempt).
type retryTransport struct {
	next      http.RoundTripper
	log       *slog.Logger
	timeout   time.Duration
	base, cap time.Duration
	calls     apicalls.Counter
}

func (t *retryTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	tries := 1
	if retryable(req) {
		tries = maxAttempts
	}
	ctx := req.Context()
	for attempt := 1; ; attempt++ {
		resp, err := t.try(ctx, req)
		why := t.retryReason(ctx, resp, err)
		if t.calls != nil {
			t.calls.Count(attemptOutcome(resp, err, why))
		}
		if why == "" || attempt == tries {
			if why != "" && err == nil {
				t.log.Warn("Compute Engine request failed after retries", "path", req.URL.Path, "attempts", attempt, "status", resp.StatusCode, "reason", why)
			}
			return resp, err
		}
		if resp != nil {
			discard(resp.Body)
		}
		wait := t.backoff(attempt)
		t.log.Debug("Compute Engine request retried", "path", req.URL.Path, "attempt", attempt, "reason", why, "backoff", wait)
		timer := time.NewTimer(wait)
		select {
		case <-timer.C:
		case <-ctx.Done():
			timer.Stop()
			return nil, fmt.Errorf("Compute Engine %s: waiting to retry (%s): %w", req.URL.Path, why, context.Cause(ctx))
		}
	}
}

// attemptOutcome is what one attempt came to, given retryReason's why: a 429, or a 403 that retryReason
// found to be a rate limit, is throttled; any other failure, a 404 included, is an error.
func attemptOutcome(resp *http.Response, err error, why string) apicalls.Outcome {
	switch {
	case err != nil:
		return apicalls.Error
	case resp.StatusCode == http.StatusTooManyRequests, resp.StatusCode == http.StatusForbidden && why != "":
		return apicalls.Throttled
	case resp.StatusCode >= http.StatusBadRequest:
		return apicalls.Error
	}
	return apicalls.OK
}

// try sends one attempt under its own timeout, which the response's body keeps until it is closed.
func (t *retryTransport) try(ctx context.Context, req *http.Request) (*http.Response, error) {
	actx, cancel := context.WithTimeout(ctx, t.timeout)
	resp, err := t.next.RoundTrip(req.Clone(actx))
	if err != nil {
		cancel()
		return nil, err
	}
	resp.Body = &cancelBody{ReadCloser: resp.Body, cancel: cancel}
	return resp, nil
}

type cancelBody struct {
	io.ReadCloser
	cancel context.CancelFunc
}

func (b *cancelBody) Close() error {
	err := b.ReadCloser.Close()
	b.cancel()
	return err
}

// retryable reports whether req only reads: a GET, or listManagedInstances, which Compute Engine defines as
// a POST without body that changes nothing.
func retryable(req *http.Request) bool {
	switch req.Method {
	case http.MethodGet:
		return true
	case http.MethodPost:
		return strings.HasSuffix(req.URL.Path, "/listManagedInstances") && (req.Body == nil || req.Body == http.NoBody)
	}
	return false
}

// retryReason says why an attempt is worth another, or "" when its answer is final. A 403 is read (a
// bounded prefix) to tell throttling from a refusal, and its body put back for Google's client to parse.
func (t *retryTransport) retryReason(ctx context.Context, resp *http.Response, err error) string {
	if err != nil {
		var certErr *tls.CertificateVerificationError
		if ctx.Err() != nil || errors.As(err, &certErr) {
			return ""
		}
		return "transport: " + bounded(err.Error())
	}
	switch code := resp.StatusCode; {
	case code == http.StatusTooManyRequests:
		return "429 too many requests"
	case code == http.StatusForbidden:
		head, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorSniff))
		resp.Body = readCloser{Reader: io.MultiReader(bytes.NewReader(head), resp.Body), Closer: resp.Body}
		if r := throttleReason(head); r != "" {
			return "403 " + r
		}
	case code == http.StatusInternalServerError || code == http.StatusBadGateway ||
		code == http.StatusServiceUnavailable || code == http.StatusGatewayTimeout:
		return fmt.Sprintf("%d %s", code, http.StatusText(code))
	}
	return ""
}

type readCloser struct {
	io.Reader
	io.Closer
}

// Reasons Google gives with 403 for requests over a rate quota, per project or per user.
const (
	reasonRateLimit     = "rateLimitExceeded"
	reasonUserRateLimit = "userRateLimitExceeded"
)

// throttleReason returns the rate-limit reason of a Google error document, or "".
func throttleReason(body []byte) string {
	var doc struct {
		Error struct {
			Errors []struct {
				Reason string `json:"reason"`
			} `json:"errors"`
		} `json:"error"`
	}
	if json.Unmarshal(body, &doc) != nil {
		return ""
	}
	for _, e := range doc.Error.Errors {
		if e.Reason == reasonRateLimit || e.Reason == reasonUserRateLimit {
			return e.Reason
		}
	}
	return ""
}

// backoff is a uniformly random wait up to base·2^(attempt-1), at most cap.
func (t *retryTransport) backoff(attempt int) time.Duration {
	ceiling := t.cap
	if attempt >= 1 && attempt < 32 {
		if d := t.base << (attempt - 1); d > 0 && d < t.cap {
			ceiling = d
		}
	}
	if ceiling <= 0 {
		return 0
	}
	return time.Duration(rand.Int64N(int64(ceiling))) + 1
}

// discard reads a little of a body that is given up, so that its connection can serve the next attempt.
func discard(body io.ReadCloser) {
	_, _ = io.Copy(io.Discard, io.LimitReader(body, maxErrorSniff))
	body.Close()
}

// Methods of Compute Engine this package calls, as APIError names them.
const (
	methodAggregatedList         = "instances.aggregatedList"
	methodShieldedIdentity       = "instances.getShieldedInstanceIdentity"
	methodListManagedInstances   = "instanceGroupManagers.listManagedInstances"
	methodRegionListManaged      = "regionInstanceGroupManagers.listManagedInstances"
	permissionInstancesList      = "compute.instances.list"
	permissionShieldedIdentity   = "compute.instances.getShieldedInstanceIdentity"
	permissionInstanceGroupsRead = "compute.instanceGroupManagers.get"
)

// permissions are the IAM permissions each method needs. Regional groups are read with the same
// permission as zonal ones; IAM has no regionInstanceGroupManagers permissions.
var permissions = map[string]string{
	methodAggregatedList:       permissionInstancesList,
	methodShieldedIdentity:     permissionShieldedIdentity,
	methodListManagedInstances: permissionInstanceGroupsRead,
	methodRegionListManaged:    permissionInstanceGroupsRead,
}

// APIError is an error Compute Engine answered, after the retries.
type APIError struct {
	// Method is the API method, such as instances.aggregatedList.
	Method string
	// Code is the HTTP status, Reason the reason of Google's first error item (forbidden, notFound,
	// rateLimitExceeded), Message Google's message, shortened.
	Code    int
	Reason  string
	Message string
	// Hint says what to do, where the answer tells.
	Hint string
	err  error
}

func (e *APIError) Error() string {
	s := fmt.Sprintf("Compute Engine %s: %d", e.Method, e.Code)
	if e.Reason != "" {
		s += " " + e.Reason
	}
	if e.Message != "" {
		s += ": " + e.Message
	}
	if e.Hint != "" {
		s += " (" + e.Hint + ")"
	}
	return s
}

// Unwrap gives Google's error, for errors.As with *googleapi.Error.
func (e *APIError) Unwrap() error { return e.err }

// apiError turns an error of Google's client into one whose text is bounded and says what to do. Errors
// that are not Compute Engine's answer (a transport failure, a timeout, a response too large) get the
// method named and pass through.
func apiError(method string, err error) error {
	var ge *googleapi.Error
	if !errors.As(err, &ge) {
		return fmt.Errorf("Compute Engine %s: %w", method, err)
	}
	e := &APIError{Method: method, Code: ge.Code, Message: bounded(ge.Message), err: err}
	if len(ge.Errors) > 0 {
		e.Reason = bounded(ge.Errors[0].Reason)
		if e.Message == "" {
			e.Message = bounded(ge.Errors[0].Message)
		}
	}
	switch {
	case isThrottle(ge):
		e.Hint = fmt.Sprintf("Compute Engine still throttled the project after %d attempts: its API rate quota is spent by this or other clients", maxAttempts)
	case ge.Code == http.StatusUnauthorized:
		e.Hint = "Compute Engine refused the join service's credentials (the service account token of its instance)"
	case ge.Code == http.StatusForbidden && e.Reason == "accessNotConfigured":
		e.Hint = "the Compute Engine API is not enabled in the project"
	case ge.Code == http.StatusForbidden && e.Reason == "insufficientPermissions":
		e.Hint = "the access scopes of the control-plane instances' service account must include compute.readonly or cloud-platform"
	case ge.Code == http.StatusForbidden:
		e.Hint = "the join service's service account needs IAM permission " + permissions[method]
	}
	return e
}

func isThrottle(ge *googleapi.Error) bool {
	if ge.Code == http.StatusTooManyRequests {
		return true
	}
	if ge.Code != http.StatusForbidden {
		return false
	}
	for _, item := range ge.Errors {
		if item.Reason == reasonRateLimit || item.Reason == reasonUserRateLimit {
			return true
		}
	}
	return false
}

// isNotFound reports whether Compute Engine answered 404.
func isNotFound(err error) bool {
	var ge *googleapi.Error
	return errors.As(err, &ge) && ge.Code == http.StatusNotFound
}

// bounded keeps strings from Compute Engine or the configuration short in errors and logs.
func bounded(s string) string {
	const limit = 200
	if len(s) <= limit {
		return s
	}
	return strings.ToValidUTF8(s[:limit], "") + "…"
}
