package localunlock

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/policy"
)

func marshal(t *testing.T, p *policy.Policy) []byte {
	t.Helper()
	doc, err := p.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	return doc
}

// TestKeeperSealAfterBoot: after a boot that did not unlock from the TPM the key is sealed to the ticket's
// policy if the boot brought one, else to the recorded policy before the init request's; whatever it seals
// to is recorded first. Without a key set in this boot nothing is sealed. Every attempt reaches the observer.
func TestKeeperSealAfterBoot(t *testing.T) {
	u, disk, key := node(t)
	ctx := t.Context()
	dir := t.TempDir()
	seals := &sealCounts{}
	k := NewKeeper(KeeperConfig{TPM: u.TPM, Disk: disk, Role: metadata.RoleControlPlane, Observer: seals,
		PolicyFile: filepath.Join(dir, "unlock-policy.yaml"), InitialPolicyFile: filepath.Join(dir, "join-policy.yaml")})
	this := &policy.Policy{Images: []policy.Image{image("this", 0, nil)}}
	other := &policy.Policy{Images: []policy.Image{image("other", 1, nil)}}

	k.SealAfterBoot(ctx, marshal(t, this))
	if _, _, err := k.Unlock(ctx); !errors.Is(err, ErrNothingSealed) {
		t.Fatalf("sealed without a key set in this boot: %v", err)
	}
	if *seals != (sealCounts{failed: 1}) {
		t.Fatalf("a seal without a key was observed as %+v, want one failure", *seals)
	}
	k.SetKey(key)

	// The init request's policy, when nothing else was ever recorded.
	if err := os.WriteFile(k.initialPolicyFile, marshal(t, this), 0o600); err != nil {
		t.Fatal(err)
	}
	k.SealAfterBoot(ctx, nil)
	if got, image, err := k.Unlock(ctx); err != nil || !bytes.Equal(got, key) || image != "this" {
		t.Fatalf("after sealing to the init request's policy: %q, %v", image, err)
	}
	if recorded, err := os.ReadFile(k.policyFile); err != nil || !bytes.Equal(recorded, marshal(t, this.ForRole(metadata.RoleControlPlane, time.Now()))) {
		t.Fatalf("recorded policy %q, %v", recorded, err)
	}

	// A ticket's policy wins, and is recorded.
	k.SealAfterBoot(ctx, marshal(t, other))
	if _, _, err := k.Unlock(ctx); err == nil {
		t.Fatal("the key still unseals under a policy the ticket dropped")
	}
	// Without a ticket, the recorded policy (now the ticket's) wins over the init request's.
	k.SealAfterBoot(ctx, nil)
	if _, _, err := k.Unlock(ctx); err == nil {
		t.Fatal("sealed to the init request's policy over the recorded one")
	}

	// A document that does not parse leaves the key sealed as it was.
	k.SealTo(ctx, []byte("images: [oops"))
	if _, _, err := k.Unlock(ctx); err == nil {
		t.Fatal("a garbage policy changed what is sealed")
	}
	if *seals != (sealCounts{ok: 3, failed: 1}) {
		t.Errorf("observed seals %+v, want the three that sealed and the one without a key", *seals)
	}
}

// sealCounts is a SealObserver that counts.
type sealCounts struct{ ok, failed int }

func (c *sealCounts) Sealed(err error, _ time.Duration, _ time.Time) {
	if err != nil {
		c.failed++
		return
	}
	c.ok++
}

// TestKeeperRefresh seals to what current returns at each tick and goes on after an error.
func TestKeeperRefresh(t *testing.T) {
	u, disk, key := node(t)
	dir := t.TempDir()
	k := NewKeeper(KeeperConfig{TPM: u.TPM, Disk: disk, Role: metadata.RoleControlPlane,
		PolicyFile: filepath.Join(dir, "unlock-policy.yaml"), InitialPolicyFile: filepath.Join(dir, "join-policy.yaml")})
	k.SetKey(key)
	this := marshal(t, &policy.Policy{Images: []policy.Image{image("this", 0, nil)}})
	ctx, cancel := context.WithCancel(t.Context())
	calls := 0
	done := make(chan struct{})
	go func() {
		defer close(done)
		k.Refresh(ctx, time.Millisecond, func(context.Context) ([]byte, error) {
			calls++
			switch calls {
			case 1:
				return nil, errors.New("no join service answered")
			case 2:
				return this, nil
			}
			cancel()
			return nil, context.Canceled
		})
	}()
	<-done
	if calls != 3 {
		t.Fatalf("current asked %d times, want 3", calls)
	}
	if _, image, err := k.Unlock(t.Context()); err != nil || image != "this" {
		t.Fatalf("after the refresh: %q, %v", image, err)
	}
}
