package luks

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// imageSize leaves room for cryptsetup's default LUKS2 header (16 MiB of metadata and keyslots) plus data.
const imageSize = 32 << 20

func needCryptsetup(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("cryptsetup"); err != nil {
		t.Fatalf("cryptsetup not found: run make deps (%v)", err)
	}
}

// newImage returns the path of a sparse, zero-filled image file.
func newImage(t *testing.T) string {
	t.Helper()
	needCryptsetup(t)
	path := filepath.Join(t.TempDir(), "disk.img")
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

func newKey(t *testing.T) []byte {
	t.Helper()
	k := make([]byte, 32)
	if _, err := rand.Read(k); err != nil {
		t.Fatal(err)
	}
	return k
}

func formatted(t *testing.T, key []byte, label string, opts ...Option) *Volume {
	t.Helper()
	v := New(newImage(t), nil, opts...)
	if err := v.Format(t.Context(), key, label); err != nil {
		t.Fatalf("Format: %v", err)
	}
	return v
}

func wantSlots(t *testing.T, v *Volume, want ...int) {
	t.Helper()
	got, err := v.Slots(t.Context())
	if err != nil {
		t.Fatalf("Slots: %v", err)
	}
	if !slices.Equal(got, want) {
		t.Fatalf("Slots = %v, want %v", got, want)
	}
}

func wantSlot(t *testing.T, v *Volume, key []byte, want int) {
	t.Helper()
	got, err := v.KeySlot(t.Context(), key)
	if err != nil {
		t.Fatalf("KeySlot: %v", err)
	}
	if got != want {
		t.Fatalf("KeySlot = %d, want %d", got, want)
	}
}

func wantWrongKey(t *testing.T, v *Volume, key []byte) {
	t.Helper()
	slot, err := v.KeySlot(t.Context(), key)
	if !errors.Is(err, ErrWrongKey) {
		t.Fatalf("KeySlot = %d, %v; want ErrWrongKey", slot, err)
	}
}

func TestIsLUKS(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	zero := New(newImage(t), nil)
	if got, err := zero.IsLUKS(ctx); err != nil || got {
		t.Errorf("IsLUKS(zero-filled file) = %v, %v; want false, nil", got, err)
	}
	luks := formatted(t, newKey(t), "")
	if got, err := luks.IsLUKS(ctx); err != nil || !got {
		t.Errorf("IsLUKS(formatted file) = %v, %v; want true, nil", got, err)
	}
	missing := New(filepath.Join(t.TempDir(), "missing"), nil)
	if got, err := missing.IsLUKS(ctx); err == nil {
		t.Errorf("IsLUKS(missing file) = %v, nil; want an error", got)
	}
}

func TestFormat(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	key := newKey(t)
	v := formatted(t, key, "berth-test")

	id, err := v.UUID(ctx)
	if err != nil {
		t.Fatalf("UUID: %v", err)
	}
	if !regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`).MatchString(id) {
		t.Errorf("UUID = %q, want a canonical lowercase UUID", id)
	}
	label, err := v.Label(ctx)
	if err != nil || label != "berth-test" {
		t.Errorf("Label = %q, %v; want berth-test", label, err)
	}
	wantSlots(t, v, 0)
	wantSlot(t, v, key, 0)
	wantWrongKey(t, v, newKey(t))

	// Formatting again makes a new volume: a new UUID, and the old key is gone.
	key2 := newKey(t)
	if err := v.Format(ctx, key2, ""); err != nil {
		t.Fatalf("second Format: %v", err)
	}
	if id2, err := v.UUID(ctx); err != nil || id2 == id {
		t.Errorf("UUID after reformat = %q, %v; want a new UUID (old %q)", id2, err, id)
	}
	if label, err := v.Label(ctx); err != nil || label != "" {
		t.Errorf("Label after reformat without label = %q, %v; want empty", label, err)
	}
	wantWrongKey(t, v, key)
	wantSlot(t, v, key2, 0)
}

func TestFormatRefusesBadInput(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name  string
		key   []byte
		label string
	}{
		{"empty key", nil, ""},
		{"short key", make([]byte, MinKeySize-1), ""},
		{"huge key", make([]byte, MaxKeySize+1), ""},
		{"label too long", make([]byte, 32), strings.Repeat("a", MaxLabelSize+1)},
		{"label with space", make([]byte, 32), "berth fresh"},
		{"label with newline", make([]byte, 32), "berth\nLabel: x"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			v := New(newImage(t), nil)
			if err := v.Format(t.Context(), tt.key, tt.label); err == nil {
				t.Fatal("Format succeeded, want an error")
			}
			if ok, err := v.IsLUKS(t.Context()); err != nil || ok {
				t.Fatalf("IsLUKS after refused Format = %v, %v; want false, nil", ok, err)
			}
		})
	}
}

// Keys are binary: a newline or NUL in a key must reach cryptsetup as is, and nothing may be trimmed or added.
func TestBinaryKeys(t *testing.T) {
	t.Parallel()
	key := newKey(t)
	key[0], key[10], key[31] = '\n', 0, '\n'
	v := formatted(t, key, "")
	wantSlot(t, v, key, 0)
	wantWrongKey(t, v, key[:31])
	wantWrongKey(t, v, append(slices.Clone(key), '\n'))
	wantWrongKey(t, v, key[1:])
}

func TestSetLabel(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	v := formatted(t, newKey(t), "first")
	for _, label := range []string{"second.label_2-x", strings.Repeat("L", MaxLabelSize), ""} {
		if err := v.SetLabel(ctx, label); err != nil {
			t.Fatalf("SetLabel(%q): %v", label, err)
		}
		if got, err := v.Label(ctx); err != nil || got != label {
			t.Fatalf("Label = %q, %v; want %q", got, err, label)
		}
	}
	if err := v.SetLabel(ctx, "bad label"); err == nil {
		t.Error("SetLabel with a space succeeded, want an error")
	}
}

func TestAddKeyKillSlot(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	k1, k2, stranger := newKey(t), newKey(t), newKey(t)
	v := formatted(t, k1, "")

	if err := v.AddKey(ctx, stranger, k2); !errors.Is(err, ErrWrongKey) {
		t.Fatalf("AddKey authorized by a stranger's key = %v, want ErrWrongKey", err)
	}
	wantSlots(t, v, 0)

	if err := v.AddKey(ctx, k1, k2); err != nil {
		t.Fatalf("AddKey: %v", err)
	}
	wantSlots(t, v, 0, 1)
	wantSlot(t, v, k1, 0)
	wantSlot(t, v, k2, 1)

	if err := v.AddKey(ctx, k1, k2[:MinKeySize-1]); err == nil {
		t.Error("AddKey with a short new key succeeded, want an error")
	}

	// A key that opens only the slot being wiped does not authorize wiping it.
	if err := v.KillSlot(ctx, 0, k1); !errors.Is(err, ErrWrongKey) {
		t.Fatalf("KillSlot(0) authorized by slot 0's own key = %v, want ErrWrongKey", err)
	}
	if err := v.KillSlot(ctx, 0, stranger); !errors.Is(err, ErrWrongKey) {
		t.Fatalf("KillSlot(0) authorized by a stranger's key = %v, want ErrWrongKey", err)
	}
	wantSlots(t, v, 0, 1)

	if err := v.KillSlot(ctx, 0, k2); err != nil {
		t.Fatalf("KillSlot(0): %v", err)
	}
	wantSlots(t, v, 1)
	wantWrongKey(t, v, k1)
	wantSlot(t, v, k2, 1)

	// The last key can never be wiped: no key opens another slot.
	if err := v.KillSlot(ctx, 1, k2); err == nil {
		t.Fatal("KillSlot of the last keyslot succeeded, want an error")
	}
	for _, slot := range []int{-1, 0, 5, 32} {
		if err := v.KillSlot(ctx, slot, k2); err == nil {
			t.Errorf("KillSlot(%d) succeeded, want an error", slot)
		}
	}
	wantSlots(t, v, 1)
}

// Keyslots must use the cheap PBKDF2 setting, never cryptsetup's memory-hard default.
func TestKeyslotKDF(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	k1 := newKey(t)
	v := formatted(t, k1, "")
	if err := v.AddKey(ctx, k1, newKey(t)); err != nil {
		t.Fatalf("AddKey: %v", err)
	}
	out, err := v.run(ctx, nil, nil, "luksDump", "--dump-json-metadata", v.path)
	if err != nil {
		t.Fatal(err)
	}
	var meta struct {
		Keyslots map[string]struct {
			KDF struct {
				Type       string `json:"type"`
				Iterations int    `json:"iterations"`
			} `json:"kdf"`
		} `json:"keyslots"`
	}
	if err := json.Unmarshal([]byte(out), &meta); err != nil {
		t.Fatal(err)
	}
	if len(meta.Keyslots) != 2 {
		t.Fatalf("%d keyslots, want 2", len(meta.Keyslots))
	}
	for slot, ks := range meta.Keyslots {
		if ks.KDF.Type != "pbkdf2" || ks.KDF.Iterations != 1000 {
			t.Errorf("keyslot %s KDF = %s with %d iterations, want pbkdf2 with 1000", slot, ks.KDF.Type, ks.KDF.Iterations)
		}
	}
}

// Keys must never be in cryptsetup's argv (readable by every local user in /proc) nor in errors.
func TestKeysStayOutOfArgvAndErrors(t *testing.T) {
	t.Parallel()
	needCryptsetup(t)
	cs, err := exec.LookPath("cryptsetup")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	argvLog := filepath.Join(dir, "argv.log")
	wrapper := filepath.Join(dir, "cryptsetup")
	script := "#!/bin/sh\nprintf '%s\\n' \"$*\" >> '" + argvLog + "'\nexec '" + cs + "' \"$@\"\n"
	if err := os.WriteFile(wrapper, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	// Printable keys, so that a plain text search of the log would find them.
	k1 := []byte(rand.Text() + "-first-key")
	k2 := []byte(rand.Text() + "-second-key")
	ctx := t.Context()
	v := formatted(t, k1, "", WithCryptsetup(wrapper))
	if err := v.AddKey(ctx, k1, k2); err != nil {
		t.Fatalf("AddKey: %v", err)
	}
	wantSlot(t, v, k2, 1)
	_, wrongErr := v.KeySlot(ctx, []byte(rand.Text()+"-wrong-key"))
	if !errors.Is(wrongErr, ErrWrongKey) {
		t.Fatalf("KeySlot(wrong key) = %v, want ErrWrongKey", wrongErr)
	}
	killErr := v.KillSlot(ctx, 1, k2)
	if err := v.KillSlot(ctx, 0, k2); err != nil {
		t.Fatalf("KillSlot: %v", err)
	}

	logged, err := os.ReadFile(argvLog)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"luksFormat", "luksAddKey", "--test-passphrase", "luksKillSlot"} {
		if !bytes.Contains(logged, []byte(want)) {
			t.Fatalf("argv log lacks %s, the wrapper did not run:\n%s", want, logged)
		}
	}
	for _, k := range [][]byte{k1, k2} {
		if bytes.Contains(logged, k) {
			t.Errorf("a key appears in cryptsetup's argv:\n%s", logged)
		}
		for _, e := range []error{wrongErr, killErr} {
			if e != nil && strings.Contains(e.Error(), string(k)) {
				t.Errorf("a key appears in an error: %v", e)
			}
		}
	}
}

func TestErrorsCarryCryptsetupStderr(t *testing.T) {
	t.Parallel()
	v := New(newImage(t), nil)
	_, err := v.Label(t.Context())
	if err == nil {
		t.Fatal("Label of a zero-filled file succeeded, want an error")
	}
	if !strings.Contains(err.Error(), "not a valid LUKS device") || !strings.Contains(err.Error(), v.Path()) {
		t.Errorf("error %q lacks cryptsetup's explanation or the device", err)
	}
	if _, err := v.KeySlot(t.Context(), newKey(t)); err == nil || errors.Is(err, ErrWrongKey) {
		t.Errorf("KeySlot on a non-LUKS file = %v, want an error other than ErrWrongKey", err)
	}
}

func TestMissingCryptsetup(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	_, err := New("/dev/null", nil).IsLUKS(context.Background())
	if err == nil || !strings.Contains(err.Error(), "cryptsetup not found") {
		t.Errorf("IsLUKS without cryptsetup on PATH = %v, want a cryptsetup not found error", err)
	}
	_, err = New("/dev/null", nil, WithCryptsetup(filepath.Join(t.TempDir(), "none"))).UUID(context.Background())
	if err == nil {
		t.Error("UUID with a missing cryptsetup binary succeeded, want an error")
	}
}

func TestMappingNames(t *testing.T) {
	t.Parallel()
	v := New("/nonexistent", nil)
	key := make([]byte, 32)
	for _, name := range []string{"", ".", "..", "a/b", "../control", "a b", strings.Repeat("n", 128)} {
		if _, err := v.Open(t.Context(), key, name); err == nil || !strings.Contains(err.Error(), "mapping name") {
			t.Errorf("Open(%q) = %v, want a mapping name error", name, err)
		}
		if err := v.Close(t.Context(), name); err == nil || !strings.Contains(err.Error(), "mapping name") {
			t.Errorf("Close(%q) = %v, want a mapping name error", name, err)
		}
	}
	for _, name := range []string{"berth-state", "a.b_c", strings.Repeat("n", 127)} {
		if err := checkMapperName(name); err != nil {
			t.Errorf("checkMapperName(%q) = %v, want nil", name, err)
		}
	}
}

func TestTokens(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	key := newKey(t)
	v := formatted(t, key, "")
	if got, err := v.Tokens(ctx, "berth-test"); err != nil || len(got) != 0 {
		t.Fatalf("Tokens of a new volume = %v, %v; want none", got, err)
	}
	first, err := v.AddToken(ctx, []byte(`{"type":"berth-test","keyslots":[],"n":1}`))
	if err != nil {
		t.Fatalf("AddToken: %v", err)
	}
	if _, err := v.AddToken(ctx, []byte(`{"type":"other","keyslots":[]}`)); err != nil {
		t.Fatalf("AddToken: %v", err)
	}
	second, err := v.AddToken(ctx, []byte(`{"type":"berth-test","keyslots":[],"n":2}`))
	if err != nil {
		t.Fatalf("AddToken: %v", err)
	}
	if first != 0 || second != 2 {
		t.Errorf("token ids %d and %d, want the lowest free ids 0 and 2", first, second)
	}
	got, err := v.Tokens(ctx, "berth-test")
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0].ID != first || got[1].ID != second {
		t.Fatalf("Tokens = %+v, want ids %d and %d", got, first, second)
	}
	var body struct{ N int }
	if err := json.Unmarshal(got[1].JSON, &body); err != nil || body.N != 2 {
		t.Errorf("token %d reads back as %s (%v)", second, got[1].JSON, err)
	}
	if err := v.RemoveToken(ctx, first); err != nil {
		t.Fatalf("RemoveToken: %v", err)
	}
	if got, err := v.Tokens(ctx, "berth-test"); err != nil || len(got) != 1 || got[0].ID != second {
		t.Fatalf("Tokens after removing %d = %+v, %v", first, got, err)
	}
	// Tokens are metadata: the key and its slot are untouched.
	wantSlot(t, v, key, 0)

	if _, err := v.AddToken(ctx, []byte(`{"type":"berth-test"`)); err == nil {
		t.Error("AddToken of broken JSON succeeded")
	}
	if _, err := v.AddToken(ctx, bytes.Repeat([]byte("x"), MaxTokenSize+1)); err == nil || !strings.Contains(err.Error(), "at most") {
		t.Errorf("AddToken of an oversized token = %v, want the size named", err)
	}
	for _, id := range []int{-1, 32} {
		if err := v.RemoveToken(ctx, id); err == nil {
			t.Errorf("RemoveToken(%d) succeeded", id)
		}
	}
}
