// Package cfssl asks a CFSSL remote signer (`cfssl serve`) to sign certificates through its authenticated
// signing API, so that the join service can issue kubelet client certificates without holding a CA key: the
// key stays with CFSSL, which also records every certificate it issues in its certificate database.
//
// A request is authenticated with the HMAC-SHA-256 key of the CFSSL signing profile. The join service fixes
// the certificate's subject and names; this package checks that the certificate CFSSL returns carries exactly
// those and the public key of the CSR, so a misconfigured profile cannot hand a node other identities.
package cfssl

import (
	"bytes"
	"context"
	"crypto"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/x509"
	"encoding/asn1"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"
)

const (
	// authSignPath is CFSSL's authenticated signing endpoint.
	authSignPath = "/api/v1/cfssl/authsign"
	// DefaultTimeout bounds one signing call when Signer.Timeout is zero.
	DefaultTimeout = 30 * time.Second
	// maxResponseBytes bounds what is read of CFSSL's answer: a certificate is a few KiB.
	maxResponseBytes = 1 << 20
	// minAuthKeyBytes refuses keys too short to resist guessing; CFSSL's examples use 16 bytes.
	minAuthKeyBytes = 16
	// maxMessageBytes bounds the part of CFSSL's error message or body quoted in an error.
	maxMessageBytes = 256
)

// invalidTokenMessage is the message CFSSL answers when the request's HMAC does not verify under the
// profile's key. CFSSL gives it no code of its own (the code is the HTTP status, 400).
const invalidTokenMessage = "invalid token"

// Signer signs certificate requests with a CFSSL signing profile.
type Signer struct {
	// URL is CFSSL's base URL, such as http://127.0.0.1:8888.
	URL string
	// Profile is the signing profile in CFSSL's config; its auth_key must be AuthKey.
	Profile string
	// AuthKey is the profile's HMAC key (ParseAuthKey decodes the hex form CFSSL's config holds).
	AuthKey []byte
	// Label selects the signer of a multi-root CFSSL; empty for a single CA.
	Label string
	// Client defaults to a client that does not follow redirects.
	Client *http.Client
	// Timeout bounds one Sign call; zero means DefaultTimeout.
	Timeout time.Duration
	// Logger defaults to discarding.
	Logger *slog.Logger
}

// Subject is the certificate's subject, set by the caller whatever the CSR says. A kubelet client
// certificate has CommonName "system:node:<name>" and Organization ["system:nodes"].
type Subject struct {
	CommonName   string
	Organization []string
}

// Request is one certificate to sign.
type Request struct {
	// CSR is a PEM "CERTIFICATE REQUEST"; only its public key is used, with its signature checked.
	CSR []byte
	// Hosts are the certificate's subject alternative names (DNS names, IP addresses); CFSSL ignores the
	// CSR's, so none means none.
	Hosts []string
	// Subject replaces the CSR's subject.
	Subject Subject
}

// ParseAuthKey decodes an auth key in the hexadecimal form of CFSSL's config ("auth_keys": {"name":
// {"type": "standard", "key": "<hex>"}}). The error never quotes the key.
func ParseAuthKey(s string) ([]byte, error) {
	s = strings.TrimSpace(s)
	key, err := hex.DecodeString(s)
	if err != nil {
		return nil, errors.New("CFSSL auth key is not hexadecimal with an even number of digits, as the key in CFSSL's auth_keys is")
	}
	if len(key) < minAuthKeyBytes {
		return nil, fmt.Errorf("CFSSL auth key has %d bytes, want at least %d (%d hex digits)", len(key), minAuthKeyBytes, 2*minAuthKeyBytes)
	}
	return key, nil
}

// signRequest is the JSON sign request CFSSL's sign handlers read. Hosts is never nil: CFSSL copies the
// CSR's names when it is absent.
type signRequest struct {
	Hosts   []string    `json:"hosts"`
	CSR     string      `json:"certificate_request"`
	Subject signSubject `json:"subject"`
	Profile string      `json:"profile"`
	Label   string      `json:"label,omitempty"`
}

// signSubject is CFSSL's subject override: each names entry adds its fields, so one entry per
// organization.
type signSubject struct {
	CN    string     `json:"CN"`
	Names []signName `json:"names"`
}

type signName struct {
	O string `json:"O"`
}

// authRequest is CFSSL's authenticated request: Request holds the sign request's JSON bytes and Token
// their HMAC; encoding/json sends both in base64, as CFSSL reads them.
type authRequest struct {
	Token   []byte `json:"token"`
	Request []byte `json:"request"`
}

// response is CFSSL's answer envelope, for errors and successes alike.
type response struct {
	Success bool            `json:"success"`
	Result  json.RawMessage `json:"result"`
	Errors  []struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	} `json:"errors"`
}

type signResult struct {
	Certificate string `json:"certificate"`
}

// Sign asks CFSSL to sign r and returns the certificate once it is checked to hold the CSR's public key,
// the requested subject and no names beyond r.Hosts. Failures are *Error; errors.Is tells their kind
// (ErrUnreachable, ErrAuthentication, ErrRefused, ErrMalformedResponse, ErrCertificateMismatch).
func (s *Signer) Sign(ctx context.Context, r Request) (*x509.Certificate, error) {
	base, err := s.baseURL()
	if err != nil {
		return nil, err
	}
	if len(s.AuthKey) == 0 {
		return nil, errors.New("CFSSL signer: auth key is required")
	}
	if s.Profile == "" {
		return nil, errors.New("CFSSL signer: profile is required")
	}
	csr, err := parseCSR(r.CSR)
	if err != nil {
		return nil, err
	}
	if err := checkRequest(r, csr); err != nil {
		return nil, err
	}

	body, err := s.body(r, csr)
	if err != nil {
		return nil, err
	}
	timeout := s.Timeout
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	cert, err := s.post(ctx, base, body)
	if err != nil {
		return nil, err
	}
	if err := checkCertificate(cert, r, csr); err != nil {
		return nil, &Error{Kind: ErrCertificateMismatch, URL: base.Redacted(), Profile: s.Profile, Err: err}
	}
	s.logger().Info("CFSSL signed certificate",
		"cfssl", base.Redacted(), "profile", s.Profile, "serial", cert.SerialNumber.Text(16),
		"common_name", cert.Subject.CommonName, "not_after", cert.NotAfter.UTC().Format(time.RFC3339))
	return cert, nil
}

func (s *Signer) baseURL() (*url.URL, error) {
	u, err := url.Parse(s.URL)
	if err != nil {
		// The parser's error would quote the URL, with any password in it.
		return nil, errors.New("CFSSL signer: the URL does not parse; want an http:// or https:// URL with a host, such as http://127.0.0.1:8888")
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("CFSSL signer: URL %q is wrong; want an http:// or https:// URL with a host, such as http://127.0.0.1:8888", u.Redacted())
	}
	return u, nil
}

func (s *Signer) logger() *slog.Logger {
	if s.Logger == nil {
		return slog.New(slog.DiscardHandler)
	}
	return s.Logger
}

func (s *Signer) client() *http.Client {
	if s.Client != nil {
		return s.Client
	}
	// A redirect would carry the request elsewhere; CFSSL never answers with one.
	return &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
}

// body builds the authenticated request: the HMAC covers the exact sign request bytes sent. The CSR goes
// as the one block that was checked, without what else r.CSR may hold.
func (s *Signer) body(r Request, csr *x509.CertificateRequest) ([]byte, error) {
	sr := signRequest{
		Hosts:   append([]string{}, r.Hosts...),
		CSR:     string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: csr.Raw})),
		Subject: signSubject{CN: r.Subject.CommonName, Names: []signName{}},
		Profile: s.Profile,
		Label:   s.Label,
	}
	for _, o := range r.Subject.Organization {
		sr.Subject.Names = append(sr.Subject.Names, signName{O: o})
	}
	inner, err := json.Marshal(sr)
	if err != nil {
		return nil, fmt.Errorf("encoding CFSSL sign request: %w", err)
	}
	mac := hmac.New(sha256.New, s.AuthKey)
	mac.Write(inner)
	outer, err := json.Marshal(authRequest{Token: mac.Sum(nil), Request: inner})
	if err != nil {
		return nil, fmt.Errorf("encoding CFSSL authenticated request: %w", err)
	}
	return outer, nil
}

func (s *Signer) post(ctx context.Context, base *url.URL, body []byte) (*x509.Certificate, error) {
	where := base.Redacted()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base.JoinPath(authSignPath).String(), bytes.NewReader(body))
	if err != nil {
		return nil, fmt.Errorf("CFSSL signer: building request to %s: %w", where, err)
	}
	req.Header.Set("Content-Type", "application/json")
	cert, e := s.exchange(req)
	if e != nil {
		e.URL, e.Profile = where, s.Profile
		return nil, e
	}
	return cert, nil
}

// exchange sends req and reads CFSSL's answer; the caller fills in the error's URL and profile.
func (s *Signer) exchange(req *http.Request) (*x509.Certificate, *Error) {
	resp, err := s.client().Do(req)
	if err != nil {
		return nil, &Error{Kind: ErrUnreachable, Err: transportError(err)}
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, maxResponseBytes+1))
	if err != nil {
		return nil, &Error{Kind: ErrUnreachable, Status: resp.StatusCode, Err: fmt.Errorf("reading the response: %w", transportError(err))}
	}
	if len(raw) > maxResponseBytes {
		return nil, &Error{Kind: ErrMalformedResponse, Status: resp.StatusCode, Err: fmt.Errorf("the response exceeds %d bytes", maxResponseBytes)}
	}
	return parseResponse(resp.StatusCode, raw)
}

// transportError strips the *url.Error wrapper, whose text repeats the method and URL the caller already
// names, and says when the cause is the deadline: CFSSL may then be reachable but hanging.
func transportError(err error) error {
	if ue, ok := errors.AsType[*url.Error](err); ok {
		err = ue.Err
	}
	if ne, ok := errors.AsType[net.Error](err); errors.Is(err, context.DeadlineExceeded) || ok && ne.Timeout() {
		return fmt.Errorf("no answer before the deadline: %w", err)
	}
	return err
}

func parseResponse(status int, raw []byte) (*x509.Certificate, *Error) {
	malformed := func(format string, args ...any) *Error {
		return &Error{Kind: ErrMalformedResponse, Status: status, Err: fmt.Errorf(format, args...)}
	}
	var env response
	if err := json.Unmarshal(raw, &env); err != nil {
		return nil, malformed("not CFSSL's JSON envelope (%v); the body starts with %q", err, clip(raw))
	}
	if !env.Success {
		if len(env.Errors) == 0 {
			return nil, malformed("success is false but no error is given")
		}
		e := env.Errors[0]
		kind := ErrRefused
		if e.Message == invalidTokenMessage {
			kind = ErrAuthentication
		}
		return nil, &Error{Kind: kind, Status: status, Code: e.Code, Message: string(clip([]byte(e.Message)))}
	}
	if status != http.StatusOK {
		return nil, malformed("success is true with HTTP status %d", status)
	}
	var res signResult
	if err := json.Unmarshal(env.Result, &res); err != nil || res.Certificate == "" {
		return nil, malformed("the result holds no certificate")
	}
	block, rest := pem.Decode([]byte(res.Certificate))
	if block == nil || block.Type != "CERTIFICATE" {
		return nil, malformed("the result's certificate is not a PEM CERTIFICATE")
	}
	if len(bytes.TrimSpace(rest)) != 0 {
		return nil, malformed("the result's certificate is followed by more data")
	}
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		return nil, malformed("parsing the returned certificate: %v", err)
	}
	return cert, nil
}

// clip shortens text from CFSSL for an error message; %q quoting at the call sites keeps control
// characters out of logs.
func clip(b []byte) []byte {
	if len(b) > maxMessageBytes {
		return append(b[:maxMessageBytes:maxMessageBytes], "…"...)
	}
	return b
}

// parseCSR decodes and checks the CSR without quoting it in errors.
func parseCSR(p []byte) (*x509.CertificateRequest, error) {
	block, _ := pem.Decode(p)
	if block == nil || block.Type != "CERTIFICATE REQUEST" {
		return nil, errors.New("CFSSL signer: the CSR is not a PEM CERTIFICATE REQUEST")
	}
	csr, err := x509.ParseCertificateRequest(block.Bytes)
	if err != nil {
		return nil, fmt.Errorf("CFSSL signer: parsing the CSR: %w", err)
	}
	if err := csr.CheckSignature(); err != nil {
		return nil, fmt.Errorf("CFSSL signer: the CSR's signature does not verify: %w", err)
	}
	return csr, nil
}

var (
	oidCommonName   = asn1.ObjectIdentifier{2, 5, 4, 3}
	oidOrganization = asn1.ObjectIdentifier{2, 5, 4, 10}
)

// checkRequest refuses what CFSSL would sign into a certificate the caller did not ask for: CFSSL fills
// subject fields the request leaves empty (country, organizational unit, ...) from the CSR, and then
// checkCertificate would throw away a certificate already recorded in CFSSL's database.
func checkRequest(r Request, csr *x509.CertificateRequest) error {
	if r.Subject.CommonName == "" {
		return errors.New("CFSSL signer: the subject's common name is required")
	}
	for _, o := range r.Subject.Organization {
		if o == "" {
			return errors.New("CFSSL signer: the subject has an empty organization")
		}
	}
	for _, h := range r.Hosts {
		if h == "" {
			return errors.New("CFSSL signer: a host name is empty")
		}
	}
	for _, attr := range csr.Subject.Names {
		if !attr.Type.Equal(oidCommonName) && !attr.Type.Equal(oidOrganization) {
			return fmt.Errorf("CFSSL signer: the CSR's subject has attribute %s, which CFSSL would copy into the certificate; only CN and O are allowed", attr.Type)
		}
	}
	if len(r.Subject.Organization) == 0 && len(csr.Subject.Organization) > 0 {
		return errors.New("CFSSL signer: the CSR's subject has an organization and the request sets none, so CFSSL would copy the CSR's")
	}
	return nil
}

// checkCertificate compares the certificate with what was asked: the CSR's key, exactly the requested
// subject, no names beyond the requested hosts, and not a CA.
func checkCertificate(cert *x509.Certificate, r Request, csr *x509.CertificateRequest) error {
	pub, ok := csr.PublicKey.(interface{ Equal(crypto.PublicKey) bool })
	if !ok || !pub.Equal(cert.PublicKey) {
		return errors.New("its public key is not the CSR's")
	}
	if cert.Subject.CommonName != r.Subject.CommonName {
		return fmt.Errorf("its common name is %q, want %q", cert.Subject.CommonName, r.Subject.CommonName)
	}
	if !slices.Equal(cert.Subject.Organization, r.Subject.Organization) {
		return fmt.Errorf("its organizations are %q, want %q", cert.Subject.Organization, r.Subject.Organization)
	}
	for _, attr := range cert.Subject.Names {
		if !attr.Type.Equal(oidCommonName) && !attr.Type.Equal(oidOrganization) {
			return fmt.Errorf("its subject has attribute %s, want only CN and O", attr.Type)
		}
	}
	want := make(map[string]bool, len(r.Hosts))
	for _, h := range r.Hosts {
		want[normalizeHost(h)] = true
	}
	var names []string
	names = append(names, cert.DNSNames...)
	names = append(names, cert.EmailAddresses...)
	for _, ip := range cert.IPAddresses {
		names = append(names, ip.String())
	}
	for _, u := range cert.URIs {
		names = append(names, u.String())
	}
	for _, n := range names {
		if !want[normalizeHost(n)] {
			return fmt.Errorf("it names %q, which the request did not", n)
		}
	}
	if cert.IsCA {
		return errors.New("it is a CA certificate")
	}
	return nil
}

// normalizeHost makes the textual forms of one IP address compare equal.
func normalizeHost(h string) string {
	if ip := net.ParseIP(h); ip != nil {
		return ip.String()
	}
	return h
}
