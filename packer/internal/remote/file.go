package remote

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path"
	"regexp"

	packersdk "github.com/hashicorp/packer-plugin-sdk/packer"
)

var sha256Hex = regexp.MustCompile(`^[0-9a-f]{64}$`)

// CheckSHA256 refuses what is not a SHA-256 as Hash writes it: 64 lowercase hex digits.
func CheckSHA256(s string) error {
	if !sha256Hex.MatchString(s) {
		return fmt.Errorf("%q is not a SHA-256: want 64 lowercase hex digits", s)
	}
	return nil
}

// File is what a provisioner uploads: a local file, or content the plugin holds.
type File struct {
	Path    string // the local file; empty for Content
	Content []byte
}

// open returns the file's content and, for a local file, its information, which scp takes its length
// from (without it, the communicator copies the file to learn it).
func (f File) open() (io.ReadCloser, *os.FileInfo, error) {
	if f.Path == "" {
		return io.NopCloser(bytes.NewReader(f.Content)), nil, nil
	}
	file, err := os.Open(f.Path)
	if err != nil {
		return nil, nil, err
	}
	fi, err := file.Stat()
	if err != nil {
		file.Close()
		return nil, nil, err
	}
	return file, &fi, nil
}

// Hash streams the file through SHA-256 (a kubelet need not sit in memory) and returns the hex digest and
// the size.
func (f File) Hash() (string, int64, error) {
	r, _, err := f.open()
	if err != nil {
		return "", 0, err
	}
	defer r.Close()
	h := sha256.New()
	n, err := io.Copy(h, r)
	if err != nil {
		return "", 0, err
	}
	return hex.EncodeToString(h.Sum(nil)), n, nil
}

// Upload copies the file to dst on the machine the communicator reaches, showing the progress of a local
// file.
func (f File) Upload(ui packersdk.Ui, comm packersdk.Communicator, dst string) error {
	r, fi, err := f.open()
	if err != nil {
		return err
	}
	defer r.Close()
	if fi == nil {
		return comm.Upload(dst, r, nil)
	}
	progress := ui.TrackProgress(path.Base(f.Path), 0, (*fi).Size(), r)
	defer progress.Close()
	return comm.Upload(dst, progress, fi)
}

// FormatSize is a size as the build's output shows it.
func FormatSize(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	v, suffix := float64(n)/unit, "KiB"
	for _, s := range []string{"MiB", "GiB"} {
		if v < unit {
			break
		}
		v, suffix = v/unit, s
	}
	return fmt.Sprintf("%.1f %s", v, suffix)
}
