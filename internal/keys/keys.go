// Package keys derives every purpose-specific key of a Berth cluster from its master secret.
//
// Each key is derived with HKDF-SHA256 under a typed Label, so one purpose can never be asked for
// the key of another: a Label can only be made by this package, and a disk label only from a
// canonical UUID. The label text becomes the HKDF info string "berth/v1/<label>"; changing it
// changes every key of every existing cluster, so it is fixed here and pinned by tests.
package keys

import (
	"crypto/hkdf"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
)

const (
	infoPrefix = "berth/v1/"

	// A master secret shorter than 256 bits would be the weakest link of every derived key.
	minMasterLen = 32
	minSaltLen   = 16
	minKeyLen    = 16
	maxKeyLen    = 64

	secretLen = 32
	uuidLen   = 36
)

// Label names the purpose of a derived key. Only this package can make one; the zero Label is
// invalid and refused by Derive.
type Label struct {
	name string
}

var (
	// MeasurementSecret labels the secret that nodes extend into their measurements.
	MeasurementSecret = Label{name: "measurement-secret"}
	// ClusterID labels the value the cluster's identity is derived from.
	ClusterID = Label{name: "cluster-id"}
)

// DiskKeySize is the size of a state disk's key: what join services, init servers and operators' recovery
// derive for a DiskLabel, and what a node accepts in a ticket.
const DiskKeySize = 32

// DiskLabel returns the label of the state-disk key for the disk with the given id. Only the
// canonical lowercase form of a UUID (8-4-4-4-12 hex digits) is accepted, so two spellings of
// one id cannot yield two keys and an id cannot smuggle another label ("../measurement-secret").
// The nil UUID is refused: a disk that carries it was never given a real id.
func DiskLabel(diskID string) (Label, error) {
	if err := checkCanonicalUUID(diskID); err != nil {
		return Label{}, fmt.Errorf("disk id %s: %w", quoteID(diskID), err)
	}
	return Label{name: "disk/" + diskID}, nil
}

func checkCanonicalUUID(s string) error {
	switch {
	case s == "":
		return errors.New("empty, want a UUID such as 0f1e2d3c-4b5a-4978-8796-a5b4c3d2e1f0")
	case len(s) != uuidLen:
		return fmt.Errorf("is %d characters long, want a canonical UUID of %d (no braces, no urn:uuid: prefix)", len(s), uuidLen)
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch i {
		case 8, 13, 18, 23:
			if c != '-' {
				return fmt.Errorf("has %q at position %d, want '-' (canonical form is 8-4-4-4-12 hex digits)", c, i)
			}
			continue
		}
		switch {
		case '0' <= c && c <= '9', 'a' <= c && c <= 'f':
		case 'A' <= c && c <= 'F':
			return errors.New("has uppercase hex digits, want the canonical lowercase form")
		default:
			return fmt.Errorf("has %q at position %d, want a lowercase hex digit", c, i)
		}
	}
	if s == "00000000-0000-0000-0000-000000000000" {
		return errors.New("is the nil UUID, which no real disk carries")
	}
	return nil
}

// quoteID quotes a refused id for an error message, shortened so that a caller passing a large
// buffer by mistake does not get it echoed back.
func quoteID(s string) string {
	const maxShown = 48
	if len(s) > maxShown {
		return fmt.Sprintf("%q... (%d bytes)", s[:maxShown], len(s))
	}
	return fmt.Sprintf("%q", s)
}

// String names the purpose, for logs and errors; it holds nothing secret.
func (l Label) String() string {
	if l.name == "" {
		return "<invalid label>"
	}
	return l.name
}

// Derive returns the n-byte key for label l, derived with HKDF-SHA256 from master and salt.
func Derive(master, salt []byte, l Label, n int) ([]byte, error) {
	switch {
	case l.name == "":
		return nil, errors.New("deriving key: invalid (zero) label")
	case len(master) < minMasterLen:
		return nil, fmt.Errorf("deriving %s key: master secret is %d bytes, want at least %d", l, len(master), minMasterLen)
	case len(salt) < minSaltLen:
		return nil, fmt.Errorf("deriving %s key: salt is %d bytes, want at least %d", l, len(salt), minSaltLen)
	case n < minKeyLen || n > maxKeyLen:
		return nil, fmt.Errorf("deriving %s key: key length %d out of range [%d, %d]", l, n, minKeyLen, maxKeyLen)
	}
	key, err := hkdf.Key(sha256.New, master, salt, infoPrefix+l.name, n)
	if err != nil {
		return nil, fmt.Errorf("deriving %s key: %w", l, err)
	}
	return key, nil
}

// NewSecret returns a new random 32-byte master secret.
func NewSecret() ([]byte, error) {
	s := make([]byte, secretLen)
	if _, err := rand.Read(s); err != nil {
		return nil, fmt.Errorf("generating secret: %w", err)
	}
	return s, nil
}

// ClusterIDOf names the cluster of a master secret and salt without revealing anything about them: 32 hex
// digits of the key derived under ClusterID.
func ClusterIDOf(master, salt []byte) (string, error) {
	id, err := Derive(master, salt, ClusterID, 16)
	if err != nil {
		return "", fmt.Errorf("deriving cluster ID: %w", err)
	}
	return fmt.Sprintf("%x", id), nil
}
