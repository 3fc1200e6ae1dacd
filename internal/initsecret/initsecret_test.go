package initsecret

import (
	"encoding/base64"
	"strings"
	"testing"
)

// Vectors computed with the reference implementation (Debian's argon2 CLI, version 20171227),
// e.g. `echo -n 'correct horse battery staple' | argon2 'berth-init-salt!' -id -t 2 -m 16 -p 1 -l 32 -e`.
var referenceVectors = []struct {
	name    string
	secret  string
	encoded string
}{
	{"production parameters", "correct horse battery staple",
		"$argon2id$v=19$m=65536,t=2,p=1$YmVydGgtaW5pdC1zYWx0IQ$TVBjZGFF0HRS/36a7y57nVtgIavpY6AblxWAZjS1sUY"},
	{"four lanes", "correct horse battery staple",
		"$argon2id$v=19$m=256,t=3,p=4$YmVydGgtaW5pdC1zYWx0IQ$MXRN/Ho93FoUAMYIcVdUv8Yr8pXFC1w19sff9ly7a+M"},
	{"longest salt and hash", "x",
		"$argon2id$v=19$m=64,t=1,p=2$c3Nzc3Nzc3Nzc3Nzc3Nzc3Nzc3Nzc3Nzc3Nzc3Nzc3Nzc3Nzc3Nzc3Nzc3Nzc3Nzc3Nzc3Nzc3Nzc3Nzc3Nzcw$kbyWOHD7sr0UbUF33JS+J3cH7Z7t2NOkJGRs4ySLhI34FK8NSeyesiwW8Ss00Z/bnPzXYUp47Txk0t1x4K998w"},
	{"shortest hash, minimum memory", "x",
		"$argon2id$v=19$m=32,t=1,p=4$MDEyMzQ1Njc4OWFiY2RlZg$YXaaOVCGbpqjoybqHrmmgw"},
}

func TestVerifyReferenceVectors(t *testing.T) {
	for _, v := range referenceVectors {
		t.Run(v.name, func(t *testing.T) {
			ok, err := Verify(v.encoded, []byte(v.secret))
			if err != nil || !ok {
				t.Fatalf("Verify(right secret) = %v, %v; want true", ok, err)
			}
			ok, err = Verify(v.encoded, []byte(v.secret+"!"))
			if err != nil || ok {
				t.Fatalf("Verify(wrong secret) = %v, %v; want false", ok, err)
			}
			h, err := parse(v.encoded)
			if err != nil {
				t.Fatal(err)
			}
			if h.String() != v.encoded {
				t.Fatalf("re-encoded as %q", h.String())
			}
		})
	}
}

func TestHash(t *testing.T) {
	secret := []byte("an operator's init secret")
	a, err := Hash(secret)
	if err != nil {
		t.Fatalf("Hash: %v", err)
	}
	if !strings.HasPrefix(a, "$argon2id$v=19$m=65536,t=2,p=1$") {
		t.Fatalf("Hash = %q, want argon2id with m=65536,t=2,p=1", a)
	}
	h, err := parse(a)
	if err != nil {
		t.Fatalf("own hash does not parse: %v", err)
	}
	if len(h.salt) != 16 || len(h.hash) != 32 {
		t.Fatalf("salt %d bytes, hash %d bytes; want 16, 32", len(h.salt), len(h.hash))
	}
	if ok, err := Verify(a, secret); err != nil || !ok {
		t.Fatalf("Verify(own hash) = %v, %v", ok, err)
	}
	if ok, err := Verify(a, []byte("an operator's init secreT")); err != nil || ok {
		t.Fatalf("Verify(wrong secret) = %v, %v", ok, err)
	}
	if ok, err := Verify(a, nil); err != nil || ok {
		t.Fatalf("Verify(empty secret) = %v, %v", ok, err)
	}
	b, err := Hash(secret)
	if err != nil {
		t.Fatal(err)
	}
	if a == b {
		t.Fatal("two hashes of one secret are equal: salt is not random")
	}
	if strings.Contains(a, string(secret)) || strings.Contains(a, base64.RawStdEncoding.EncodeToString(secret)) {
		t.Fatal("hash contains the secret")
	}
}

func TestHashRefusesEmpty(t *testing.T) {
	if _, err := Hash(nil); err == nil || !strings.Contains(err.Error(), "empty") {
		t.Fatalf("Hash(nil) error = %v", err)
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
	if a == b {
		t.Fatal("two secrets are equal")
	}
	raw, err := base64.RawURLEncoding.DecodeString(a)
	if err != nil || len(raw) != 32 || len(a) != 43 {
		t.Fatalf("secret %d chars, %d bytes, err %v; want 43 chars of unpadded base64url for 32 bytes", len(a), len(raw), err)
	}
	if strings.ContainsAny(a, "+/=") {
		t.Fatalf("secret %q is not base64url without padding", a)
	}
}

func TestVerifyMalformed(t *testing.T) {
	const salt16 = "YmVydGgtaW5pdC1zYWx0IQ"
	const hash32 = "TVBjZGFF0HRS/36a7y57nVtgIavpY6AblxWAZjS1sUY"
	ok := func(params string) string { return "$argon2id$v=19$" + params + "$" + salt16 + "$" + hash32 }
	b64 := base64.RawStdEncoding.EncodeToString
	tests := []struct {
		name    string
		encoded string
		wantErr string
	}{
		{"empty", "", "want the form"},
		{"too long", strings.Repeat("$", 300), "300 bytes long"},
		{"bcrypt", "$2b$12$abcdefghijklmnopqrstuuABCDEFGHIJKLMNOPQRSTUVWXYZ01234", "want the form"},
		{"argon2i", "$argon2i$v=19$m=65536,t=2,p=1$" + salt16 + "$" + hash32, "algorithm is not argon2id"},
		{"argon2d", "$argon2d$v=19$m=65536,t=2,p=1$" + salt16 + "$" + hash32, "algorithm is not argon2id"},
		{"old version", "$argon2id$v=16$m=65536,t=2,p=1$" + salt16 + "$" + hash32, "version is not v=19"},
		{"no version", "$argon2id$m=65536,t=2,p=1$" + salt16 + "$" + hash32, "want the form"},
		{"leading text", "x$argon2id$v=19$m=65536,t=2,p=1$" + salt16 + "$" + hash32, "want the form"},
		{"trailing field", ok("m=65536,t=2,p=1") + "$", "want the form"},
		{"params out of order", ok("t=2,m=65536,p=1"), "parameter m missing or out of order"},
		{"extra param", ok("m=65536,t=2,p=1,keyid=abc"), "not exactly m=<KiB>,t=<passes>,p=<lanes>"},
		{"missing param", ok("m=65536,t=2"), "not exactly"},
		{"memory above bound", ok("m=262145,t=2,p=1"), "m=262145 is above the limit of 262144"},
		{"memory overflows uint32", ok("m=4294967296,t=2,p=1"), "above the limit"},
		{"memory eleven digits", ok("m=99999999999,t=2,p=1"), "not a positive decimal"},
		{"time above bound", ok("m=65536,t=11,p=1"), "t=11 is above the limit of 10"},
		{"threads above bound", ok("m=65536,t=2,p=5"), "p=5 is above the limit of 4"},
		{"threads 256", ok("m=65536,t=2,p=256"), "p=256 is above the limit of 4"},
		{"zero time", ok("m=65536,t=0,p=1"), "t is not a positive decimal"},
		{"zero threads", ok("m=65536,t=2,p=0"), "p is not a positive decimal"},
		{"zero memory", ok("m=0,t=2,p=1"), "m is not a positive decimal"},
		{"memory below 8 KiB per lane", ok("m=31,t=1,p=4"), "below the minimum of 8 KiB per lane (32)"},
		{"leading zero", ok("m=065536,t=2,p=1"), "m is not a positive decimal"},
		{"plus sign", ok("m=+65536,t=2,p=1"), "m is not a positive decimal"},
		{"minus sign", ok("m=-1,t=2,p=1"), "m is not a positive decimal"},
		{"empty value", ok("m=,t=2,p=1"), "m is not a positive decimal"},
		{"space", ok("m=65536, t=2,p=1"), "parameter t missing"},
		{"salt with padding", "$argon2id$v=19$m=65536,t=2,p=1$" + salt16 + "==$" + hash32, "salt is not canonical"},
		{"salt with newline", "$argon2id$v=19$m=65536,t=2,p=1$" + salt16[:10] + "\n" + salt16[10:] + "$" + hash32, "salt is not canonical"},
		{"salt url alphabet", "$argon2id$v=19$m=65536,t=2,p=1$-" + salt16[1:] + "$" + hash32, "salt is not canonical"},
		{"salt stray bits", "$argon2id$v=19$m=65536,t=2,p=1$" + salt16[:21] + "J$" + hash32, "salt is not canonical"},
		{"salt too short", "$argon2id$v=19$m=65536,t=2,p=1$" + b64(make([]byte, 15)) + "$" + hash32, "salt is 15 bytes, want 16 to 64"},
		{"salt too long", "$argon2id$v=19$m=65536,t=2,p=1$" + b64(make([]byte, 65)) + "$" + hash32, "salt is 65 bytes"},
		{"empty salt", "$argon2id$v=19$m=65536,t=2,p=1$$" + hash32, "salt is 0 bytes"},
		{"hash too short", "$argon2id$v=19$m=65536,t=2,p=1$" + salt16 + "$" + b64(make([]byte, 15)), "hash is 15 bytes, want 16 to 64"},
		{"hash too long", "$argon2id$v=19$m=65536,t=2,p=1$" + salt16 + "$" + b64(make([]byte, 65)), "hash is 65 bytes"},
		{"hash not base64", "$argon2id$v=19$m=65536,t=2,p=1$" + salt16 + "$" + hash32[:40] + "!!!", "hash is not canonical"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ok, err := Verify(tt.encoded, []byte("correct horse battery staple"))
			if err == nil {
				t.Fatalf("Verify accepted %q (match %v)", tt.encoded, ok)
			}
			if ok {
				t.Fatal("Verify returned true with an error")
			}
			if !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("error %q does not contain %q", err, tt.wantErr)
			}
			if !strings.HasPrefix(err.Error(), "malformed init secret hash: ") {
				t.Fatalf("error %q does not say what it is about", err)
			}
		})
	}
}

// The bounds themselves are accepted: a hash at the limits verifies (only parsed here; computing
// 256 MiB x 10 passes would make the test slow).
func TestParseAcceptsLimits(t *testing.T) {
	salt := base64.RawStdEncoding.EncodeToString(make([]byte, 64))
	hash := base64.RawStdEncoding.EncodeToString(make([]byte, 64))
	h, err := parse("$argon2id$v=19$m=262144,t=10,p=4$" + salt + "$" + hash)
	if err != nil {
		t.Fatalf("parse at the limits: %v", err)
	}
	if h.memory != 262144 || h.time != 10 || h.threads != 4 {
		t.Fatalf("parsed %+v", h)
	}
}

func TestErrorsDoNotContainSecret(t *testing.T) {
	secret := []byte("s3cr3t-that-must-not-leak")
	inputs := []string{
		"",
		"$argon2id$v=19$m=65536,t=2,p=1$" + string(secret) + "$" + string(secret),
		"$argon2id$v=19$m=65536,t=2,p=1$YmVydGgtaW5pdC1zYWx0IQ$" + base64.RawStdEncoding.EncodeToString(secret[:8]),
		"$" + string(secret) + "$v=19$m=1,t=1,p=1$a$b",
	}
	for _, in := range inputs {
		_, err := Verify(in, secret)
		if err == nil {
			t.Fatalf("Verify(%q) accepted", in)
		}
		if strings.Contains(err.Error(), string(secret)) || strings.Contains(err.Error(), "s3cr3t") {
			t.Fatalf("error %q contains the secret", err)
		}
	}
}
