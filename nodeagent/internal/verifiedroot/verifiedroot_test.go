package verifiedroot

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestReadAll(t *testing.T) {
	path := filepath.Join(t.TempDir(), "root")
	if err := os.WriteFile(path, make([]byte, 3*chunk+100), 0o600); err != nil {
		t.Fatal(err)
	}
	n, err := Read(context.Background(), path)
	if err != nil || n != 3*chunk+100 {
		t.Errorf("Read = %d, %v; want every byte", n, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := Read(ctx, path); !errors.Is(err, context.Canceled) {
		t.Errorf("Read with a cancelled context: %v", err)
	}
	if _, err := Read(context.Background(), filepath.Join(t.TempDir(), "absent")); !errors.Is(err, ErrAbsent) {
		t.Errorf("Read of an absent device: %v, want ErrAbsent", err)
	}
}

// TestReadFailure stands in for dm-verity's I/O error (the real one is TestAccQEMUImage's, in a VM: this host
// has no device-mapper): a device whose read fails is not read past, and the error says why it matters.
func TestReadFailure(t *testing.T) {
	_, err := Read(context.Background(), t.TempDir())
	if err == nil || !strings.Contains(err.Error(), "a block that does not match the image's root hash") {
		t.Errorf("Read of something that cannot be read: %v", err)
	}
}
