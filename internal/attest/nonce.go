package attest

import (
	"crypto/tls"
	"errors"
	"fmt"
)

// ExporterLabel is the RFC 8446 §7.5 exporter label whose output is the quote's nonce. It is Berth's own, so
// no other protocol's exporter value can collide with it.
const ExporterLabel = "EXPORTER-berth-attestation-v1"

// NonceSize is the exporter output length: a SHA-256-sized nonce fits every TPM's qualifying data.
const NonceSize = 32

// Nonce is the attestation nonce of one TLS 1.3 connection. Client and server compute the same value; a
// party relaying the evidence to another connection cannot, since it does not hold both ends' secrets.
func Nonce(cs *tls.ConnectionState) ([]byte, error) {
	if cs == nil {
		return nil, errors.New("no TLS connection state")
	}
	if cs.Version != tls.VersionTLS13 {
		return nil, fmt.Errorf("TLS version %#04x: attestation needs TLS 1.3", cs.Version)
	}
	n, err := cs.ExportKeyingMaterial(ExporterLabel, nil, NonceSize)
	if err != nil {
		return nil, fmt.Errorf("deriving attestation nonce: %w", err)
	}
	return n, nil
}
