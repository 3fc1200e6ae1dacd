package statedisk

import (
	"bytes"
	"context"
	"crypto/hkdf"
	"crypto/rand"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/berthlabs/berth/internal/keys"
	"github.com/berthlabs/berth/internal/luks"
)

// imageSize leaves room for cryptsetup's default LUKS2 header (16 MiB) plus data.
const imageSize = 32 << 20

var errDied = errors.New("simulated crash")

func needTools(t *testing.T) {
	t.Helper()
	for _, tool := range []string{"cryptsetup", "blkid", "mkfs.ext4"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s not found: run make deps (%v)", tool, err)
		}
	}
}

func newImage(t *testing.T) string {
	t.Helper()
	needTools(t)
	path := filepath.Join(t.TempDir(), "state.img")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(imageSize); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	return path
}

func randomKey(t *testing.T) []byte {
	t.Helper()
	k := make([]byte, 32)
	if _, err := rand.Read(k); err != nil {
		t.Fatal(err)
	}
	return k
}

// keyRecorder is a random source that remembers every initial key it hands out, so that tests know every key
// that may open the volume even while Prepare is still running.
type keyRecorder struct {
	mu   sync.Mutex
	keys [][]byte
}

func (r *keyRecorder) Read(p []byte) (int, error) {
	n, err := rand.Read(p)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.keys = append(r.keys, bytes.Clone(p[:n]))
	return n, err
}

func (r *keyRecorder) all() [][]byte {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.keys)
}

// node plays berth-agent on one state disk: its disk key is derived from the volume's UUID, as the join
// service derives it, so a reformatted volume gets a new key.
type node struct {
	t      *testing.T
	vol    *luks.Volume
	master []byte
	rand   *keyRecorder
}

func newNode(t *testing.T) *node {
	return &node{t: t, vol: luks.New(newImage(t), nil), master: randomKey(t), rand: &keyRecorder{}}
}

func (n *node) derive(uuid string) []byte {
	n.t.Helper()
	k, err := hkdf.Key(sha256.New, n.master, nil, "disk/"+uuid, 32)
	if err != nil {
		n.t.Fatal(err)
	}
	return k
}

func (n *node) disk(hook func(string) error) *Disk {
	return New(n.vol, nil, WithRand(n.rand), WithStepHook(hook))
}

// boot runs the state disk part of a boot: Prepare, then SetKey as a fresh or a returning node would.
func (n *node) boot(hook func(string) error) error {
	d := n.disk(hook)
	ctx := n.t.Context()
	p, err := d.Prepare(ctx)
	if err != nil {
		return err
	}
	key := n.derive(p.UUID)
	if p.Fresh {
		return d.SetKey(ctx, p.InitialKey, key)
	}
	return d.SetKey(ctx, nil, key)
}

// checkOpens fails unless the volume opens with an initial key handed out so far or the key derived from
// its current UUID.
func (n *node) checkOpens(when string) {
	n.t.Helper()
	ctx := n.t.Context()
	id, err := n.vol.UUID(ctx)
	if err != nil {
		n.t.Fatalf("%s: UUID: %v", when, err)
	}
	for _, k := range append(n.rand.all(), n.derive(id)) {
		if _, err := n.vol.KeySlot(ctx, k); err == nil {
			return
		}
	}
	n.t.Fatalf("%s: no known key opens the volume", when)
}

// checkConverged fails unless the volume is keyed with exactly one keyslot, which the derived key opens, and
// no initial key opens it.
func (n *node) checkConverged() {
	n.t.Helper()
	ctx := n.t.Context()
	id, err := n.vol.UUID(ctx)
	if err != nil {
		n.t.Fatalf("UUID: %v", err)
	}
	if label, err := n.vol.Label(ctx); err != nil || label != LabelKeyed {
		n.t.Errorf("Label = %q, %v; want %q", label, err, LabelKeyed)
	}
	slots, err := n.vol.Slots(ctx)
	if err != nil {
		n.t.Fatalf("Slots: %v", err)
	}
	slot, err := n.vol.KeySlot(ctx, n.derive(id))
	if err != nil {
		n.t.Fatalf("the derived key does not open the volume: %v", err)
	}
	if !slices.Equal(slots, []int{slot}) {
		n.t.Errorf("keyslots %v, want only the derived key's slot %d", slots, slot)
	}
	initial := n.rand.all()
	if len(initial) == 0 {
		n.t.Fatal("no initial key was ever drawn")
	}
	for i, k := range initial {
		if s, err := n.vol.KeySlot(ctx, k); !errors.Is(err, luks.ErrWrongKey) {
			n.t.Errorf("initial key %d: KeySlot = %d, %v; want ErrWrongKey", i, s, err)
		}
	}
	// The header holds one admission token, of the derived key.
	tokens, err := n.vol.Tokens(ctx, AdmissionTokenType)
	if err != nil {
		n.t.Fatal(err)
	}
	want, err := keys.RecoveryAdmissionKey(n.derive(id))
	if err != nil {
		n.t.Fatal(err)
	}
	got, err := New(n.vol, nil).RecoveryAdmissionKey(ctx)
	if len(tokens) != 1 || err != nil || !bytes.Equal(got, want) {
		n.t.Errorf("%d admission tokens, admission key %x (%v); want one, %x", len(tokens), got, err, want)
	}
}

func TestFirstBootThenReboot(t *testing.T) {
	t.Parallel()
	n := newNode(t)
	ctx := t.Context()
	var steps []string
	d := n.disk(func(step string) error {
		steps = append(steps, step)
		n.checkOpens("after " + step)
		return nil
	})

	p, err := d.Prepare(ctx)
	if err != nil {
		t.Fatalf("Prepare: %v", err)
	}
	if !p.Fresh || len(p.InitialKey) != 32 {
		t.Fatalf("Prepare on a blank device = Fresh %v with a %d-byte initial key, want fresh with 32", p.Fresh, len(p.InitialKey))
	}
	if id, err := n.vol.UUID(ctx); err != nil || id != p.UUID {
		t.Fatalf("Prepared.UUID %q, volume UUID %q (%v)", p.UUID, id, err)
	}
	if label, err := n.vol.Label(ctx); err != nil || label != LabelFresh {
		t.Fatalf("Label after Prepare = %q, %v; want %q", label, err, LabelFresh)
	}
	key := n.derive(p.UUID)
	if err := d.SetKey(ctx, p.InitialKey, key); err != nil {
		t.Fatalf("SetKey: %v", err)
	}
	n.checkConverged()
	want := []string{StepFormatted, StepKeyAdded, StepKeyVerified, StepLabelled, StepOldKeyRemoved}
	if !slices.Equal(steps, want) {
		t.Errorf("steps %v, want %v", steps, want)
	}

	// A reboot finds the keyed volume, changes nothing and needs the key from a rejoin ticket.
	steps = nil
	p2, err := d.Prepare(ctx)
	if err != nil {
		t.Fatalf("Prepare on reboot: %v", err)
	}
	if p2.Fresh || p2.InitialKey != nil || p2.UUID != p.UUID {
		t.Fatalf("Prepare on reboot = %+v, want not fresh, no initial key, UUID %s", p2, p.UUID)
	}
	if err := d.SetKey(ctx, nil, key); err != nil {
		t.Fatalf("SetKey on reboot: %v", err)
	}
	if len(steps) != 0 {
		t.Errorf("reboot changed the volume: steps %v", steps)
	}
	n.checkConverged()
}

// A boot that dies after any step leaves a volume that always opens with a known key, and the next boot
// converges to the derived key alone.
func TestBootInterruptedAfterEachStep(t *testing.T) {
	t.Parallel()
	for _, failAt := range []string{StepFormatted, StepKeyAdded, StepKeyVerified, StepLabelled, StepOldKeyRemoved} {
		t.Run(failAt, func(t *testing.T) {
			t.Parallel()
			n := newNode(t)
			check := func(step string) error {
				n.checkOpens("after " + step)
				return nil
			}
			failed := false
			err := n.boot(func(step string) error {
				n.checkOpens("after " + step)
				if step == failAt {
					failed = true
					return errDied
				}
				return nil
			})
			if !failed || !errors.Is(err, errDied) {
				t.Fatalf("first boot = %v (reached %s: %v), want the simulated crash", err, failAt, failed)
			}
			n.checkOpens("after the crash")
			if err := n.boot(check); err != nil {
				t.Fatalf("recovery boot: %v", err)
			}
			n.checkConverged()
			if err := n.boot(check); err != nil {
				t.Fatalf("boot after recovery: %v", err)
			}
			n.checkConverged()
		})
	}
}

// Boots that die at every step in turn, each a step further than the last, still end converged.
func TestEveryBootDies(t *testing.T) {
	t.Parallel()
	n := newNode(t)
	seen := map[string]bool{}
	var died []string
	hook := func(step string) error {
		n.checkOpens("after " + step)
		if seen[step] {
			return nil
		}
		seen[step] = true
		died = append(died, step)
		return errDied
	}
	boots := 0
	for {
		boots++
		err := n.boot(hook)
		if err == nil {
			break
		}
		if !errors.Is(err, errDied) {
			t.Fatalf("boot %d: %v", boots, err)
		}
		if boots > 10 {
			t.Fatalf("no boot succeeded after %d tries; died after %v", boots, died)
		}
		n.checkOpens("after the crash")
	}
	n.checkConverged()
	want := []string{StepFormatted, StepKeyAdded, StepKeyVerified, StepLabelled, StepOldKeyRemoved}
	if !slices.Equal(died, want) {
		t.Errorf("died after %v, want after each of %v", died, want)
	}
}

func fileHash(t *testing.T, path string) []byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return h.Sum(nil)
}

func TestPrepareRefusesForeignData(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		setup   func(t *testing.T, vol *luks.Volume)
		wantErr string
	}{
		{"LUKS volume with another label", func(t *testing.T, vol *luks.Volume) {
			if err := vol.Format(t.Context(), randomKey(t), "someone-else"); err != nil {
				t.Fatal(err)
			}
		}, `labelled "someone-else"`},
		{"LUKS volume without a label", func(t *testing.T, vol *luks.Volume) {
			if err := vol.Format(t.Context(), randomKey(t), ""); err != nil {
				t.Fatal(err)
			}
		}, `labelled ""`},
		{"ext4 filesystem", func(t *testing.T, vol *luks.Volume) {
			if err := New(vol, nil).ensureFilesystem(t.Context(), vol.Path()); err != nil {
				t.Fatal(err)
			}
		}, "ext4 signature"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			vol := luks.New(newImage(t), nil)
			tt.setup(t, vol)
			before := fileHash(t, vol.Path())
			_, err := New(vol, nil).Prepare(t.Context())
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("Prepare = %v, want an error containing %q", err, tt.wantErr)
			}
			if !bytes.Equal(fileHash(t, vol.Path()), before) {
				t.Fatal("Prepare changed a device it refused")
			}
		})
	}
}

func TestSetKeyRefuses(t *testing.T) {
	t.Parallel()

	t.Run("fresh volume, no initial key", func(t *testing.T) {
		t.Parallel()
		ctx := t.Context()
		n := newNode(t)
		p, err := n.disk(nil).Prepare(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := n.disk(nil).SetKey(ctx, nil, n.derive(p.UUID)); !errors.Is(err, luks.ErrWrongKey) {
			t.Fatalf("SetKey = %v, want ErrWrongKey", err)
		}
		wantOnlyKey(t, n.vol, p.InitialKey)
	})
	t.Run("fresh volume, wrong initial key", func(t *testing.T) {
		t.Parallel()
		ctx := t.Context()
		n := newNode(t)
		p, err := n.disk(nil).Prepare(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := n.disk(nil).SetKey(ctx, randomKey(t), n.derive(p.UUID)); !errors.Is(err, luks.ErrWrongKey) {
			t.Fatalf("SetKey = %v, want ErrWrongKey", err)
		}
		wantOnlyKey(t, n.vol, p.InitialKey)
	})
	t.Run("keyed volume, another key", func(t *testing.T) {
		t.Parallel()
		ctx := t.Context()
		n := newNode(t)
		if err := n.boot(nil); err != nil {
			t.Fatal(err)
		}
		id, err := n.vol.UUID(ctx)
		if err != nil {
			t.Fatal(err)
		}
		key := n.derive(id)
		// Even authorized by the volume's own key, a keyed volume never takes a second key.
		err = n.disk(nil).SetKey(ctx, key, randomKey(t))
		if err == nil || !strings.Contains(err.Error(), "refusing") {
			t.Fatalf("SetKey = %v, want a refusal", err)
		}
		wantOnlyKey(t, n.vol, key)
	})
	t.Run("short key", func(t *testing.T) {
		t.Parallel()
		ctx := t.Context()
		n := newNode(t)
		p, err := n.disk(nil).Prepare(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := n.disk(nil).SetKey(ctx, p.InitialKey, make([]byte, 16)); err == nil {
			t.Fatal("SetKey with a 16-byte key succeeded, want an error")
		}
		wantOnlyKey(t, n.vol, p.InitialKey)
	})
}

func wantOnlyKey(t *testing.T, vol *luks.Volume, key []byte) {
	t.Helper()
	slot, err := vol.KeySlot(t.Context(), key)
	if err != nil {
		t.Fatalf("the expected key does not open the volume: %v", err)
	}
	slots, err := vol.Slots(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(slots, []int{slot}) {
		t.Fatalf("keyslots %v, want only %d", slots, slot)
	}
}

// A keyed volume that somehow holds extra keys (a crash in the middle of removing them) ends with one.
func TestSetKeyRemovesExtraKeys(t *testing.T) {
	t.Parallel()
	n := newNode(t)
	ctx := t.Context()
	if err := n.boot(nil); err != nil {
		t.Fatal(err)
	}
	id, err := n.vol.UUID(ctx)
	if err != nil {
		t.Fatal(err)
	}
	key := n.derive(id)
	extra := [][]byte{randomKey(t), randomKey(t)}
	for _, k := range extra {
		if err := n.vol.AddKey(ctx, key, k); err != nil {
			t.Fatal(err)
		}
	}
	if err := n.disk(nil).SetKey(ctx, nil, key); err != nil {
		t.Fatalf("SetKey: %v", err)
	}
	n.checkConverged()
	for _, k := range extra {
		if _, err := n.vol.KeySlot(ctx, k); !errors.Is(err, luks.ErrWrongKey) {
			t.Errorf("an extra key still opens the volume: %v", err)
		}
	}
}

type failingReader struct{}

func (failingReader) Read([]byte) (int, error) { return 0, errors.New("no entropy") }

func TestPrepareWithoutEntropy(t *testing.T) {
	t.Parallel()
	vol := luks.New(newImage(t), nil)
	if _, err := New(vol, nil, WithRand(failingReader{})).Prepare(t.Context()); err == nil {
		t.Fatal("Prepare succeeded without entropy")
	}
	if ok, err := vol.IsLUKS(t.Context()); err != nil || ok {
		t.Fatalf("IsLUKS = %v, %v; want the device left blank", ok, err)
	}
}

func TestEnsureFilesystem(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	path := newImage(t)
	d := New(luks.New(path, nil), nil)
	if err := d.ensureFilesystem(ctx, path); err != nil {
		t.Fatalf("ensureFilesystem on a blank device: %v", err)
	}
	uuid1 := fsUUID(t, path)
	if err := d.ensureFilesystem(ctx, path); err != nil {
		t.Fatalf("ensureFilesystem on ext4: %v", err)
	}
	if uuid2 := fsUUID(t, path); uuid2 != uuid1 {
		t.Fatalf("filesystem UUID changed from %s to %s: an existing filesystem was remade", uuid1, uuid2)
	}

	other := newImage(t)
	if err := luks.New(other, nil).Format(ctx, randomKey(t), ""); err != nil {
		t.Fatal(err)
	}
	if err := d.ensureFilesystem(ctx, other); err == nil || !strings.Contains(err.Error(), "crypto_LUKS") {
		t.Fatalf("ensureFilesystem on a LUKS device = %v, want a refusal naming crypto_LUKS", err)
	}
}

func fsUUID(t *testing.T, path string) string {
	t.Helper()
	out, err := exec.Command("blkid", "--probe", "--match-tag", "UUID", "--output", "value", path).Output()
	if err != nil {
		t.Fatalf("blkid: %v", err)
	}
	id := strings.TrimSpace(string(out))
	if id == "" {
		t.Fatal("blkid found no filesystem UUID")
	}
	return id
}

func TestMountRefusesRelativeDir(t *testing.T) {
	t.Parallel()
	err := New(luks.New("/nonexistent", nil), nil).Mount(context.Background(), make([]byte, 32), "berth-state", "var/lib/berth")
	if err == nil || !strings.Contains(err.Error(), "not an absolute path") {
		t.Fatalf("Mount = %v, want a relative path error", err)
	}
}

// Nothing may be stored on a volume before it is keyed: a boot that died after the derived key was added
// and verified, but before the label, leaves a volume that the derived key opens and that the next boot
// formats again. Mount refuses it before it opens anything.
func TestMountRefusesUnkeyedVolume(t *testing.T) {
	t.Parallel()
	n := newNode(t)
	err := n.boot(func(step string) error {
		if step == StepKeyVerified {
			return errDied
		}
		return nil
	})
	if !errors.Is(err, errDied) {
		t.Fatalf("boot = %v, want the simulated crash", err)
	}
	ctx := t.Context()
	id, err := n.vol.UUID(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := n.vol.KeySlot(ctx, n.derive(id)); err != nil {
		t.Fatalf("the derived key does not open the volume after the crash: %v", err)
	}
	err = n.disk(nil).Mount(ctx, n.derive(id), "berth-state", filepath.Join(t.TempDir(), "state"))
	if err == nil || !strings.Contains(err.Error(), `labelled "berth-fresh", not "berth-keyed"`) {
		t.Fatalf("Mount of an unkeyed volume = %v, want a refusal naming the labels", err)
	}
	p, err := n.disk(nil).Prepare(ctx)
	if err != nil || !p.Fresh || p.UUID == id {
		t.Fatalf("Prepare after the crash = %+v, %v; want the volume formatted again with a new UUID", p, err)
	}
}

// Sealed keys live in tokens: setting the key, which wipes every keyslot but the derived key's, keeps them.
func TestSealedKeysSurviveSetKey(t *testing.T) {
	t.Parallel()
	n := newNode(t)
	ctx := t.Context()
	if err := n.boot(nil); err != nil {
		t.Fatal(err)
	}
	d := n.disk(nil)
	if err := d.StoreSealedKey(ctx, []byte(`{"blob":1}`)); err != nil {
		t.Fatalf("StoreSealedKey: %v", err)
	}
	id, err := n.vol.UUID(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := n.vol.AddKey(ctx, n.derive(id), randomKey(t)); err != nil {
		t.Fatal(err)
	}
	if err := n.boot(nil); err != nil {
		t.Fatalf("reboot: %v", err)
	}
	n.checkConverged()
	keys, err := d.SealedKeys(ctx)
	if err != nil || len(keys) != 1 || compact(t, keys[0].Data) != `{"blob":1}` {
		t.Fatalf("SealedKeys after SetKey = %+v, %v; want the stored one", keys, err)
	}
}

// A reseal that dies after storing the new sealed key keeps both, newest first; the next one leaves one.
func TestStoreSealedKeyInterrupted(t *testing.T) {
	t.Parallel()
	n := newNode(t)
	ctx := t.Context()
	if err := n.boot(nil); err != nil {
		t.Fatal(err)
	}
	if err := n.disk(nil).StoreSealedKey(ctx, []byte(`"first"`)); err != nil {
		t.Fatal(err)
	}
	var steps []string
	dying := n.disk(func(step string) error {
		steps = append(steps, step)
		return errDied
	})
	if err := dying.StoreSealedKey(ctx, []byte(`"second"`)); !errors.Is(err, errDied) {
		t.Fatalf("StoreSealedKey = %v, want the simulated crash", err)
	}
	d := n.disk(nil)
	keys, err := d.SealedKeys(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(keys) != 2 || string(keys[0].Data) != `"second"` || string(keys[1].Data) != `"first"` {
		t.Fatalf("SealedKeys after the crash = %+v, want second then first", keys)
	}
	if err := d.StoreSealedKey(ctx, []byte(`"third"`)); err != nil {
		t.Fatal(err)
	}
	keys, err = d.SealedKeys(ctx)
	if err != nil || len(keys) != 1 || string(keys[0].Data) != `"third"` || keys[0].Seq != 3 {
		t.Fatalf("SealedKeys after the next store = %+v, %v; want third alone, seq 3", keys, err)
	}
	if !slices.Equal(steps, []string{StepSealedStored}) {
		t.Errorf("steps %v, want the crash right after %s", steps, StepSealedStored)
	}
	if err := d.RemoveSealedKeys(ctx); err != nil {
		t.Fatal(err)
	}
	if keys, err := d.SealedKeys(ctx); err != nil || len(keys) != 0 {
		t.Fatalf("SealedKeys after RemoveSealedKeys = %+v, %v; want none", keys, err)
	}
	n.checkConverged()
}

// compact is data as one line: cryptsetup stores token JSON in its own layout.
func compact(t *testing.T, data []byte) string {
	t.Helper()
	var b bytes.Buffer
	if err := json.Compact(&b, data); err != nil {
		t.Fatal(err)
	}
	return b.String()
}

// A disk's admission key follows its key: storing another replaces it, storing the same one changes nothing.
func TestStoreAdmissionKeyReplaces(t *testing.T) {
	t.Parallel()
	n := newNode(t)
	ctx := t.Context()
	if err := n.boot(nil); err != nil {
		t.Fatal(err)
	}
	d := n.disk(nil)
	other := randomKey(t)
	if err := d.storeAdmissionKey(ctx, other); err != nil {
		t.Fatal(err)
	}
	want, err := keys.RecoveryAdmissionKey(other)
	if err != nil {
		t.Fatal(err)
	}
	tokens, err := n.vol.Tokens(ctx, AdmissionTokenType)
	if got, _ := d.RecoveryAdmissionKey(ctx); err != nil || len(tokens) != 1 || !bytes.Equal(got, want) {
		t.Fatalf("after storing another key's: %d tokens (%v), admission key %x, want one, %x", len(tokens), err, got, want)
	}
	if err := d.storeAdmissionKey(ctx, other); err != nil {
		t.Fatal(err)
	}
	if again, err := n.vol.Tokens(ctx, AdmissionTokenType); err != nil || len(again) != 1 || again[0].ID != tokens[0].ID {
		t.Fatalf("storing the same admission key again: tokens %v (%v), want token %d alone", again, err, tokens[0].ID)
	}
}
