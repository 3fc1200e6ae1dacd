// Package verifiedroot reads a node's verified root device end to end before the node attests.
//
// dm-verity checks a block when it is read. Reading the whole device first turns "a tampered block stops
// the node when something reads it, perhaps after its join" into "a tampered block stops the node before it
// asks for any secret": with the image's panic-on-corruption, the read never returns; without it, Read
// fails and the agent does not attest.
package verifiedroot

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
)

// DefaultDevice is where the initrd of an image with a verified root maps it (berth-uki-install).
const DefaultDevice = "/dev/mapper/berth-root"

// ErrAbsent means the device does not exist: the image has no verified root.
var ErrAbsent = errors.New("no verified root device")

// chunk is what one read asks for: large enough for sequential reads to be fast, small enough to notice
// a cancelled context soon.
const chunk = 4 << 20

// Read reads dev from its first byte to its last and returns how many bytes that was.
func Read(ctx context.Context, dev string) (int64, error) {
	f, err := os.Open(dev)
	if errors.Is(err, os.ErrNotExist) {
		return 0, ErrAbsent
	}
	if err != nil {
		return 0, fmt.Errorf("reading the verified root: %w", err)
	}
	defer f.Close()
	buf := make([]byte, chunk)
	var total int64
	for {
		if err := ctx.Err(); err != nil {
			return total, err
		}
		n, err := f.Read(buf)
		total += int64(n)
		if errors.Is(err, io.EOF) {
			return total, nil
		}
		if err != nil {
			return total, fmt.Errorf("reading the verified root %s at byte %d: %w (dm-verity fails the read of a block that does not match the image's root hash)", dev, total, err)
		}
	}
}
