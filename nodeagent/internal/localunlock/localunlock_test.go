package localunlock

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/luks"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/nodeagent/internal/statedisk"
	"github.com/berthlabs/berth/test/swtpm/swtpmtest"
)

// node is a real swtpm and a real LUKS2 state disk, keyed.
func node(t *testing.T) (*Unlocker, *statedisk.Disk, []byte) {
	u, disk, key, _ := nodeWithVolume(t)
	return u, disk, key
}

func nodeWithVolume(t *testing.T) (*Unlocker, *statedisk.Disk, []byte, *luks.Volume) {
	t.Helper()
	tpm, err := attest.OpenTPM(swtpmtest.NewCA(t).NewTPM(t).Device())
	if err != nil {
		t.Fatal(err)
	}
	prover, err := attest.NewProver(tpm)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { prover.Close() })
	img := filepath.Join(t.TempDir(), "state.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 32<<20); err != nil {
		t.Fatal(err)
	}
	vol := luks.New(img, nil)
	disk := statedisk.New(vol, nil)
	ctx := t.Context()
	p, err := disk.Prepare(ctx)
	if err != nil {
		t.Fatal(err)
	}
	key := make([]byte, keySize)
	rand.Read(key)
	if err := disk.SetKey(ctx, p.InitialKey, key); err != nil {
		t.Fatal(err)
	}
	return &Unlocker{TPM: prover, Disk: disk, Role: metadata.RoleControlPlane}, disk, key, vol
}

// image is a policy image for role; zero is a fresh swtpm's PCRs 0 and 7.
func image(name string, fill byte, expires *time.Time) policy.Image {
	return policy.Image{Name: name, Roles: []metadata.Role{metadata.RoleControlPlane},
		PCRs: map[int][]byte{0: bytes.Repeat([]byte{fill}, 32), 7: bytes.Repeat([]byte{fill}, 32)}, Expires: expires}
}

func TestSealThenUnlock(t *testing.T) {
	u, disk, key := node(t)
	ctx := t.Context()
	if _, _, err := u.Unlock(ctx); !errors.Is(err, ErrNothingSealed) {
		t.Fatalf("Unlock before any Seal = %v, want ErrNothingSealed", err)
	}
	p := &policy.Policy{Images: []policy.Image{image("other", 1, nil), image("this", 0, nil)}}
	if err := u.Seal(ctx, key, p); err != nil {
		t.Fatalf("Seal: %v", err)
	}
	got, name, err := (&Unlocker{TPM: u.TPM, Disk: disk}).Unlock(ctx)
	if err != nil || !bytes.Equal(got, key) || name != "this" {
		t.Fatalf("Unlock = %x, %q, %v; want the key through image this", got, name, err)
	}
	// The same policy again seals nothing new.
	if err := u.Seal(ctx, key, p); err != nil {
		t.Fatal(err)
	}
	if keys, err := disk.SealedKeys(ctx); err != nil || len(keys) != 1 || keys[0].Seq != 1 {
		t.Fatalf("sealed keys after sealing the same policy twice: %+v, %v", keys, err)
	}

	// The policy drops this image: the node can no longer unlock locally, and the error names the PCR.
	if err := u.Seal(ctx, key, &policy.Policy{Images: []policy.Image{image("other", 1, nil)}}); err != nil {
		t.Fatal(err)
	}
	_, _, err = u.Unlock(ctx)
	if err == nil || !strings.Contains(err.Error(), `"other", differs at PCR 0`) {
		t.Fatalf("Unlock after the image was dropped = %v, want a mismatch at PCR 0", err)
	}

	// An expired image unseals in the TPM but is refused here.
	past := time.Now().Add(-time.Minute)
	if err := u.Seal(ctx, key, &policy.Policy{Images: []policy.Image{image("this", 0, &past)}}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := u.Unlock(ctx); err == nil || !strings.Contains(err.Error(), `"this" expired`) {
		t.Fatalf("Unlock of an expired image = %v, want it refused", err)
	}

	// No image for the role: every sealed key goes.
	if err := u.Seal(ctx, key, &policy.Policy{}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := u.Unlock(ctx); !errors.Is(err, ErrNothingSealed) {
		t.Fatalf("Unlock after an empty policy = %v, want ErrNothingSealed", err)
	}
}

// The policy beside the sealed key is authenticated by the sealed digest: one edited on the disk (to lift
// an expiry, say) is refused.
func TestUnlockRefusesEditedPolicy(t *testing.T) {
	u, disk, key := node(t)
	ctx := t.Context()
	past := time.Now().Add(-time.Minute)
	if err := u.Seal(ctx, key, &policy.Policy{Images: []policy.Image{image("this", 0, &past)}}); err != nil {
		t.Fatal(err)
	}
	keys, err := disk.SealedKeys(ctx)
	if err != nil || len(keys) != 1 {
		t.Fatal(keys, err)
	}
	var rec record
	if err := json.Unmarshal(keys[0].Data, &rec); err != nil {
		t.Fatal(err)
	}
	if rec.Policy, err = (&policy.Policy{Images: []policy.Image{image("this", 0, nil)}}).Marshal(); err != nil {
		t.Fatal(err)
	}
	data, err := json.Marshal(rec)
	if err != nil {
		t.Fatal(err)
	}
	if err := disk.StoreSealedKey(ctx, data); err != nil {
		t.Fatal(err)
	}
	if _, _, err := (&Unlocker{TPM: u.TPM, Disk: disk}).Unlock(context.Background()); err == nil || !strings.Contains(err.Error(), "not the one it was sealed with") {
		t.Fatalf("Unlock with an edited policy = %v, want it refused", err)
	}
}

// Only the newest sealed key counts: an older one (left by a node that died while it resealed) follows a
// policy that was replaced, and may allow an image that is no longer allowed.
func TestUnlockUsesOnlyTheNewest(t *testing.T) {
	u, disk, key, vol := nodeWithVolume(t)
	ctx := t.Context()
	// A reseal that dies right after storing its key, before removing the older one.
	dying := &Unlocker{TPM: u.TPM, Role: u.Role, Disk: statedisk.New(vol, nil, statedisk.WithStepHook(func(string) error {
		return errors.New("power lost")
	}))}
	reseal := func(newest string, fill byte) {
		t.Helper()
		if err := u.Seal(ctx, key, &policy.Policy{Images: []policy.Image{image("older", 0, nil)}}); err != nil {
			t.Fatal(err)
		}
		if err := dying.Seal(ctx, key, &policy.Policy{Images: []policy.Image{image(newest, fill, nil)}}); err == nil {
			t.Fatal("the dying reseal did not die")
		}
		if keys, err := disk.SealedKeys(ctx); err != nil || len(keys) != 2 {
			t.Fatalf("sealed keys after the interrupted reseal: %d, %v; want 2", len(keys), err)
		}
		u.current = nil
	}
	reseal("dropped-this", 1)
	if _, _, err := u.Unlock(ctx); err == nil || !strings.Contains(err.Error(), `"dropped-this"`) {
		t.Fatalf("Unlock = %v; want the newest key refused, never the older one that allows this boot", err)
	}

	// The newest unseals: the older one is removed.
	reseal("newest", 0)
	if _, name, err := u.Unlock(ctx); err != nil || name != "newest" {
		t.Fatalf("Unlock = %q, %v; want image newest", name, err)
	}
	if keys, err := disk.SealedKeys(ctx); err != nil || len(keys) != 1 {
		t.Errorf("sealed keys after unlocking from the newest: %d (%v), want 1", len(keys), err)
	}
}
