package statedisk

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
)

// DirsSubdir is the directory of the mounted state volume that holds the bound directories, each under its
// own path: /etc/kubernetes is <mount>/dirs/etc/kubernetes.
const DirsSubdir = "dirs"

// BindDirs makes each of dirs a bind mount of its own directory on the state volume mounted at mount, so that
// what kubeadm, the kubelet and etcd write there (the cluster's CA keys, etcd's data, the kubelet's
// credentials) is encrypted with the disk key and outlives a root file system that is read-only or in memory.
//
// A directory bound for the first time starts with what the image put there, copied (cp -a) into a temporary
// directory that is renamed into place only when the copy is complete, so that an interrupted copy is made
// again. A directory that is already this bind (the agent restarted in the same boot) is left as it is; one
// that is a mount point of anything else is refused, since binding over it would hide what another part of
// the machine set up.
func BindDirs(ctx context.Context, logger *slog.Logger, mount string, dirs []string) error {
	if len(dirs) == 0 {
		return nil
	}
	mounts, err := readMountInfo("/proc/self/mountinfo")
	if err != nil {
		return fmt.Errorf("binding directories from the state disk: %w", err)
	}
	volume, ok := mounts.at(mount)
	if !ok {
		return fmt.Errorf("binding directories from the state disk: %s is not a mount point", mount)
	}
	for _, dir := range dirs {
		if err := bindDir(ctx, logger, mounts, volume, mount, dir); err != nil {
			return fmt.Errorf("binding %s from the state disk: %w", dir, err)
		}
	}
	return nil
}

func bindDir(ctx context.Context, logger *slog.Logger, mounts mountInfo, volume mountEntry, mount, dir string) error {
	rel := filepath.Join(DirsSubdir, dir)
	if m, ok := mounts.at(dir); ok {
		if m.device == volume.device && m.root == filepath.Join(volume.root, rel) {
			logger.Info("directory already bound from the state disk", "dir", dir)
			return nil
		}
		return fmt.Errorf("%s is already a mount point (of %s on device %s); refusing to hide it", dir, m.root, m.device)
	}
	src := filepath.Join(mount, rel)
	if err := populate(ctx, src, dir); err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if _, err := command(ctx, "mount", "--bind", src, dir); err != nil {
		return err
	}
	logger.Info("directory bound from the state disk", "dir", dir, "source", src)
	return nil
}

// populate makes src, the state volume's copy of dir, unless it exists: a copy of dir if dir holds anything,
// an empty directory otherwise.
func populate(ctx context.Context, src, dir string) error {
	if _, err := os.Stat(src); err == nil {
		return nil
	} else if !errors.Is(err, os.ErrNotExist) {
		return err
	}
	tmp := src + ".partial"
	if err := os.RemoveAll(tmp); err != nil {
		return err
	}
	// Only root reads what these directories hold (etcd refuses a data directory others can read); a copy
	// keeps the image's mode instead.
	if err := os.MkdirAll(tmp, 0o700); err != nil {
		return err
	}
	if info, err := os.Stat(dir); err == nil && info.IsDir() {
		if _, err := command(ctx, "cp", "-a", "--", dir+"/.", tmp); err != nil {
			return fmt.Errorf("copying what the image holds: %w", err)
		}
		if err := os.Chmod(tmp, info.Mode().Perm()); err != nil {
			return err
		}
	}
	if err := os.Rename(tmp, src); err != nil {
		return err
	}
	// The rename must reach the disk before anything is written through the bind.
	d, err := os.Open(filepath.Dir(src))
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// mountEntry is one line of /proc/self/mountinfo: the file system's device, the directory of it that is
// mounted (not "/" for a bind mount), and where.
type mountEntry struct {
	device, root, point string
}

type mountInfo []mountEntry

// at is what is mounted at point: the last entry wins, as a later mount hides earlier ones.
func (m mountInfo) at(point string) (mountEntry, bool) {
	point = filepath.Clean(point)
	for i := len(m) - 1; i >= 0; i-- {
		if m[i].point == point {
			return m[i], true
		}
	}
	return mountEntry{}, false
}

func readMountInfo(path string) (mountInfo, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return parseMountInfo(f)
}

// parseMountInfo reads the format of proc(5): "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root
// rw", with spaces and other special characters in paths written as octal escapes.
func parseMountInfo(r io.Reader) (mountInfo, error) {
	var m mountInfo
	s := bufio.NewScanner(r)
	s.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for s.Scan() {
		f := strings.Fields(s.Text())
		if len(f) < 5 {
			return nil, fmt.Errorf("mountinfo line %q has %d fields, want at least 5", s.Text(), len(f))
		}
		m = append(m, mountEntry{device: f[2], root: unescapeMountPath(f[3]), point: unescapeMountPath(f[4])})
	}
	return m, s.Err()
}

// unescapeMountPath undoes the kernel's octal escapes (\040 for a space, \011, \012, \134).
func unescapeMountPath(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) && isOctal(s[i+1:i+4]) {
			b.WriteByte((s[i+1]-'0')<<6 | (s[i+2]-'0')<<3 | (s[i+3] - '0'))
			i += 3
			continue
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func isOctal(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '7' {
			return false
		}
	}
	return true
}
