package cfssl

import (
	"errors"
	"fmt"
)

// Kinds of Error, for errors.Is.
var (
	// ErrUnreachable: no answer from CFSSL (connection refused, DNS, TLS, timeout).
	ErrUnreachable = errors.New("CFSSL unreachable")
	// ErrAuthentication: CFSSL refused the request's HMAC, so the auth key is not the profile's.
	ErrAuthentication = errors.New("CFSSL refused authentication")
	// ErrRefused: CFSSL answered with an error other than authentication (policy, CSR, database ...).
	ErrRefused = errors.New("CFSSL refused to sign")
	// ErrMalformedResponse: the answer is not CFSSL's JSON envelope with a certificate.
	ErrMalformedResponse = errors.New("malformed CFSSL response")
	// ErrCertificateMismatch: CFSSL signed a certificate other than the one asked for.
	ErrCertificateMismatch = errors.New("CFSSL certificate does not match the request")
)

// Error is a failed signing call to CFSSL. It never holds the auth key or the CSR.
type Error struct {
	// Kind is one of the Err values above.
	Kind error
	// URL is CFSSL's base URL, with any password redacted.
	URL string
	// Profile is the signing profile asked for.
	Profile string
	// Status is the HTTP status of CFSSL's answer; zero when there was none.
	Status int
	// Code and Message are CFSSL's error, for ErrAuthentication and ErrRefused.
	Code    int
	Message string
	// Err is the cause, for the other kinds.
	Err error
}

func (e *Error) Error() string {
	switch e.Kind {
	case ErrUnreachable:
		return fmt.Sprintf("CFSSL at %s is unreachable: %v", e.URL, e.Err)
	case ErrAuthentication:
		// CFSSL checks a request for a profile it does not have against its default profile's key.
		return fmt.Sprintf("CFSSL at %s refused authentication (code %d: %q): check that profile %q exists in CFSSL's config and that the auth key is the one its auth_key names", e.URL, e.Code, e.Message, e.Profile)
	case ErrRefused:
		return fmt.Sprintf("CFSSL at %s refused to sign (code %d: %q)", e.URL, e.Code, e.Message)
	case ErrMalformedResponse:
		return fmt.Sprintf("CFSSL at %s sent a malformed response (HTTP %d): %v", e.URL, e.Status, e.Err)
	case ErrCertificateMismatch:
		return fmt.Sprintf("CFSSL at %s returned a certificate that does not match the request: %v", e.URL, e.Err)
	}
	return fmt.Sprintf("CFSSL at %s: %v", e.URL, e.Err)
}

// Is makes errors.Is(err, ErrUnreachable) and the like true for an Error of that kind.
func (e *Error) Is(target error) bool { return target == e.Kind }

func (e *Error) Unwrap() error { return e.Err }
