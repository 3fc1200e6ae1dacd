package metadata

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/berthlabs/berth/internal/backoff"
)

// ErrNotFound is returned when the service has no record for an address.
var ErrNotFound = errors.New("instance not found")

// defaultTimeout bounds a request whose context has no deadline, so that a
// silent service never stalls a boot forever.
const defaultTimeout = 30 * time.Second

// maxErrorMessage bounds how much of a server's error text ends up in our errors.
const maxErrorMessage = 256

// defaultHTTPClient never uses a proxy from the environment: a metadata
// service is link-local or on the host, and a proxy could answer in its name.
var defaultHTTPClient = func() *http.Client {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.Proxy = nil
	return &http.Client{Transport: t, Timeout: defaultTimeout}
}()

// Client reads records from a metadata service.
type Client struct {
	// BaseURL is the service's root, e.g. "http://127.0.0.1:8080".
	BaseURL string
	// HTTPClient is used for requests; nil means a client without proxy and a 30 s timeout.
	HTTPClient *http.Client
	// LocalAddr, when valid, is the source address requests are dialed from, so
	// that several nodes can share one host (127.0.0.2, 127.0.0.3, … on loopback).
	LocalAddr netip.Addr
}

// Self returns the record of the node the request comes from.
func (c *Client) Self(ctx context.Context) (*Self, error) {
	var self Self
	if err := c.get(ctx, PathSelf, nil, &self); err != nil {
		return nil, fmt.Errorf("reading own metadata: %w", err)
	}
	if err := self.Instance.Validate(); err != nil {
		return nil, fmt.Errorf("reading own metadata: invalid instance record: %w", err)
	}
	if err := self.UserData.Validate(); err != nil {
		return nil, fmt.Errorf("reading own metadata: invalid user-data: %w", err)
	}
	return &self, nil
}

// ControlPlanes returns the service's records of control-plane instances, where join services may answer.
func (c *Client) ControlPlanes(ctx context.Context) ([]Instance, error) {
	var instances []Instance
	if err := c.get(ctx, PathInstances, url.Values{"role": {string(RoleControlPlane)}}, &instances); err != nil {
		return nil, fmt.Errorf("listing control-plane instances: %w", err)
	}
	for i, inst := range instances {
		if err := inst.Validate(); err != nil {
			return nil, fmt.Errorf("listing control-plane instances: record %d: %w", i, err)
		}
		// Endpoints are taken from this list: never one of another role.
		if inst.Role != RoleControlPlane {
			return nil, fmt.Errorf("listing control-plane instances: service answered with %q, whose role is %q", inst.Name, inst.Role)
		}
	}
	return instances, nil
}

// InstanceByAddress returns the record of the node that owns addr, or an
// error wrapping ErrNotFound.
func (c *Client) InstanceByAddress(ctx context.Context, addr netip.Addr) (*Instance, error) {
	if !addr.IsValid() {
		return nil, errors.New("looking up instance: address is empty")
	}
	addr = addr.Unmap().WithZone("")
	var inst Instance
	if err := c.get(ctx, PathInstances, url.Values{"address": {addr.String()}}, &inst); err != nil {
		return nil, fmt.Errorf("looking up instance with address %s: %w", addr, err)
	}
	if err := inst.Validate(); err != nil {
		return nil, fmt.Errorf("looking up instance with address %s: invalid record: %w", addr, err)
	}
	// Roles are decided from this record: never accept one for another address.
	if !slices.Contains(inst.Addresses, addr) {
		return nil, fmt.Errorf("looking up instance with address %s: service answered with %q, which does not have that address", addr, inst.Name)
	}
	return &inst, nil
}

func (c *Client) get(ctx context.Context, path string, query url.Values, out any) error {
	base, err := url.Parse(c.BaseURL)
	if err != nil {
		return fmt.Errorf("parsing metadata base URL: %w", err)
	}
	if (base.Scheme != "http" && base.Scheme != "https") || base.Host == "" {
		return fmt.Errorf("metadata base URL %q is not an http(s) URL with a host", c.BaseURL)
	}
	u := base.JoinPath(path)
	u.RawQuery = query.Encode()

	hc, err := c.httpClient()
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return fmt.Errorf("building metadata request: %w", err)
	}
	req.Header.Set("Accept", "application/json")
	resp, err := hc.Do(req)
	if err != nil {
		return fmt.Errorf("requesting %s: %w", u.Redacted(), err)
	}
	defer resp.Body.Close()

	body, err := io.ReadAll(io.LimitReader(resp.Body, MaxDocumentSize+1))
	if err != nil {
		return fmt.Errorf("reading response from %s: %w", u.Redacted(), err)
	}
	switch {
	case resp.StatusCode == http.StatusNotFound:
		return fmt.Errorf("%w (%s)", ErrNotFound, serverMessage(body))
	case resp.StatusCode != http.StatusOK:
		return fmt.Errorf("metadata service answered %s: %s", resp.Status, serverMessage(body))
	case len(body) > MaxDocumentSize:
		return fmt.Errorf("response from %s is larger than %d bytes", u.Redacted(), MaxDocumentSize)
	}
	if err := json.Unmarshal(body, out); err != nil {
		return fmt.Errorf("decoding response from %s: %w", u.Redacted(), err)
	}
	return nil
}

// httpClient returns the client to use. With LocalAddr set it derives one
// that dials from that address; keep-alives are off there because each call
// gets a fresh transport, and idle connections would otherwise leak.
func (c *Client) httpClient() (*http.Client, error) {
	hc := c.HTTPClient
	if hc == nil {
		hc = defaultHTTPClient
	}
	if !c.LocalAddr.IsValid() {
		return hc, nil
	}
	rt := hc.Transport
	if rt == nil {
		rt = http.DefaultTransport
	}
	tr, ok := rt.(*http.Transport)
	if !ok {
		return nil, fmt.Errorf("dialing from %s needs an *http.Transport, the HTTP client has %T", c.LocalAddr, rt)
	}
	tr = tr.Clone()
	dialer := &net.Dialer{LocalAddr: &net.TCPAddr{IP: c.LocalAddr.AsSlice(), Zone: c.LocalAddr.Zone()}}
	tr.DialContext = dialer.DialContext
	tr.DisableKeepAlives = true
	derived := *hc
	derived.Transport = tr
	return &derived, nil
}

// serverMessage extracts the service's error text, bounded and printable.
func serverMessage(body []byte) string {
	var e errorBody
	msg := strings.TrimSpace(string(body))
	if json.Unmarshal(body, &e) == nil && e.Error != "" {
		msg = e.Error
	}
	msg = strings.Map(func(r rune) rune {
		if isControl(r) {
			return ' '
		}
		return r
	}, msg)
	if len(msg) > maxErrorMessage {
		msg = strings.ToValidUTF8(msg[:maxErrorMessage], "") + "…"
	}
	if msg == "" {
		msg = "no message"
	}
	return msg
}

// SelfReader reads a node's own record (Client does).
type SelfReader interface {
	Self(ctx context.Context) (*Self, error)
}

// WaitSelf reads the node's own record, retrying with backoff until it succeeds or ctx ends: at boot the
// metadata service may not answer yet.
func WaitSelf(ctx context.Context, r SelfReader, p backoff.Policy, sleep backoff.Sleeper, rnd func() float64, log *slog.Logger) (*Self, error) {
	var self *Self
	err := backoff.Retry(ctx, p, sleep, rnd, func(ctx context.Context) error {
		var err error
		self, err = r.Self(ctx)
		return err
	}, func(attempt int, err error, next time.Duration) {
		log.Warn("reading own metadata", "attempt", attempt, "error", err, "retry_in", next)
	})
	if err != nil {
		return nil, fmt.Errorf("reading own metadata: %w", err)
	}
	return self, nil
}
