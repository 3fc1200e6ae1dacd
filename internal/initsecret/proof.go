package initsecret

import (
	"crypto/hmac"
	"crypto/sha256"
	"errors"
	"fmt"
	"strings"

	"golang.org/x/crypto/argon2"
)

// An admission proof lets an init client show, before the node spends a TPM quote on it, that it can
// compute the init secret's argon2id hash, without sending the secret to a node it has not attested yet:
// the node sends its hash's parameters and salt (Challenge), the client answers an HMAC keyed with the hash
// it computes from the secret over the connection's TLS exporter value (Proof), and the node checks it with
// one HMAC (CheckProof). The proof opens nothing on another connection. It shows knowledge of the hash, which
// whoever reads the node's user-data has too; the init request's secret is still checked with Verify.

// proofLabel separates admission proofs from any other use of the hash as a key.
const proofLabel = "berth init admission\x00"

// Challenge returns what a client needs to prove it can compute encoded's hash: its parameters and salt, as
// the PHC string without its hash, and the hash's length. Neither is secret.
func Challenge(encoded string) (params string, keyLen int, err error) {
	h, err := parse(encoded)
	if err != nil {
		return "", 0, fmt.Errorf("malformed init secret hash: %w", err)
	}
	return parameters(h), len(h.hash), nil
}

func parameters(h phc) string {
	s := h.String()
	return s[:strings.LastIndexByte(s, '$')]
}

// Proof computes from secret the admission proof for nonce of the hash whose parameters and length
// Challenge gave. A node's parameters are checked within the bounds Verify keeps, so a node cannot make
// the client spend more than Verify would.
func Proof(params string, keyLen int, secret, nonce []byte) ([]byte, error) {
	if len(params) > maxEncoded {
		return nil, fmt.Errorf("init secret hash parameters: %d bytes long, want at most %d", len(params), maxEncoded)
	}
	parts := strings.Split(params, "$")
	if len(parts) != 5 || parts[0] != "" {
		return nil, errors.New("init secret hash parameters: want the form $argon2id$v=19$m=<KiB>,t=<passes>,p=<lanes>$<salt>")
	}
	h, err := parseParameters(parts)
	if err != nil {
		return nil, fmt.Errorf("init secret hash parameters: %w", err)
	}
	if keyLen < minKeyLen || keyLen > maxKeyLen {
		return nil, fmt.Errorf("init secret hash length %d, want %d to %d", keyLen, minKeyLen, maxKeyLen)
	}
	if len(secret) == 0 {
		return nil, errors.New("the init secret is empty")
	}
	return mac(argon2.IDKey(secret, h.salt, h.time, h.memory, h.threads, uint32(keyLen)), nonce), nil
}

// CheckProof reports whether proof is the admission proof for nonce of encoded's hash.
func CheckProof(encoded string, nonce, proof []byte) (bool, error) {
	h, err := parse(encoded)
	if err != nil {
		return false, fmt.Errorf("malformed init secret hash: %w", err)
	}
	return hmac.Equal(mac(h.hash, nonce), proof), nil
}

func mac(key, nonce []byte) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte(proofLabel))
	m.Write(nonce)
	return m.Sum(nil)
}
