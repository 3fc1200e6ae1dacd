// Package initsecret makes the init secret and checks it against its argon2id hash.
//
// The operator (through Terraform) holds the init secret; the first control-plane node gets only
// its hash, in a PHC string from instance metadata, and its init server accepts an init request
// only with the matching secret. Metadata is not a trusted source, so Verify bounds the hash
// parameters it will compute with: a forged document must not make the node spend gigabytes of
// memory or minutes of CPU on a single request.
package initsecret

import (
	"crypto/rand"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"golang.org/x/crypto/argon2"
)

// Parameters of Hash. The secret is 256 random bits, so no cost makes guessing it any harder;
// argon2id with 64 MiB and two passes (above OWASP's 2023 minimum of 19 MiB, t=2, p=1) is
// defense in depth for an operator who sets a secret of their own, while staying cheap enough
// for a node that checks one init request.
// SaltSize is the length of the salt in the hashes this package makes.
const SaltSize = 16

const (
	hashMemory  = 64 * 1024 // KiB
	hashTime    = 2
	hashThreads = 1
	hashKeyLen  = 32
	secretLen   = 32
)

// Bounds of what Verify computes with, whatever the metadata says.
const (
	maxMemory   = 256 * 1024 // KiB
	maxTime     = 10
	maxThreads  = 4
	minSaltLen  = 16
	maxSaltLen  = 64
	minKeyLen   = 16
	maxKeyLen   = 64
	maxEncoded  = 256
	algorithm   = "argon2id"
	versionPart = "v=19"
)

// phc is a parsed "$argon2id$v=19$m=…,t=…,p=…$salt$hash" string.
type phc struct {
	memory  uint32
	time    uint32
	threads uint8
	salt    []byte
	hash    []byte
}

func (h phc) String() string {
	enc := base64.RawStdEncoding
	return fmt.Sprintf("$%s$%s$m=%d,t=%d,p=%d$%s$%s", algorithm, versionPart,
		h.memory, h.time, h.threads, enc.EncodeToString(h.salt), enc.EncodeToString(h.hash))
}

// NewSecret returns a new init secret: 32 random bytes in unpadded base64url, the text an
// operator pastes. Hash and Verify take that text as it is, not the bytes it encodes.
func NewSecret() (string, error) {
	b := make([]byte, secretLen)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("generating init secret: %w", err)
	}
	return base64.RawURLEncoding.EncodeToString(b), nil
}

// Hash returns the argon2id PHC string of secret, with a new random salt.
func Hash(secret []byte) (string, error) {
	salt := make([]byte, SaltSize)
	if _, err := rand.Read(salt); err != nil {
		return "", fmt.Errorf("hashing init secret: generating salt: %w", err)
	}
	return HashWithSalt(secret, salt)
}

// HashWithSalt is Hash with a salt of SaltSize bytes the caller derives, for a hash that must come out the
// same each time it is made again (berth_secrets, imported from its root key, must reproduce the hash the
// first control-plane node's user-data already carries).
func HashWithSalt(secret, salt []byte) (string, error) {
	if len(secret) == 0 {
		return "", errors.New("hashing init secret: secret is empty")
	}
	if len(salt) != SaltSize {
		return "", fmt.Errorf("hashing init secret: salt is %d bytes, want %d", len(salt), SaltSize)
	}
	h := phc{memory: hashMemory, time: hashTime, threads: hashThreads, salt: salt}
	h.hash = argon2.IDKey(secret, h.salt, h.time, h.memory, h.threads, hashKeyLen)
	return h.String(), nil
}

// Verify reports whether secret matches the PHC string encoded, comparing in constant time. It
// returns an error only when encoded is malformed or asks for more work than the bounds allow;
// the error never depends on secret. An empty secret matches nothing.
func Verify(encoded string, secret []byte) (bool, error) {
	h, err := parse(encoded)
	if err != nil {
		return false, fmt.Errorf("malformed init secret hash: %w", err)
	}
	if len(secret) == 0 {
		return false, nil
	}
	got := argon2.IDKey(secret, h.salt, h.time, h.memory, h.threads, uint32(len(h.hash)))
	return subtle.ConstantTimeCompare(got, h.hash) == 1, nil
}

// parse reads the canonical form only (as phc.String writes it), so that one hash has one
// spelling. Errors name fields and numbers, never echo the input.
func parse(s string) (phc, error) {
	if len(s) > maxEncoded {
		return phc{}, fmt.Errorf("%d bytes long, want at most %d", len(s), maxEncoded)
	}
	parts := strings.Split(s, "$")
	if len(parts) != 6 || parts[0] != "" {
		return phc{}, errors.New("want the form $argon2id$v=19$m=<KiB>,t=<passes>,p=<lanes>$<salt>$<hash>")
	}
	h, err := parseParameters(parts[:5])
	if err != nil {
		return phc{}, err
	}
	if h.hash, err = field(parts[5], "hash", minKeyLen, maxKeyLen); err != nil {
		return phc{}, err
	}
	return h, nil
}

// parseParameters reads the parts of a PHC string before its hash: "", algorithm, version, parameters
// and salt.
func parseParameters(parts []string) (phc, error) {
	if parts[1] != algorithm {
		return phc{}, errors.New("algorithm is not argon2id")
	}
	if parts[2] != versionPart {
		return phc{}, errors.New("version is not v=19")
	}

	var h phc
	params := strings.Split(parts[3], ",")
	if len(params) != 3 {
		return phc{}, errors.New("parameters are not exactly m=<KiB>,t=<passes>,p=<lanes>")
	}
	m, err := param(params[0], "m", maxMemory)
	if err != nil {
		return phc{}, err
	}
	t, err := param(params[1], "t", maxTime)
	if err != nil {
		return phc{}, err
	}
	p, err := param(params[2], "p", maxThreads)
	if err != nil {
		return phc{}, err
	}
	// RFC 9106 §3.1: at least 8 KiB per lane.
	if m < 8*p {
		return phc{}, fmt.Errorf("memory m=%d is below the minimum of 8 KiB per lane (%d)", m, 8*p)
	}
	h.memory, h.time, h.threads = m, t, uint8(p)

	if h.salt, err = field(parts[4], "salt", minSaltLen, maxSaltLen); err != nil {
		return phc{}, err
	}
	return h, nil
}

// param reads "name=<decimal>" with a value in [1, limit], without sign or leading zeros.
func param(s, name string, limit uint32) (uint32, error) {
	v, ok := strings.CutPrefix(s, name+"=")
	if !ok {
		return 0, fmt.Errorf("parameter %s missing or out of order (want m, t, p)", name)
	}
	if v == "" || len(v) > 10 || v[0] == '0' || strings.Trim(v, "0123456789") != "" {
		return 0, fmt.Errorf("parameter %s is not a positive decimal number", name)
	}
	n, err := strconv.ParseUint(v, 10, 32)
	if err != nil || n > uint64(limit) {
		return 0, fmt.Errorf("parameter %s=%s is above the limit of %d", name, v, limit)
	}
	return uint32(n), nil
}

// field decodes unpadded standard base64 and checks its length. Re-encoding must give the input
// back, which refuses padding, line breaks (the decoder would skip them) and stray low bits.
func field(s, name string, minLen, maxLen int) ([]byte, error) {
	b, err := base64.RawStdEncoding.DecodeString(s)
	if err != nil || base64.RawStdEncoding.EncodeToString(b) != s {
		return nil, fmt.Errorf("%s is not canonical unpadded base64", name)
	}
	if len(b) < minLen || len(b) > maxLen {
		return nil, fmt.Errorf("%s is %d bytes, want %d to %d", name, len(b), minLen, maxLen)
	}
	return b, nil
}
