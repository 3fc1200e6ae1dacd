package keys

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"regexp"
	"strings"
	"testing"
)

// refHKDF is an HKDF-SHA256 written from RFC 5869 with crypto/hmac, independent of crypto/hkdf,
// so that the known-answer test does not check the library against itself.
func refHKDF(secret, salt []byte, info string, n int) []byte {
	ext := hmac.New(sha256.New, salt)
	ext.Write(secret)
	prk := ext.Sum(nil)

	var okm, prev []byte
	for i := byte(1); len(okm) < n; i++ {
		exp := hmac.New(sha256.New, prk)
		exp.Write(prev)
		exp.Write([]byte(info))
		exp.Write([]byte{i})
		prev = exp.Sum(nil)
		okm = append(okm, prev...)
	}
	return okm[:n]
}

func mustHex(t *testing.T, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(s)
	if err != nil {
		t.Fatalf("bad hex in test: %v", err)
	}
	return b
}

func TestRefHKDFMatchesRFC5869(t *testing.T) {
	// RFC 5869, appendix A.1.
	ikm := bytes.Repeat([]byte{0x0b}, 22)
	salt := mustHex(t, "000102030405060708090a0b0c")
	info := string(mustHex(t, "f0f1f2f3f4f5f6f7f8f9"))
	want := mustHex(t, "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865")
	if got := refHKDF(ikm, salt, info, 42); !bytes.Equal(got, want) {
		t.Fatalf("reference HKDF = %x, want %x", got, want)
	}
}

func testMaster() []byte { return bytes.Repeat([]byte{0x42}, 32) }
func testSalt() []byte   { return []byte("berth-test-salt-0123") }

func TestDeriveKnownAnswer(t *testing.T) {
	const diskID = "0f1e2d3c-4b5a-4978-8796-a5b4c3d2e1f0"
	disk, err := DiskLabel(diskID)
	if err != nil {
		t.Fatalf("DiskLabel: %v", err)
	}
	tests := []struct {
		label Label
		info  string
		n     int
	}{
		{disk, "berth/v1/disk/" + diskID, 32},
		{disk, "berth/v1/disk/" + diskID, 64},
		{MeasurementSecret, "berth/v1/measurement-secret", 32},
		{ClusterID, "berth/v1/cluster-id", 16},
	}
	for _, tt := range tests {
		t.Run(tt.info, func(t *testing.T) {
			got, err := Derive(testMaster(), testSalt(), tt.label, tt.n)
			if err != nil {
				t.Fatalf("Derive: %v", err)
			}
			want := refHKDF(testMaster(), testSalt(), tt.info, tt.n)
			if !bytes.Equal(got, want) {
				t.Fatalf("Derive = %x, want %x", got, want)
			}
		})
	}
}

func TestDeriveDistinct(t *testing.T) {
	diskA, err := DiskLabel("0f1e2d3c-4b5a-4978-8796-a5b4c3d2e1f0")
	if err != nil {
		t.Fatal(err)
	}
	diskB, err := DiskLabel("0f1e2d3c-4b5a-4978-8796-a5b4c3d2e1f1")
	if err != nil {
		t.Fatal(err)
	}
	otherSalt := append(testSalt(), 'x')
	otherMaster := append(testMaster()[:31:31], 0x43)

	seen := map[string]string{}
	add := func(name string, master, salt []byte, l Label) {
		t.Helper()
		k, err := Derive(master, salt, l, 32)
		if err != nil {
			t.Fatalf("%s: Derive: %v", name, err)
		}
		if prev, ok := seen[string(k)]; ok {
			t.Fatalf("%s and %s derived the same key", prev, name)
		}
		seen[string(k)] = name
	}
	add("disk A", testMaster(), testSalt(), diskA)
	add("disk B", testMaster(), testSalt(), diskB)
	add("measurement secret", testMaster(), testSalt(), MeasurementSecret)
	add("cluster id", testMaster(), testSalt(), ClusterID)
	add("disk A, other salt", testMaster(), otherSalt, diskA)
	add("measurement secret, other salt", testMaster(), otherSalt, MeasurementSecret)
	add("disk A, other master", otherMaster, testSalt(), diskA)
}

func TestDeriveDeterministic(t *testing.T) {
	a, err := Derive(testMaster(), testSalt(), ClusterID, 32)
	if err != nil {
		t.Fatal(err)
	}
	b, err := Derive(testMaster(), testSalt(), ClusterID, 32)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a, b) {
		t.Fatal("two derivations with the same inputs differ")
	}
}

func TestDeriveRefusals(t *testing.T) {
	master := testMaster()
	tests := []struct {
		name    string
		master  []byte
		salt    []byte
		label   Label
		n       int
		wantErr string
	}{
		{"zero label", master, testSalt(), Label{}, 32, "invalid (zero) label"},
		{"short master", master[:31], testSalt(), ClusterID, 32, "master secret is 31 bytes, want at least 32"},
		{"nil master", nil, testSalt(), ClusterID, 32, "master secret is 0 bytes"},
		{"short salt", master, make([]byte, 15), ClusterID, 32, "salt is 15 bytes, want at least 16"},
		{"nil salt", master, nil, ClusterID, 32, "salt is 0 bytes"},
		{"key too short", master, testSalt(), ClusterID, 15, "key length 15 out of range [16, 64]"},
		{"key too long", master, testSalt(), ClusterID, 65, "key length 65 out of range [16, 64]"},
		{"negative length", master, testSalt(), ClusterID, -1, "key length -1 out of range"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			k, err := Derive(tt.master, tt.salt, tt.label, tt.n)
			if err == nil {
				t.Fatalf("Derive succeeded with %d-byte key, want error", len(k))
			}
			if !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("error %q does not contain %q", err, tt.wantErr)
			}
			if strings.Contains(err.Error(), string(master[:8])) || strings.Contains(err.Error(), hex.EncodeToString(master[:8])) {
				t.Fatalf("error %q leaks master secret", err)
			}
		})
	}
}

func TestDiskLabel(t *testing.T) {
	tests := []struct {
		name    string
		id      string
		wantErr string
	}{
		{"canonical", "0f1e2d3c-4b5a-4978-8796-a5b4c3d2e1f0", ""},
		{"all hex letters", "abcdefab-cdef-abcd-efab-cdefabcdefab", ""},
		{"max", "ffffffff-ffff-ffff-ffff-ffffffffffff", ""},
		{"empty", "", "empty"},
		{"uppercase", "0F1E2D3C-4B5A-4978-8796-A5B4C3D2E1F0", "uppercase"},
		{"one uppercase", "0f1e2d3c-4b5a-4978-8796-a5b4c3d2e1fA", "uppercase"},
		{"braces", "{0f1e2d3c-4b5a-4978-8796-a5b4c3d2e1f0}", "38 characters long"},
		{"urn", "urn:uuid:0f1e2d3c-4b5a-4978-8796-a5b4c3d2e1f0", "45 characters long"},
		{"no hyphens", "0f1e2d3c4b5a49788796a5b4c3d2e1f0", "32 characters long"},
		{"path", "../x", "4 characters long"},
		{"path of right length", "../../../../measurement-secret/aaaaa", "'.' at position 0"},
		{"misplaced hyphen", "0f1e2d3c4-b5a-4978-8796-a5b4c3d2e1f0", "position 8"},
		{"non-hex", "0f1e2d3c-4b5a-4978-8796-a5b4c3d2e1g0", "'g' at position 34"},
		{"slash", "0f1e2d3c-4b5a-4978-8796-a5b4c3d2e1/0", "'/' at position 34"},
		{"space", " f1e2d3c-4b5a-4978-8796-a5b4c3d2e1f0", "position 0"},
		{"nil uuid", "00000000-0000-0000-0000-000000000000", "nil UUID"},
		{"multibyte", "0f1e2d3c-4b5a-4978-8796-a5b4c3d2e1é", "position 34"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l, err := DiskLabel(tt.id)
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("DiskLabel(%q): %v", tt.id, err)
				}
				if got, want := l.String(), "disk/"+tt.id; got != want {
					t.Fatalf("String() = %q, want %q", got, want)
				}
				return
			}
			if err == nil {
				t.Fatalf("DiskLabel(%q) = %v, want error", tt.id, l)
			}
			if !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("error %q does not contain %q", err, tt.wantErr)
			}
			if l != (Label{}) {
				t.Fatalf("refused id returned non-zero label %v", l)
			}
			if _, err := Derive(testMaster(), testSalt(), l, 32); err == nil {
				t.Fatal("label returned with an error was accepted by Derive")
			}
		})
	}
}

func TestDiskLabelErrorShortensLongInput(t *testing.T) {
	id := strings.Repeat("a", 10000)
	_, err := DiskLabel(id)
	if err == nil {
		t.Fatal("want error")
	}
	if len(err.Error()) > 300 {
		t.Fatalf("error is %d bytes long; a long id must not be echoed in full", len(err.Error()))
	}
	if !strings.Contains(err.Error(), "10000 bytes") {
		t.Fatalf("error %q does not give the length", err)
	}
}

func TestLabelString(t *testing.T) {
	tests := []struct {
		l    Label
		want string
	}{
		{MeasurementSecret, "measurement-secret"},
		{ClusterID, "cluster-id"},
		{Label{}, "<invalid label>"},
	}
	for _, tt := range tests {
		if got := tt.l.String(); got != tt.want {
			t.Errorf("String() = %q, want %q", got, tt.want)
		}
	}
}

func TestNewSecret(t *testing.T) {
	a, err := NewSecret()
	if err != nil {
		t.Fatal(err)
	}
	b, err := NewSecret()
	if err != nil {
		t.Fatal(err)
	}
	if len(a) != 32 || len(b) != 32 {
		t.Fatalf("lengths %d, %d, want 32", len(a), len(b))
	}
	if bytes.Equal(a, b) {
		t.Fatal("two secrets are equal")
	}
	if _, err := Derive(a, testSalt(), ClusterID, 32); err != nil {
		t.Fatalf("a new secret is refused as master: %v", err)
	}
}

func TestClusterIDOf(t *testing.T) {
	id, err := ClusterIDOf(secretOf(1), secretOf(2))
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`^[0-9a-f]{32}$`).MatchString(id) {
		t.Errorf("cluster ID %q is not 32 lowercase hex digits", id)
	}
	again, err := ClusterIDOf(secretOf(1), secretOf(2))
	if err != nil || again != id {
		t.Errorf("ClusterID is not stable: %q then %q (%v)", id, again, err)
	}
	otherSalt, err := ClusterIDOf(secretOf(1), secretOf(3))
	if err != nil || otherSalt == id {
		t.Errorf("another salt gives %q (%v), the same as %q", otherSalt, err, id)
	}
	otherMaster, err := ClusterIDOf(secretOf(4), secretOf(2))
	if err != nil || otherMaster == id {
		t.Errorf("another master secret gives %q (%v), the same as %q", otherMaster, err, id)
	}
	if strings.Contains(id, hex.EncodeToString(secretOf(1))[:16]) {
		t.Errorf("cluster ID %q shows the master secret", id)
	}
	if _, err := ClusterIDOf(nil, secretOf(2)); err == nil {
		t.Error("ClusterID without a master secret succeeded")
	}
}

func secretOf(b byte) []byte { return bytes.Repeat([]byte{b}, 32) }
