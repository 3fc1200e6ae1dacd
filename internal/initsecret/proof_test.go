package initsecret

import (
	"bytes"
	"strings"
	"testing"
)

func TestProof(t *testing.T) {
	secret := []byte("correct horse battery staple")
	encoded, err := Hash(secret)
	if err != nil {
		t.Fatal(err)
	}
	params, keyLen, err := Challenge(encoded)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(params, encoded[strings.LastIndexByte(encoded, '$')+1:]) || !strings.HasPrefix(encoded, params+"$") {
		t.Fatalf("challenge %q of %q: want the hash's parameters and salt, without the hash", params, encoded)
	}
	nonce := bytes.Repeat([]byte{7}, 32)
	proof, err := Proof(params, keyLen, secret, nonce)
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := CheckProof(encoded, nonce, proof); err != nil || !ok {
		t.Fatalf("the proof of the right secret: %v, %v", ok, err)
	}
	for name, tc := range map[string]struct {
		secret, nonce []byte
	}{
		"another secret":           {[]byte("Correct horse battery staple"), nonce},
		"another connection nonce": {secret, bytes.Repeat([]byte{8}, 32)},
	} {
		p, err := Proof(params, keyLen, tc.secret, tc.nonce)
		if err != nil {
			t.Fatal(err)
		}
		if ok, _ := CheckProof(encoded, nonce, p); ok {
			t.Errorf("%s: the proof passed", name)
		}
	}
	if ok, _ := CheckProof(encoded, nonce, nil); ok {
		t.Error("an empty proof passed")
	}
}

// A node's parameters bound what the client computes as they bound Verify: a forged challenge is refused,
// not computed.
func TestProofRefusesParametersOutOfBounds(t *testing.T) {
	nonce := make([]byte, 32)
	for name, tc := range map[string]struct {
		params string
		keyLen int
	}{
		"memory above the limit":   {"$argon2id$v=19$m=4194304,t=2,p=1$AAAAAAAAAAAAAAAAAAAAAA", 32},
		"passes above the limit":   {"$argon2id$v=19$m=65536,t=1000,p=1$AAAAAAAAAAAAAAAAAAAAAA", 32},
		"a hash appended":          {"$argon2id$v=19$m=65536,t=2,p=1$AAAAAAAAAAAAAAAAAAAAAA$AAAAAAAAAAAAAAAAAAAAAA", 32},
		"another algorithm":        {"$argon2i$v=19$m=65536,t=2,p=1$AAAAAAAAAAAAAAAAAAAAAA", 32},
		"a key length of 1 MiB":    {"$argon2id$v=19$m=65536,t=2,p=1$AAAAAAAAAAAAAAAAAAAAAA", 1 << 20},
		"a salt shorter than 16 B": {"$argon2id$v=19$m=65536,t=2,p=1$AAAA", 32},
	} {
		if _, err := Proof(tc.params, tc.keyLen, []byte("secret"), nonce); err == nil {
			t.Errorf("%s: Proof computed", name)
		}
	}
}
