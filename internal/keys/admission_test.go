package keys

import (
	"bytes"
	"encoding/hex"
	"testing"
)

// The admission key is pinned like the labels: changing its derivation would lock the recovery servers of
// every keyed disk out of their operators. The value is RFC 5869's HKDF-SHA256 (no salt, the info string),
// computed apart with Python's hmac module.
func TestRecoveryAdmissionKeyIsPinned(t *testing.T) {
	key, err := RecoveryAdmissionKey(bytes.Repeat([]byte{0x42}, 32))
	if err != nil {
		t.Fatal(err)
	}
	const want = "308cc497d642655128ae8d3926e7f578017326c54fc4426aefb776963e26ba0a"
	if got := hex.EncodeToString(key); got != want {
		t.Fatalf("admission key %s, want %s", got, want)
	}
	other, err := RecoveryAdmissionKey(bytes.Repeat([]byte{0x43}, 32))
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Equal(key, other) {
		t.Fatal("two disk keys give one admission key")
	}
	if _, err := RecoveryAdmissionKey(make([]byte, 8)); err == nil {
		t.Fatal("an 8-byte disk key gave an admission key")
	}
}

func TestAdmissionProofIsBoundToItsNonce(t *testing.T) {
	key := bytes.Repeat([]byte{1}, 32)
	a, b := AdmissionProof(key, []byte("nonce a")), AdmissionProof(key, []byte("nonce b"))
	if bytes.Equal(a, b) || !bytes.Equal(a, AdmissionProof(key, []byte("nonce a"))) {
		t.Fatal("proofs of one key for two nonces are equal, or one nonce's differ")
	}
	if bytes.Equal(a, AdmissionProof(bytes.Repeat([]byte{2}, 32), []byte("nonce a"))) {
		t.Fatal("two keys give one proof")
	}
}
