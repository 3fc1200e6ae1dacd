package statedisk

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"

	"github.com/berthlabs/berth/internal/keys"
)

// AdmissionTokenType is the LUKS2 token type of the disk's recovery admission key (keys.RecoveryAdmissionKey),
// which the recovery server checks an operator's proof against before the node spends a TPM command.
const AdmissionTokenType = "berth-recovery-admission"

type admissionToken struct {
	Type string `json:"type"`
	// Keyslots is empty, as the sealed key's: wiping keyslots never removes the token.
	Keyslots []string `json:"keyslots"`
	Key      []byte   `json:"berth_admission_key"`
}

// RecoveryAdmissionKey returns the recovery admission key of the disk's current key, as SetKey stored it,
// or nil if the disk has none (SetKey was interrupted before it stored one, and has not run since).
func (d *Disk) RecoveryAdmissionKey(ctx context.Context) ([]byte, error) {
	tokens, err := d.vol.Tokens(ctx, AdmissionTokenType)
	if err != nil {
		return nil, fmt.Errorf("reading the recovery admission key: %w", err)
	}
	for _, t := range tokens {
		var at admissionToken
		if json.Unmarshal(t.JSON, &at) == nil && len(at.Key) == 32 {
			return at.Key, nil
		}
	}
	return nil, nil
}

// storeAdmissionKey makes the admission key of key the disk's only one: a new one is added before the
// others are removed, so that a crash leaves the new one or the old one, and an unchanged one is left alone.
func (d *Disk) storeAdmissionKey(ctx context.Context, key []byte) error {
	admission, err := keys.RecoveryAdmissionKey(key)
	if err != nil {
		return err
	}
	old, err := d.vol.Tokens(ctx, AdmissionTokenType)
	if err != nil {
		return fmt.Errorf("storing the recovery admission key: %w", err)
	}
	if len(old) == 1 {
		var at admissionToken
		if json.Unmarshal(old[0].JSON, &at) == nil && bytes.Equal(at.Key, admission) {
			return nil
		}
	}
	token, err := json.Marshal(admissionToken{Type: AdmissionTokenType, Keyslots: []string{}, Key: admission})
	if err != nil {
		return fmt.Errorf("storing the recovery admission key: %w", err)
	}
	if _, err := d.vol.AddToken(ctx, token); err != nil {
		return fmt.Errorf("storing the recovery admission key: %w", err)
	}
	for _, t := range old {
		if err := d.vol.RemoveToken(ctx, t.ID); err != nil {
			return fmt.Errorf("storing the recovery admission key: removing the older one: %w", err)
		}
	}
	return nil
}
