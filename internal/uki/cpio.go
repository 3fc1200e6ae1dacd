package uki

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
)

// Entry is one file or directory of a cpio archive.
type Entry struct {
	// Path inside the archive, such as `init` or `usr/bin/x`; a leading `/` is dropped, as the kernel
	// unpacks relative to the root.
	Path string
	// Mode is the permission bits, with fs.ModeDir for a directory or fs.ModeSymlink for a symbolic link;
	// other types are refused.
	Mode fs.FileMode
	// Data is a regular file's content or a symbolic link's target; a directory has none.
	Data []byte
}

// dirMode is the mode of the parent directories WriteCpio adds.
const dirMode = fs.ModeDir | 0o755

// WriteCpio writes entries, in order, as a newc archive, the format the kernel unpacks an initrd from. A
// parent directory that no earlier entry made is added with mode 0755 just before its first child, since
// the kernel creates no directories of its own. Owners are root and times are zero, so the same entries
// make the same bytes and the image's measurements do not depend on when it was built.
func WriteCpio(w io.Writer, entries []Entry) error {
	bw := bufio.NewWriter(w)
	cw := &cpioWriter{w: bw, made: map[string]bool{}}
	for _, e := range entries {
		if err := cw.add(e); err != nil {
			return err
		}
	}
	if err := cw.write("TRAILER!!!", 0, nil); err != nil {
		return err
	}
	return bw.Flush()
}

type cpioWriter struct {
	w    *bufio.Writer
	n    int64 // bytes written, for the 4-byte padding
	ino  uint32
	made map[string]bool
}

func (c *cpioWriter) add(e Entry) error {
	name := strings.TrimPrefix(e.Path, "/")
	if name == "" || path.Clean(name) != name || name == ".." || strings.HasPrefix(name, "../") || strings.ContainsRune(name, 0) {
		return fmt.Errorf("cpio entry %q: want a clean path below the root, such as init or usr/bin/x", e.Path)
	}
	if e.Mode&^(fs.ModeDir|fs.ModeSymlink|fs.ModePerm|fs.ModeSetuid|fs.ModeSetgid|fs.ModeSticky) != 0 || e.Mode&fs.ModeDir != 0 && e.Mode&fs.ModeSymlink != 0 {
		return fmt.Errorf("cpio entry %s: mode %v: only regular files, directories and symbolic links are supported", name, e.Mode)
	}
	if e.Mode&fs.ModeSymlink != 0 && len(e.Data) == 0 {
		return fmt.Errorf("cpio entry %s: a symbolic link without a target", name)
	}
	if e.Mode.IsDir() && len(e.Data) > 0 {
		return fmt.Errorf("cpio entry %s: a directory with data", name)
	}
	if uint64(len(e.Data)) > 0xffffffff {
		return fmt.Errorf("cpio entry %s: %d bytes, more than newc's 4 GiB", name, len(e.Data))
	}
	if c.made[name] {
		return fmt.Errorf("cpio entry %s given twice (a directory must come before the files under it)", name)
	}
	if dir := path.Dir(name); dir != "." && !c.made[dir] {
		if err := c.add(Entry{Path: dir, Mode: dirMode}); err != nil {
			return err
		}
	}
	c.made[name] = true
	mode := uint32(e.Mode.Perm())
	if e.Mode&fs.ModeSetuid != 0 {
		mode |= 0o4000
	}
	if e.Mode&fs.ModeSetgid != 0 {
		mode |= 0o2000
	}
	if e.Mode&fs.ModeSticky != 0 {
		mode |= 0o1000
	}
	switch {
	case e.Mode.IsDir():
		mode |= 0o040000
	case e.Mode&fs.ModeSymlink != 0:
		mode |= 0o120000
	default:
		mode |= 0o100000
	}
	return c.write(name, mode, e.Data)
}

func (c *cpioWriter) write(name string, mode uint32, data []byte) error {
	c.ino++
	nlink := 1
	if mode&0o040000 != 0 {
		nlink = 2
	}
	// newc: magic, then 13 eight-digit hex fields: ino, mode, uid, gid, nlink, mtime, filesize, devmajor,
	// devminor, rdevmajor, rdevminor, namesize (with its NUL), check.
	hdr := fmt.Sprintf("070701%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x",
		c.ino, mode, 0, 0, nlink, 0, len(data), 0, 0, 0, 0, len(name)+1, 0)
	for _, part := range []string{hdr, name + "\x00", pad(c.n + int64(len(hdr)+len(name)+1))} {
		if err := c.put([]byte(part)); err != nil {
			return err
		}
	}
	if err := c.put(data); err != nil {
		return err
	}
	return c.put([]byte(pad(c.n)))
}

func (c *cpioWriter) put(b []byte) error {
	n, err := c.w.Write(b)
	c.n += int64(n)
	if err != nil {
		return fmt.Errorf("writing the cpio archive: %w", err)
	}
	return nil
}

// pad is the NULs that bring an archive of n bytes to a multiple of four, as newc aligns names and data.
func pad(n int64) string { return strings.Repeat("\x00", int((4-n%4)%4)) }

// Cpio is WriteCpio into memory.
func Cpio(entries ...Entry) ([]byte, error) {
	var b bytes.Buffer
	if err := WriteCpio(&b, entries); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// TreeEntries reads the directory tree at root into entries, in lexical order so that every directory
// comes before what it holds: directories and regular files with their permission bits, symbolic links
// with their targets (not followed). Hard links become copies. Device nodes, sockets and pipes are refused,
// naming the path: an initrd gets /dev from devtmpfs at boot.
func TreeEntries(root string) ([]Entry, error) {
	var entries []Entry
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		if rel == "." {
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		e := Entry{Path: filepath.ToSlash(rel), Mode: info.Mode() & (fs.ModePerm | fs.ModeSetuid | fs.ModeSetgid | fs.ModeSticky)}
		switch t := info.Mode().Type(); {
		case t == fs.ModeDir:
			e.Mode |= fs.ModeDir
		case t == fs.ModeSymlink:
			target, err := os.Readlink(p)
			if err != nil {
				return err
			}
			e.Mode, e.Data = fs.ModeSymlink|0o777, []byte(target)
		case t.IsRegular():
			if e.Data, err = os.ReadFile(p); err != nil {
				return err
			}
		default:
			return fmt.Errorf("%s is a %s: an initrd holds directories, regular files and symbolic links only", p, typeName(t))
		}
		entries = append(entries, e)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("reading the tree %s: %w", root, err)
	}
	return entries, nil
}

func typeName(t fs.FileMode) string {
	switch {
	case t&fs.ModeDevice != 0 && t&fs.ModeCharDevice != 0:
		return "character device"
	case t&fs.ModeDevice != 0:
		return "block device"
	case t&fs.ModeNamedPipe != 0:
		return "named pipe"
	case t&fs.ModeSocket != 0:
		return "socket"
	}
	return "special file"
}
