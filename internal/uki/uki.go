// Package uki assembles unified kernel images (UKIs): systemd-stub with the kernel, initrd, command line and
// os-release added as PE sections, joined with binutils' objcopy the way systemd's documentation shows for
// systems without ukify (Debian 12 has none). It also writes the newc cpio archives an initrd is made of.
// The Packer builder berth-uki and the tests' ukitest share it, so the images tests boot are made the way
// image builds make them.
package uki

import (
	"context"
	"debug/pe"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// Section is one section to add to the stub, such as .linux with the kernel.
type Section struct {
	Name string
	Data []byte
}

// Assemble writes to out a copy of stub with sections added in the order given. The sections are placed
// after the stub's last section, each at the next address aligned to the stub's SectionAlignment, as
// systemd's documentation computes them from the stub's headers: overlapping sections make an image the
// firmware refuses or, worse, one that loads the wrong bytes.
func Assemble(ctx context.Context, stub, out string, sections ...Section) error {
	objcopy, err := exec.LookPath("objcopy")
	if err != nil {
		return errors.New("objcopy not found: install binutils")
	}
	next, align, err := firstFreeAddress(stub)
	if err != nil {
		return fmt.Errorf("reading the stub's headers: %w", err)
	}
	seen := map[string]bool{}
	for _, s := range sections {
		// objcopy keeps only 8 bytes of a section name in the PE header; a longer one would be cut.
		if s.Name == "" || len(s.Name) > 8 || strings.ContainsAny(s.Name, "= \x00") {
			return fmt.Errorf("section name %q: want 1 to 8 characters without '=', space or NUL", s.Name)
		}
		if seen[s.Name] {
			return fmt.Errorf("section %s given twice", s.Name)
		}
		seen[s.Name] = true
	}
	dir, err := os.MkdirTemp("", "berth-uki-")
	if err != nil {
		return fmt.Errorf("staging the sections: %w", err)
	}
	defer os.RemoveAll(dir)
	var args []string
	for i, s := range sections {
		file := filepath.Join(dir, fmt.Sprintf("section%d", i))
		if err := os.WriteFile(file, s.Data, 0o600); err != nil {
			return fmt.Errorf("staging section %s: %w", s.Name, err)
		}
		args = append(args,
			"--add-section", s.Name+"="+file,
			"--change-section-vma", fmt.Sprintf("%s=%#x", s.Name, next))
		next = alignUp(next+uint64(len(s.Data)), align)
	}
	args = append(args, stub, out)
	if b, err := exec.CommandContext(ctx, objcopy, args...).CombinedOutput(); err != nil {
		return fmt.Errorf("objcopy %s: %w\n%s", strings.Join(args, " "), err, b)
	}
	return nil
}

// firstFreeAddress returns the first address after the stub's sections that is aligned to its
// SectionAlignment, and that alignment. Addresses include ImageBase, as objcopy's VMAs do.
func firstFreeAddress(stub string) (next, align uint64, err error) {
	f, err := pe.Open(stub)
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	var base uint64
	switch oh := f.OptionalHeader.(type) {
	case *pe.OptionalHeader64:
		base, align = oh.ImageBase, uint64(oh.SectionAlignment)
	case *pe.OptionalHeader32:
		base, align = uint64(oh.ImageBase), uint64(oh.SectionAlignment)
	default:
		return 0, 0, fmt.Errorf("%s has no optional header", stub)
	}
	if align == 0 {
		return 0, 0, fmt.Errorf("%s has SectionAlignment 0", stub)
	}
	var end uint64
	for _, s := range f.Sections {
		end = max(end, uint64(s.VirtualAddress)+uint64(max(s.VirtualSize, s.Size)))
	}
	return alignUp(base+end, align), align, nil
}

func alignUp(n, align uint64) uint64 { return (n + align - 1) / align * align }
