// Package tpmseal seals a small secret in a TPM so that it unseals only while the TPM's PCRs hold one of
// several allowed sets of values.
//
// Each allowed set (a Branch: one image's measurements) is a TPM2_PolicyPCR; the branches are joined by
// TPM2_PolicyOR. The policy is computed without a TPM from the values alone, so a node can seal to images
// it has never booted. The sealed object lives under the owner hierarchy's standard ECC storage root key,
// which the TPM derives again from its storage seed on every use: clearing the TPM changes the seed, and
// no blob sealed before can ever be loaded again.
package tpmseal

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"
)

// Limits of what Seal takes.
const (
	MaxBranches   = 256
	MaxSecretSize = 128 // TPM2B_SENSITIVE_DATA of a sealed object (MAX_SYM_DATA)
	maxPCR        = 23
	orWidth       = 8 // TPM2_PolicyOR takes 2 to 8 digests
)

// Branch is one allowed image: the SHA-256 PCR values under which the secret unseals.
type Branch struct {
	// Name names the image in errors.
	Name string
	// PCRs maps a PCR index (0 to 23) to its SHA-256 value.
	PCRs map[int][]byte
}

// Sealed is a sealed object: its TPM2B_PUBLIC and TPM2B_PRIVATE contents, loadable under the SRK of the TPM
// that sealed it. The branches it was sealed with are kept beside it by the caller, in the same order:
// Unseal needs them to satisfy the policy.
type Sealed struct {
	Public, Private []byte
}

// ErrOtherTPM reports a sealed object that this TPM cannot load: it was sealed in another TPM, or in this
// one before it was cleared.
var ErrOtherTPM = errors.New("the key was sealed in another TPM, or in this one before it was cleared")

// MismatchError reports that this boot's PCRs match no branch. It names the closest branch and its first
// differing PCR; PCR values are not secret.
type MismatchError struct {
	Image          string
	PCR            int
	Expected, Got  []byte
	branchesTested int
}

func (e *MismatchError) Error() string {
	return fmt.Sprintf("none of the %d sealed images matches this boot: the closest, %q, differs at PCR %d: expected %s, got %s",
		e.branchesTested, e.Image, e.PCR, hex.EncodeToString(e.Expected), hex.EncodeToString(e.Got))
}

// PolicyDigest is the TPM policy digest (SHA-256) that the branches allow, computed without a TPM.
func PolicyDigest(branches []Branch) ([]byte, error) {
	levels, err := tree(branches)
	if err != nil {
		return nil, err
	}
	return levels[len(levels)-1][0], nil
}

// Seal seals secret so that it unseals only under the policy of branches.
func Seal(tpm transport.TPM, secret []byte, branches []Branch) (*Sealed, error) {
	if len(secret) == 0 || len(secret) > MaxSecretSize {
		return nil, fmt.Errorf("sealing: the secret is %d bytes, want 1 to %d", len(secret), MaxSecretSize)
	}
	digest, err := PolicyDigest(branches)
	if err != nil {
		return nil, fmt.Errorf("sealing: %w", err)
	}
	srk, err := createSRK(tpm)
	if err != nil {
		return nil, fmt.Errorf("sealing: %w", err)
	}
	defer flush(tpm, srk.ObjectHandle)
	rsp, err := tpm2.Create{
		ParentHandle: tpm2.AuthHandle{Handle: srk.ObjectHandle, Name: srk.Name, Auth: tpm2.PasswordAuth(nil)},
		InSensitive: tpm2.TPM2BSensitiveCreate{Sensitive: &tpm2.TPMSSensitiveCreate{
			Data: tpm2.NewTPMUSensitiveCreate(&tpm2.TPM2BSensitiveData{Buffer: secret}),
		}},
		InPublic: tpm2.New2B(tpm2.TPMTPublic{
			Type:    tpm2.TPMAlgKeyedHash,
			NameAlg: tpm2.TPMAlgSHA256,
			// No UserWithAuth: only the policy unseals. FixedTPM and FixedParent: it never leaves this TPM.
			ObjectAttributes: tpm2.TPMAObject{FixedTPM: true, FixedParent: true, NoDA: true},
			AuthPolicy:       tpm2.TPM2BDigest{Buffer: digest},
		}),
	}.Execute(tpm)
	if err != nil {
		return nil, fmt.Errorf("sealing: creating the sealed object: %w", err)
	}
	return &Sealed{Public: rsp.OutPublic.Bytes(), Private: rsp.OutPrivate.Buffer}, nil
}

// Unseal reads the TPM's PCRs, finds the branch they match, satisfies the policy and returns the secret
// and the index of the branch that matched. branches must be those Seal was given, in the same order.
func Unseal(tpm transport.TPM, s *Sealed, branches []Branch) ([]byte, int, error) {
	levels, err := tree(branches)
	if err != nil {
		return nil, 0, fmt.Errorf("unsealing: %w", err)
	}
	public := tpm2.BytesAs2B[tpm2.TPMTPublic](s.Public)
	pub, err := public.Contents()
	if err != nil {
		return nil, 0, fmt.Errorf("unsealing: the sealed object's public area: %w", err)
	}
	if !bytes.Equal(pub.AuthPolicy.Buffer, levels[len(levels)-1][0]) {
		return nil, 0, errors.New("unsealing: the branches stored beside the sealed key are not the ones it was sealed with")
	}
	branch, err := matching(tpm, branches)
	if err != nil {
		return nil, 0, fmt.Errorf("unsealing: %w", err)
	}
	srk, err := createSRK(tpm)
	if err != nil {
		return nil, 0, fmt.Errorf("unsealing: %w", err)
	}
	defer flush(tpm, srk.ObjectHandle)
	loaded, err := tpm2.Load{
		ParentHandle: tpm2.AuthHandle{Handle: srk.ObjectHandle, Name: srk.Name, Auth: tpm2.PasswordAuth(nil)},
		InPrivate:    tpm2.TPM2BPrivate{Buffer: s.Private},
		InPublic:     public,
	}.Execute(tpm)
	if err != nil {
		return nil, 0, fmt.Errorf("unsealing: %w: %w", ErrOtherTPM, err)
	}
	defer flush(tpm, loaded.ObjectHandle)
	sess, closeSession, err := tpm2.PolicySession(tpm, tpm2.TPMAlgSHA256, 16)
	if err != nil {
		return nil, 0, fmt.Errorf("unsealing: starting a policy session: %w", err)
	}
	defer closeSession()
	if _, err := policyPCR(branches[branch]).execute(tpm, sess.Handle()); err != nil {
		return nil, 0, fmt.Errorf("unsealing: PolicyPCR of image %q: %w", branches[branch].Name, err)
	}
	at := branch
	for _, level := range levels[:len(levels)-1] {
		group := at / orWidth
		if _, err := (tpm2.PolicyOr{PolicySession: sess.Handle(), PHashList: orList(level, group)}).Execute(tpm); err != nil {
			return nil, 0, fmt.Errorf("unsealing: PolicyOR: %w", err)
		}
		at = group
	}
	out, err := tpm2.Unseal{ItemHandle: tpm2.AuthHandle{Handle: loaded.ObjectHandle, Name: loaded.Name, Auth: sess}}.Execute(tpm)
	if err != nil {
		return nil, 0, fmt.Errorf("unsealing: %w", err)
	}
	return out.OutData.Buffer, branch, nil
}

// tree computes the policy: level 0 holds each branch's PolicyPCR digest; each next level holds the
// PolicyOR digest of each group of up to orWidth digests of the level below (a group of one is its digest
// twice, since PolicyOR needs two); the last level holds the one policy digest. Even a single branch is
// ORed, so every policy has the same shape.
func tree(branches []Branch) ([][][]byte, error) {
	if len(branches) == 0 {
		return nil, errors.New("no images to seal to")
	}
	if len(branches) > MaxBranches {
		return nil, fmt.Errorf("%d images to seal to, more than the limit of %d", len(branches), MaxBranches)
	}
	leaves := make([][]byte, len(branches))
	for i, b := range branches {
		if err := b.validate(); err != nil {
			return nil, fmt.Errorf("image %d (%q): %w", i, b.Name, err)
		}
		calc, err := tpm2.NewPolicyCalculator(tpm2.TPMAlgSHA256)
		if err != nil {
			return nil, err
		}
		if err := policyPCR(b).Update(calc); err != nil {
			return nil, err
		}
		leaves[i] = calc.Hash().Digest
	}
	levels := [][][]byte{leaves}
	for {
		level := levels[len(levels)-1]
		if len(level) == 1 && len(levels) > 1 {
			return levels, nil
		}
		var next [][]byte
		for group := 0; group*orWidth < len(level); group++ {
			calc, err := tpm2.NewPolicyCalculator(tpm2.TPMAlgSHA256)
			if err != nil {
				return nil, err
			}
			if err := (tpm2.PolicyOr{PHashList: orList(level, group)}).Update(calc); err != nil {
				return nil, err
			}
			next = append(next, calc.Hash().Digest)
		}
		levels = append(levels, next)
	}
}

// orList is the PolicyOR digest list of one group of a level.
func orList(level [][]byte, group int) tpm2.TPMLDigest {
	members := level[group*orWidth : min(len(level), (group+1)*orWidth)]
	if len(members) == 1 {
		members = [][]byte{members[0], members[0]}
	}
	list := tpm2.TPMLDigest{Digests: make([]tpm2.TPM2BDigest, len(members))}
	for i, d := range members {
		list.Digests[i] = tpm2.TPM2BDigest{Buffer: d}
	}
	return list
}

func (b Branch) validate() error {
	if len(b.PCRs) == 0 {
		return errors.New("no PCRs")
	}
	for idx, v := range b.PCRs {
		if idx < 0 || idx > maxPCR {
			return fmt.Errorf("PCR index %d is outside 0 to %d", idx, maxPCR)
		}
		if len(v) != sha256.Size {
			return fmt.Errorf("PCR %d: value is %d bytes, want %d (SHA-256)", idx, len(v), sha256.Size)
		}
	}
	return nil
}

func (b Branch) indices() []int {
	idx := make([]int, 0, len(b.PCRs))
	for i := range b.PCRs {
		idx = append(idx, i)
	}
	slices.Sort(idx)
	return idx
}

type pcrPolicy struct{ tpm2.PolicyPCR }

// policyPCR is the branch's TPM2_PolicyPCR: its PCRs of the SHA-256 bank, and the SHA-256 of their values
// concatenated in ascending index order, as the TPM computes it.
func policyPCR(b Branch) pcrPolicy {
	h := sha256.New()
	var sel []uint
	for _, i := range b.indices() {
		h.Write(b.PCRs[i])
		sel = append(sel, uint(i))
	}
	return pcrPolicy{tpm2.PolicyPCR{
		PcrDigest: tpm2.TPM2BDigest{Buffer: h.Sum(nil)},
		Pcrs:      selection(sel...),
	}}
}

func (p pcrPolicy) execute(tpm transport.TPM, session tpm2.TPMHandle) (*tpm2.PolicyPCRResponse, error) {
	cmd := p.PolicyPCR
	cmd.PolicySession = session
	return cmd.Execute(tpm)
}

func selection(pcrs ...uint) tpm2.TPMLPCRSelection {
	return tpm2.TPMLPCRSelection{PCRSelections: []tpm2.TPMSPCRSelection{{
		Hash: tpm2.TPMAlgSHA256, PCRSelect: tpm2.PCClientCompatible.PCRs(pcrs...),
	}}}
}

// matching reads the PCRs the branches name and returns the first branch they all match, or a
// *MismatchError about the closest one.
func matching(tpm transport.TPM, branches []Branch) (int, error) {
	var all []int
	for _, b := range branches {
		for _, i := range b.indices() {
			if !slices.Contains(all, i) {
				all = append(all, i)
			}
		}
	}
	slices.Sort(all)
	current, err := readPCRs(tpm, all)
	if err != nil {
		return 0, err
	}
	var closest *MismatchError
	bestMatches := -1
	for bi, b := range branches {
		matches, first := 0, -1
		for _, i := range b.indices() {
			if bytes.Equal(current[i], b.PCRs[i]) {
				matches++
			} else if first < 0 {
				first = i
			}
		}
		if first < 0 {
			return bi, nil
		}
		if matches > bestMatches {
			bestMatches = matches
			closest = &MismatchError{Image: b.Name, PCR: first, Expected: b.PCRs[first], Got: current[first]}
		}
	}
	closest.branchesTested = len(branches)
	return 0, closest
}

// readPCRs reads PCRs of the SHA-256 bank; a TPM returns at most 8 per read, and says which.
func readPCRs(tpm transport.TPM, pcrs []int) (map[int][]byte, error) {
	out := make(map[int][]byte, len(pcrs))
	for len(out) < len(pcrs) {
		var want []uint
		for _, i := range pcrs {
			if _, ok := out[i]; !ok {
				want = append(want, uint(i))
			}
		}
		rsp, err := tpm2.PCRRead{PCRSelectionIn: selection(want...)}.Execute(tpm)
		if err != nil {
			return nil, fmt.Errorf("reading PCRs: %w", err)
		}
		var got []int
		for _, s := range rsp.PCRSelectionOut.PCRSelections {
			for byteIdx, bits := range s.PCRSelect {
				for bit := range 8 {
					if bits&(1<<bit) != 0 {
						got = append(got, byteIdx*8+bit)
					}
				}
			}
		}
		if len(got) == 0 || len(got) != len(rsp.PCRValues.Digests) {
			return nil, fmt.Errorf("reading PCRs %v: the TPM returned %d values for %d PCRs", want, len(rsp.PCRValues.Digests), len(got))
		}
		for i, idx := range got {
			out[idx] = rsp.PCRValues.Digests[i].Buffer
		}
	}
	return out, nil
}

// createSRK makes the owner hierarchy's standard ECC storage root key, the same on every call until the
// TPM is cleared.
func createSRK(tpm transport.TPM) (*tpm2.CreatePrimaryResponse, error) {
	rsp, err := tpm2.CreatePrimary{PrimaryHandle: tpm2.TPMRHOwner, InPublic: tpm2.New2B(tpm2.ECCSRKTemplate)}.Execute(tpm)
	if err != nil {
		return nil, fmt.Errorf("creating the storage root key: %w", err)
	}
	return rsp, nil
}

func flush(tpm transport.TPM, h tpm2.TPMHandle) {
	_, _ = tpm2.FlushContext{FlushHandle: h}.Execute(tpm)
}
