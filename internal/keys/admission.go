package keys

import (
	"crypto/hkdf"
	"crypto/hmac"
	"crypto/sha256"
	"fmt"
)

// recoveryAdmissionInfo is the HKDF info of RecoveryAdmissionKey; like the labels, it is fixed.
const recoveryAdmissionInfo = infoPrefix + "recovery-admission"

// RecoveryAdmissionKey is what a node keeps of its disk key outside the disk (in the volume's LUKS2 header),
// so that its recovery server can check that a client holds the disk key before the node quotes for it:
// HKDF-SHA256 of the disk key. It opens nothing, and the disk key cannot be computed from it.
func RecoveryAdmissionKey(diskKey []byte) ([]byte, error) {
	if len(diskKey) < minKeyLen {
		return nil, fmt.Errorf("deriving the recovery admission key: the disk key is %d bytes, want at least %d", len(diskKey), minKeyLen)
	}
	return hkdf.Key(sha256.New, diskKey, nil, recoveryAdmissionInfo, 32)
}

// AdmissionProof is HMAC-SHA256 of nonce keyed with key: proof, bound to the connection whose attestation
// nonce it is, that the sender holds key. It is useless on any other connection.
func AdmissionProof(key, nonce []byte) []byte {
	m := hmac.New(sha256.New, key)
	m.Write(nonce)
	return m.Sum(nil)
}
