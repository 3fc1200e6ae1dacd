// Package statedisk takes a node's state disk through its life, at every boot of berth-agent: it creates the
// LUKS2 volume on first boot, replaces the volume's random initial key with the key the node receives from the
// join service, and opens and mounts the volume.
//
// The volume's label records how far it got, so that a boot that dies at any point leaves a volume that the
// next boot can finish: LabelFresh means it was formatted but never received its real key, so it holds
// nothing and is formatted again; LabelKeyed means the real key was verified on it, so it holds the node's
// data and only that key may open it. Keys are replaced by adding the new key, checking that it opens the
// volume, and only then removing the others: at no moment does the volume lack a working key, and each run
// converges on exactly one keyslot.
//
// Two rules keep this safe, and each is enforced here rather than left to callers:
//   - Nothing is stored on a volume before it is labelled LabelKeyed: Mount refuses any other label. A
//     LabelFresh volume is formatted again on the next boot even if the derived key already opens it, which
//     destroys nothing only because of this rule.
//   - The derived key is the only key: every SetKey wipes all other keyslots. Everything else that unlocks
//     the disk (the key sealed in the node's TPM, an operator's recovery) recovers that same derived key,
//     and lives in LUKS2 tokens (StoreSealedKey), which no keyslot change touches.
package statedisk

import (
	"bytes"
	"cmp"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"

	"github.com/berthlabs/berth/internal/luks"
)

const (
	// LabelFresh marks a volume formatted with a random initial key and never given its real key: it holds
	// nothing yet.
	LabelFresh = "berth-fresh"
	// LabelKeyed marks a volume on which the node's derived key has been verified: the node has joined before.
	LabelKeyed = "berth-keyed"
)

// Steps reported to the step hook, in the order they happen on a first boot.
const (
	StepFormatted     = "formatted"
	StepKeyAdded      = "key-added"
	StepKeyVerified   = "key-verified"
	StepLabelled      = "labelled"
	StepOldKeyRemoved = "old-key-removed"
	// StepSealedStored and StepSealedPruned are the two steps of StoreSealedKey.
	StepSealedStored = "sealed-stored"
	StepSealedPruned = "sealed-pruned"
)

// initialKeySize is the size of the random key a fresh volume is formatted with.
const initialKeySize = 32

// fsType is the filesystem made on the opened volume.
const fsType = "ext4"

// Disk is the node's state disk.
type Disk struct {
	vol    *luks.Volume
	logger *slog.Logger
	rand   io.Reader
	hook   func(step string) error
}

// Option configures a Disk.
type Option func(*Disk)

// WithRand draws initial keys from r instead of crypto/rand.
func WithRand(r io.Reader) Option {
	return func(d *Disk) { d.rand = r }
}

// WithStepHook calls hook after each step that changes the volume; an error from hook aborts the operation
// right after that step, as if the process had died there. Tests use it to prove that every interruption is
// recoverable.
func WithStepHook(hook func(step string) error) Option {
	return func(d *Disk) { d.hook = hook }
}

// New returns the state disk held by vol.
func New(vol *luks.Volume, logger *slog.Logger, opts ...Option) *Disk {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	d := &Disk{vol: vol, logger: logger, rand: rand.Reader}
	for _, o := range opts {
		o(d)
	}
	return d
}

// Prepared is the state disk as Prepare left it.
type Prepared struct {
	// UUID is the volume's canonical UUID, from which the node's disk key is derived.
	UUID string
	// Fresh is true when the volume was just formatted and holds nothing: the node must join as a new node.
	// When false, the node has joined before and gets its key back with a rejoin ticket.
	Fresh bool
	// InitialKey opens a fresh volume until SetKey replaces it; nil unless Fresh. It lives only in memory.
	InitialKey []byte
}

// Prepare makes sure the device is a Berth state volume. A device that is not LUKS and carries no other
// signature, or a volume labelled LabelFresh (an earlier boot died before keying it; nothing was stored and its
// initial key died with that boot), is formatted with a new random key and LabelFresh. A volume labelled
// LabelKeyed is left alone. Anything else is refused, so that no unknown data is ever destroyed.
func (d *Disk) Prepare(ctx context.Context) (Prepared, error) {
	dev := d.vol.Path()
	isLUKS, err := d.vol.IsLUKS(ctx)
	if err != nil {
		return Prepared{}, fmt.Errorf("preparing the state disk: %w", err)
	}
	if !isLUKS {
		sig, err := probe(ctx, dev)
		if err != nil {
			return Prepared{}, fmt.Errorf("preparing the state disk: %w", err)
		}
		if sig != "" {
			return Prepared{}, fmt.Errorf("preparing the state disk: refusing to format %s: it holds a %s signature, not a Berth volume; wipe it by hand if it really is the state disk", dev, sig)
		}
		return d.format(ctx, "blank device")
	}
	label, err := d.vol.Label(ctx)
	if err != nil {
		return Prepared{}, fmt.Errorf("preparing the state disk: %w", err)
	}
	switch label {
	case LabelFresh:
		return d.format(ctx, "never keyed")
	case LabelKeyed:
		id, err := d.vol.UUID(ctx)
		if err != nil {
			return Prepared{}, fmt.Errorf("preparing the state disk: %w", err)
		}
		d.logger.Info("state disk is keyed", "device", dev, "uuid", id)
		return Prepared{UUID: id}, nil
	default:
		return Prepared{}, fmt.Errorf("preparing the state disk: refusing to touch %s: it is a LUKS volume labelled %q, not %q or %q", dev, label, LabelFresh, LabelKeyed)
	}
}

func (d *Disk) format(ctx context.Context, reason string) (Prepared, error) {
	key := make([]byte, initialKeySize)
	if _, err := io.ReadFull(d.rand, key); err != nil {
		return Prepared{}, fmt.Errorf("formatting the state disk: drawing an initial key: %w", err)
	}
	if err := d.vol.Format(ctx, key, LabelFresh); err != nil {
		return Prepared{}, fmt.Errorf("formatting the state disk: %w", err)
	}
	id, err := d.vol.UUID(ctx)
	if err != nil {
		return Prepared{}, fmt.Errorf("formatting the state disk: %w", err)
	}
	d.logger.Info("state disk formatted", "device", d.vol.Path(), "uuid", id, "reason", reason)
	if err := d.step(StepFormatted); err != nil {
		return Prepared{}, err
	}
	return Prepared{UUID: id, Fresh: true, InitialKey: key}, nil
}

// SetKey makes key the only key of the volume. If key already opens it, every other keyslot is removed.
// Otherwise the volume must be fresh: key is added (authorized by initial), checked to open the volume, the
// volume is labelled LabelKeyed, and only then are the other keyslots, the initial key's among them, removed.
// A key that opens nothing, with no initial key to add it by, gives an error wrapping luks.ErrWrongKey.
func (d *Disk) SetKey(ctx context.Context, initial, key []byte) error {
	if len(key) < luks.MinKeySize {
		return fmt.Errorf("setting the state disk key: the key is %d bytes, want at least %d", len(key), luks.MinKeySize)
	}
	slot, err := d.vol.KeySlot(ctx, key)
	if err == nil {
		return d.converge(ctx, key, slot)
	}
	if !errors.Is(err, luks.ErrWrongKey) {
		return fmt.Errorf("setting the state disk key: %w", err)
	}
	if len(initial) == 0 {
		return fmt.Errorf("setting the state disk key: no initial key to add the key with: %w", err)
	}
	// A keyed volume holds the node's data under its own key; a key that does not open it must never be added.
	label, err := d.vol.Label(ctx)
	if err != nil {
		return fmt.Errorf("setting the state disk key: %w", err)
	}
	if label != LabelFresh {
		return fmt.Errorf("setting the state disk key: the key does not open the volume, and the volume is labelled %q, not %q: refusing to add a key to it", label, LabelFresh)
	}
	if err := d.vol.AddKey(ctx, initial, key); err != nil {
		return fmt.Errorf("setting the state disk key: %w", err)
	}
	if err := d.step(StepKeyAdded); err != nil {
		return err
	}
	if slot, err = d.vol.KeySlot(ctx, key); err != nil {
		return fmt.Errorf("setting the state disk key: checking the added key: %w", err)
	}
	if err := d.step(StepKeyVerified); err != nil {
		return err
	}
	return d.converge(ctx, key, slot)
}

// converge labels the volume keyed, wipes every keyslot but slot, which key is known to open, and stores
// key's recovery admission key.
func (d *Disk) converge(ctx context.Context, key []byte, slot int) error {
	label, err := d.vol.Label(ctx)
	if err != nil {
		return fmt.Errorf("setting the state disk key: %w", err)
	}
	if label != LabelKeyed {
		if err := d.vol.SetLabel(ctx, LabelKeyed); err != nil {
			return fmt.Errorf("setting the state disk key: %w", err)
		}
		if err := d.step(StepLabelled); err != nil {
			return err
		}
	}
	slots, err := d.vol.Slots(ctx)
	if err != nil {
		return fmt.Errorf("setting the state disk key: %w", err)
	}
	removed := 0
	for _, s := range slots {
		if s == slot {
			continue
		}
		if err := d.vol.KillSlot(ctx, s, key); err != nil {
			return fmt.Errorf("setting the state disk key: removing an old key: %w", err)
		}
		removed++
	}
	if removed > 0 {
		if err := d.step(StepOldKeyRemoved); err != nil {
			return err
		}
	}
	if err := d.storeAdmissionKey(ctx, key); err != nil {
		return fmt.Errorf("setting the state disk key: %w", err)
	}
	d.logger.Info("state disk key set", "device", d.vol.Path(), "slot", slot, "removed_slots", removed)
	return nil
}

func (d *Disk) step(name string) error {
	if d.hook == nil {
		return nil
	}
	if err := d.hook(name); err != nil {
		return fmt.Errorf("state disk: stopped after step %s: %w", name, err)
	}
	return nil
}

// Mount opens the volume with key as /dev/mapper/<name>, makes an ext4 filesystem on it if it holds none, and
// mounts it on dir, an absolute path that is created if missing. It needs dm-crypt, so it works on real nodes
// and VMs only. If anything fails after the volume is opened, the mapping is closed again.
func (d *Disk) Mount(ctx context.Context, key []byte, name, dir string) (err error) {
	if !filepath.IsAbs(dir) {
		return fmt.Errorf("mounting the state disk: mount point %q is not an absolute path", dir)
	}
	// The next boot formats a volume that is not yet keyed: nothing may be written to it before.
	label, err := d.vol.Label(ctx)
	if err != nil {
		return fmt.Errorf("mounting the state disk: %w", err)
	}
	if label != LabelKeyed {
		return fmt.Errorf("mounting the state disk: the volume is labelled %q, not %q: it is mounted only once its key is set, since an unkeyed volume is formatted again at the next boot", label, LabelKeyed)
	}
	dev, err := d.vol.Open(ctx, key, name)
	if err != nil {
		return fmt.Errorf("mounting the state disk: %w", err)
	}
	defer func() {
		if err == nil {
			return
		}
		if cerr := d.vol.Close(context.WithoutCancel(ctx), name); cerr != nil {
			d.logger.Error("closing the state disk after a failed mount", "mapping", dev, "err", cerr)
		}
	}()
	if err := d.ensureFilesystem(ctx, dev); err != nil {
		return fmt.Errorf("mounting the state disk: %w", err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("mounting the state disk: %w", err)
	}
	if _, err := command(ctx, "mount", "-t", fsType, dev, dir); err != nil {
		return fmt.Errorf("mounting the state disk: %w", err)
	}
	d.logger.Info("state disk mounted", "mapping", dev, "dir", dir)
	return nil
}

// ensureFilesystem makes an ext4 filesystem on dev if it holds no signature at all, and refuses a device that
// holds anything other than ext4.
func (d *Disk) ensureFilesystem(ctx context.Context, dev string) error {
	sig, err := probe(ctx, dev)
	if err != nil {
		return err
	}
	switch sig {
	case fsType:
		return nil
	case "":
		if _, err := command(ctx, "mkfs."+fsType, "-q", dev); err != nil {
			return fmt.Errorf("making a filesystem: %w", err)
		}
		d.logger.Info("state disk filesystem made", "device", dev, "type", fsType)
		return nil
	default:
		return fmt.Errorf("%s holds a %s signature, want %s or nothing", dev, sig, fsType)
	}
}

// SealedTokenType is the LUKS2 token type of the disk key sealed in the node's TPM.
const SealedTokenType = "berth-sealed-key"

// SealedKey is one stored sealed key, as StoreSealedKey stored it.
type SealedKey struct {
	// Token is the LUKS2 token id that holds it.
	Token int
	// Seq orders stored keys: the highest is the newest.
	Seq uint64
	// Data is what StoreSealedKey was given.
	Data json.RawMessage
}

// sealedToken is the token's JSON: the fields LUKS2 requires, and ours.
type sealedToken struct {
	Type string `json:"type"`
	// Keyslots is empty: the token is not tied to a keyslot, so wiping keyslots never removes it.
	Keyslots []string        `json:"keyslots"`
	Seq      uint64          `json:"berth_seq"`
	Sealed   json.RawMessage `json:"berth_sealed"`
}

// SealedKeys returns the stored sealed keys, newest first. A token of the type that does not parse is
// skipped with a warning: it cannot unlock anything, and the next StoreSealedKey removes it.
func (d *Disk) SealedKeys(ctx context.Context) ([]SealedKey, error) {
	tokens, err := d.vol.Tokens(ctx, SealedTokenType)
	if err != nil {
		return nil, fmt.Errorf("reading the sealed keys: %w", err)
	}
	keys := make([]SealedKey, 0, len(tokens))
	for _, t := range tokens {
		var st sealedToken
		if err := json.Unmarshal(t.JSON, &st); err != nil || len(st.Sealed) == 0 {
			d.logger.Warn("ignoring an unreadable sealed-key token", "device", d.vol.Path(), "token", t.ID, "error", err)
			continue
		}
		keys = append(keys, SealedKey{Token: t.ID, Seq: st.Seq, Data: st.Sealed})
	}
	slices.SortFunc(keys, func(a, b SealedKey) int { return cmp.Compare(b.Seq, a.Seq) })
	return keys, nil
}

// StoreSealedKey stores data as the newest sealed key and then removes all older ones. A crash between the
// two leaves both, and SealedKeys lists the new one first; at no moment is there none, so a node that dies
// while it reseals still unlocks from its TPM at the next boot.
func (d *Disk) StoreSealedKey(ctx context.Context, data json.RawMessage) error {
	old, err := d.vol.Tokens(ctx, SealedTokenType)
	if err != nil {
		return fmt.Errorf("storing the sealed key: %w", err)
	}
	var seq uint64
	for _, t := range old {
		var st sealedToken
		if json.Unmarshal(t.JSON, &st) == nil {
			seq = max(seq, st.Seq)
		}
	}
	token, err := json.Marshal(sealedToken{Type: SealedTokenType, Keyslots: []string{}, Seq: seq + 1, Sealed: data})
	if err != nil {
		return fmt.Errorf("storing the sealed key: %w", err)
	}
	id, err := d.vol.AddToken(ctx, token)
	if err != nil {
		return fmt.Errorf("storing the sealed key: %w", err)
	}
	if err := d.step(StepSealedStored); err != nil {
		return err
	}
	for _, t := range old {
		if err := d.vol.RemoveToken(ctx, t.ID); err != nil {
			return fmt.Errorf("storing the sealed key: removing the older one: %w", err)
		}
	}
	d.logger.Info("sealed key stored", "device", d.vol.Path(), "token", id, "seq", seq+1, "removed_tokens", len(old))
	if len(old) > 0 {
		return d.step(StepSealedPruned)
	}
	return nil
}

// RemoveSealedKeys removes every stored sealed key, so that only a rejoin ticket or a recovery unlocks the
// disk from now on.
func (d *Disk) RemoveSealedKeys(ctx context.Context) error {
	return d.removeSealed(ctx, func(uint64) bool { return true })
}

// PruneSealedKeys removes the sealed keys older than newest.
func (d *Disk) PruneSealedKeys(ctx context.Context, newest uint64) error {
	return d.removeSealed(ctx, func(seq uint64) bool { return seq < newest })
}

func (d *Disk) removeSealed(ctx context.Context, remove func(seq uint64) bool) error {
	keys, err := d.SealedKeys(ctx)
	if err != nil {
		return fmt.Errorf("removing sealed keys: %w", err)
	}
	removed := 0
	for _, k := range keys {
		if !remove(k.Seq) {
			continue
		}
		if err := d.vol.RemoveToken(ctx, k.Token); err != nil {
			return fmt.Errorf("removing sealed keys: %w", err)
		}
		removed++
	}
	if removed > 0 {
		d.logger.Info("sealed keys removed", "device", d.vol.Path(), "tokens", removed)
	}
	return nil
}

// blkidNothingFound is blkid's exit code when it finds no signature on the device.
const blkidNothingFound = 2

// probe returns the type of the filesystem (or else the partition table) that blkid finds on dev, read from the
// device itself rather than blkid's cache; empty if it finds none.
func probe(ctx context.Context, dev string) (string, error) {
	out, err := command(ctx, "blkid", "--probe", "--output", "export", dev)
	var ee *exec.ExitError
	if errors.As(err, &ee) && ee.ExitCode() == blkidNothingFound {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("probing %s for signatures: %w", dev, err)
	}
	values := map[string]string{}
	for line := range strings.Lines(out) {
		if k, v, ok := strings.Cut(strings.TrimSpace(line), "="); ok {
			values[k] = v
		}
	}
	for _, k := range []string{"TYPE", "PTTYPE"} {
		if v := values[k]; v != "" {
			return v, nil
		}
	}
	return "unknown", nil
}

// command runs a tool from PATH and returns its standard output; a failure carries its standard error.
func command(ctx context.Context, name string, args ...string) (string, error) {
	bin, err := exec.LookPath(name)
	if err != nil {
		return "", fmt.Errorf("%s not found on PATH: %w", name, err)
	}
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = append(os.Environ(), "LC_ALL=C")
	var stdout, stderr bytes.Buffer
	cmd.Stdout = &stdout
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		if msg := strings.TrimSpace(stderr.String()); msg != "" {
			return "", fmt.Errorf("%s: %w: %s", name, err, msg)
		}
		return "", fmt.Errorf("%s: %w", name, err)
	}
	return stdout.String(), nil
}
