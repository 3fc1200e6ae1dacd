// Package chroot is a Packer communicator for a root file system being built on this machine: commands run
// in a chroot of it, files move in and out of it without ever leaving it.
package chroot

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"

	packersdk "github.com/hashicorp/packer-plugin-sdk/packer"
)

// chrootEnv is the environment of provisioners' commands: the host's would leak its PATH and HOME into
// the image's root.
var chrootEnv = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", "LANG=C.UTF-8"}

// Communicator is what provisioners reach in a berth-uki build: the root file system Root. Commands run in
// a chroot of it with its own /bin/sh (util-linux's unshare and mount, coreutils' chroot); files move in and
// out through an os.Root, so that no path or symbolic link in the tree reaches outside it.
type Communicator struct {
	Root string
}

// chrootScript runs "$2" in a chroot of "$1" with the host's /dev and a /proc, as install scripts expect
// them. It runs in a mount namespace of its own, so the mounts end with it and never reach the image.
const chrootScript = `mkdir -p "$1/dev" "$1/proc" && mount --rbind /dev "$1/dev" && mount -t proc proc "$1/proc" && exec chroot "$1" /bin/sh -c "$2"`

func (c *Communicator) Start(ctx context.Context, rc *packersdk.RemoteCmd) error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("provisioning root_directory runs commands in a chroot, which needs root: run packer build as root")
	}
	if _, err := os.Stat(filepath.Join(c.Root, "bin/sh")); err != nil {
		return fmt.Errorf("running a command in a chroot of %s: root_directory has no /bin/sh: %w", c.Root, err)
	}
	cmd := exec.CommandContext(ctx, "unshare", "--mount", "--propagation", "private", "--",
		"/bin/sh", "-c", chrootScript, "berth-chroot", c.Root, rc.Command)
	cmd.Env = chrootEnv
	cmd.Stdin, cmd.Stdout, cmd.Stderr = rc.Stdin, rc.Stdout, rc.Stderr
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("running a command in a chroot of %s: %w", c.Root, err)
	}
	go func() {
		status := 0
		if err := cmd.Wait(); err != nil {
			var ee *exec.ExitError
			if errors.As(err, &ee) {
				status = ee.ExitCode()
			} else {
				status = packersdk.CmdDisconnect
			}
		}
		rc.SetExited(status)
	}()
	return nil
}

// rel is dst as a path below the tree's root: provisioners name files as the image sees them.
func rel(p string) (string, error) {
	if !path.IsAbs(p) {
		return "", fmt.Errorf("%q: want an absolute path in the image", p)
	}
	r := strings.TrimPrefix(path.Clean(p), "/")
	if r == "" {
		r = "."
	}
	return r, nil
}

func (c *Communicator) Upload(dst string, r io.Reader, fi *os.FileInfo) error {
	name, err := rel(dst)
	if err != nil {
		return fmt.Errorf("upload: %w", err)
	}
	mode := fs.FileMode(0o644)
	if fi != nil && *fi != nil {
		mode = (*fi).Mode().Perm()
	}
	root, err := os.OpenRoot(c.Root)
	if err != nil {
		return err
	}
	defer root.Close()
	f, err := root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, mode)
	if err != nil {
		return fmt.Errorf("upload to %s: %w", dst, err)
	}
	if _, err := io.Copy(f, r); err != nil {
		f.Close()
		return fmt.Errorf("upload to %s: %w", dst, err)
	}
	return f.Close()
}

// UploadDir copies the local directory src to dst as scp -r would: src itself, or only its contents when it
// ends with a slash. Paths matching an exclude pattern (relative to src) are skipped.
func (c *Communicator) UploadDir(dst, src string, exclude []string) error {
	base, err := rel(dst)
	if err != nil {
		return fmt.Errorf("upload: %w", err)
	}
	if !strings.HasSuffix(src, "/") {
		base = path.Join(base, filepath.Base(src))
	}
	root, err := os.OpenRoot(c.Root)
	if err != nil {
		return err
	}
	defer root.Close()
	return filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		r, err := filepath.Rel(src, p)
		if err != nil {
			return err
		}
		for _, pattern := range exclude {
			if ok, _ := filepath.Match(pattern, r); ok {
				if d.IsDir() {
					return filepath.SkipDir
				}
				return nil
			}
		}
		target := path.Join(base, filepath.ToSlash(r))
		info, err := d.Info()
		if err != nil {
			return err
		}
		switch {
		case d.IsDir():
			return root.MkdirAll(target, info.Mode().Perm())
		case d.Type() == fs.ModeSymlink:
			link, err := os.Readlink(p)
			if err != nil {
				return err
			}
			return root.Symlink(link, target)
		case d.Type().IsRegular():
			data, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			return root.WriteFile(target, data, info.Mode().Perm())
		}
		return fmt.Errorf("upload of %s: not a directory, regular file or symbolic link", p)
	})
}

func (c *Communicator) Download(src string, w io.Writer) error {
	name, err := rel(src)
	if err != nil {
		return fmt.Errorf("download: %w", err)
	}
	root, err := os.OpenRoot(c.Root)
	if err != nil {
		return err
	}
	defer root.Close()
	f, err := root.Open(name)
	if err != nil {
		return fmt.Errorf("download of %s: %w", src, err)
	}
	defer f.Close()
	_, err = io.Copy(w, f)
	return err
}

func (c *Communicator) DownloadDir(src, dst string, _ []string) error {
	return fmt.Errorf("download of the directory %s: the chroot communicator downloads files only", src)
}
