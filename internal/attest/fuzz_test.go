package attest_test

import (
	"bufio"
	"context"
	"crypto/sha256"
	"crypto/x509"
	"encoding/binary"
	"encoding/pem"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/attest"
)

// fuzzEKRoot is a fixed EK root whose key was thrown away after signing the RSA EK certificate in the seeds
// under testdata/fuzz/FuzzVerify. Trusting it lets fuzzed evidence get past the EK chain to the attestation
// key and the quote, where the parsing of TPM structures happens.
const fuzzEKRoot = `-----BEGIN CERTIFICATE-----
MIIBbDCCAROgAwIBAgIBATAKBggqhkjOPQQDAjAdMRswGQYDVQQDExJCZXJ0aCBm
dXp6IEVLIHJvb3QwIBcNMjAwMTAxMDAwMDAwWhgPMjA5OTEyMzEwMDAwMDBaMB0x
GzAZBgNVBAMTEkJlcnRoIGZ1enogRUsgcm9vdDBZMBMGByqGSM49AgEGCCqGSM49
AwEHA0IABNA7x9lEmiCwvJPGg5iSAcYYJrslHWYEQyIHulyIyoTREYDdmHJMsTT1
unplXtd6A1YjAATFyasgfATTGj77c4KjQjBAMA4GA1UdDwEB/wQEAwICBDAPBgNV
HRMBAf8EBTADAQH/MB0GA1UdDgQWBBR0utXU6lao9FQtA/RLWCbDuzrJETAKBggq
hkjOPQQDAgNHADBEAiASqUEEc25d9ocZyAKnIkxYxCYzoOLtJwF0rs+tTCugdgIg
W86boPPcr+hc7haw7lsKz9WkIbzJFGEOeBxFd8lQjJY=
-----END CERTIFICATE-----
`

// fuzzNonce is the connection nonce every fuzzed evidence is checked against. The seeds' quotes were made by a
// real TPM (swtpm) over another nonce, so no seed is one signature away from being accepted.
var fuzzNonce = func() []byte { n := sha256.Sum256([]byte("FuzzVerify")); return n[:] }()

func fuzzVerifier(t testing.TB) *attest.Verifier {
	t.Helper()
	block, _ := pem.Decode([]byte(fuzzEKRoot))
	root, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AddCert(root)
	return attest.NewVerifier(attest.NewCertChain(roots, nil, func() time.Time { return time.Date(2030, 6, 1, 0, 0, 0, 0, time.UTC) }))
}

// evidenceFrom splits data into evidence: seven fields each as a big-endian uint16 length and that many
// bytes (EK certificate, AK public, AK creation data, creation attestation, creation signature, quote, quote
// signature), then PCR values each as an index byte, a length byte and that many bytes. Whatever data lacks
// stays empty.
func evidenceFrom(data []byte) *berthv1.Evidence {
	next := func(n int) []byte {
		n = min(n, len(data))
		b := data[:n:n]
		data = data[n:]
		return b
	}
	field := func() []byte {
		l := next(2)
		if len(l) < 2 {
			return nil
		}
		return next(int(binary.BigEndian.Uint16(l)))
	}
	ev := &berthv1.Evidence{}
	for _, f := range []*[]byte{&ev.EkCertificate, &ev.AkPublic, &ev.AkCreateData, &ev.AkCreateAttestation,
		&ev.AkCreateSignature, &ev.Quote, &ev.QuoteSignature} {
		*f = field()
	}
	for len(data) >= 2 {
		hdr := next(2)
		if ev.Pcrs == nil {
			ev.Pcrs = map[uint32][]byte{}
		}
		ev.Pcrs[uint32(hdr[0])] = next(int(hdr[1]))
	}
	return ev
}

// FuzzVerify checks that no evidence made of arbitrary bytes panics the verifier or passes it. Passing would
// take a quote and a creation attestation signed over fuzzNonce by the key in the AK public area, which no
// fuzzer can produce.
func FuzzVerify(f *testing.F) {
	v := fuzzVerifier(f)
	f.Fuzz(func(t *testing.T, data []byte) {
		ev := evidenceFrom(data)
		pending, err := v.Verify(context.Background(), ev, fuzzNonce, "")
		if err == nil {
			t.Fatalf("fuzzed evidence verified: challenge %v", pending.Challenge)
		}
		if !errors.Is(err, attest.ErrMalformed) && !errors.Is(err, attest.ErrUntrusted) {
			t.Fatalf("error %v is neither ErrMalformed nor ErrUntrusted", err)
		}
		if pending != nil {
			t.Fatalf("Verify returned pending evidence with the error %v", err)
		}
	})
}

// readSeed reads a corpus file in the `go test fuzz v1` format holding one []byte.
func readSeed(t *testing.T, name string) []byte {
	t.Helper()
	f, err := os.Open(filepath.Join("testdata", "fuzz", "FuzzVerify", name))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	if !sc.Scan() || sc.Text() != "go test fuzz v1" || !sc.Scan() {
		t.Fatalf("seed %s is not in the go test fuzz v1 format", name)
	}
	quoted, ok := strings.CutSuffix(strings.TrimPrefix(sc.Text(), "[]byte("), ")")
	if !ok {
		t.Fatalf("seed %s does not hold a []byte", name)
	}
	s, err := strconv.Unquote(quoted)
	if err != nil {
		t.Fatalf("seed %s: %v", name, err)
	}
	return []byte(s)
}

// TestFuzzVerifySeeds keeps the fuzz corpus meaningful: the fixed EK certificate still chains to fuzzEKRoot at
// the verifier's clock, so its seeds reach the checks behind the chain.
func TestFuzzVerifySeeds(t *testing.T) {
	v := fuzzVerifier(t)
	for seed, want := range map[string]string{
		"trusted-ek-quote-for-another-nonce": "quote",
		"trusted-ek-pcr-index-out-of-range":  "PCR 30",
		"trusted-ek-short-pcr":               "PCR 4",
		"trusted-ek-no-pcrs":                 "no PCR values",
		"swtpm-untrusted-ek":                 "does not chain to a trusted EK root",
		"ek-only":                            "of 0 bytes",
		"empty":                              "neither an EK certificate nor an EK public key",
	} {
		t.Run(seed, func(t *testing.T) {
			ev := evidenceFrom(readSeed(t, seed))
			_, err := v.Verify(context.Background(), ev, fuzzNonce, "")
			if err == nil || !strings.Contains(err.Error(), want) {
				t.Fatalf("Verify: %v, want an error containing %q", err, want)

			}
		})
	}
}
