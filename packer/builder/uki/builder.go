// Package uki is the builder berth-uki: it makes a measured image from local files alone, with no network
// and no machine to provision: a unified kernel image (UKI: systemd-stub with the kernel, an initrd, the
// command line and os-release) and a raw UEFI disk whose EFI system partition boots that UKI from the
// removable-media path. Every byte the boot measures comes from the template's inputs, so berth-manifest's
// prediction of the UKI is the whole story of PCR 4, 9, 11 and 12.
package uki

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/hashicorp/hcl/v2/hcldec"
	packersdk "github.com/hashicorp/packer-plugin-sdk/packer"

	ukiimage "github.com/berthlabs/berth/internal/uki"
	"github.com/berthlabs/berth/packer/internal/chroot"
	"github.com/berthlabs/berth/packer/internal/verity"
)

// BuilderID identifies the builder's artifacts.
const BuilderID = "berthlabs.uki"

// Builder is berth-uki.
type Builder struct {
	config Config
}

func (b *Builder) ConfigSpec() hcldec.ObjectSpec { return b.config.FlatMapstructure().HCL2Spec() }

func (b *Builder) Prepare(raws ...any) ([]string, []string, error) {
	return nil, nil, b.config.Prepare(raws...)
}

func (b *Builder) Run(ctx context.Context, ui packersdk.Ui, hook packersdk.Hook) (packersdk.Artifact, error) {
	c := &b.config
	if c.PackerForce {
		if err := os.RemoveAll(c.OutputDirectory); err != nil {
			return nil, fmt.Errorf("removing the output directory for -force: %w", err)
		}
	}
	if err := os.MkdirAll(filepath.Dir(filepath.Clean(c.OutputDirectory)), 0o755); err != nil {
		return nil, fmt.Errorf("creating the output directory: %w", err)
	}
	if err := os.Mkdir(c.OutputDirectory, 0o755); err != nil {
		return nil, fmt.Errorf("creating the output directory: %w", err)
	}
	art := &Artifact{
		dir: c.OutputDirectory,
		efi: filepath.Join(c.OutputDirectory, c.Name+".efi"),
		raw: filepath.Join(c.OutputDirectory, c.Name+".raw"),
	}
	if err := b.build(ctx, ui, hook, art); err != nil {
		// A partial output is worth nothing and would block the next build without -force.
		os.RemoveAll(c.OutputDirectory)
		return nil, err
	}
	return art, nil
}

func (b *Builder) build(ctx context.Context, ui packersdk.Ui, hook packersdk.Hook, art *Artifact) error {
	c := &b.config
	var r fromRoot
	cmdline := c.Cmdline
	if c.RootDirectory != "" {
		var err error
		if r, err = b.root(ctx, ui, hook, filepath.Join(c.OutputDirectory, "root"), filepath.Join(c.OutputDirectory, "root.img")); err != nil {
			return err
		}
		if r.partition != nil {
			defer os.Remove(r.partition.image)
			if cmdline, err = verity.Cmdline(c.Cmdline, r.partition.record); err != nil {
				return err
			}
			ui.Say("Command line embedded in the UKI: " + cmdline)
		}
	} else {
		// Packer runs provisioners only through the hook: with no root to provision, they get no
		// communicator, and berth-agent says so.
		if err := hook.Run(ctx, packersdk.HookProvision, ui, nil, nil); err != nil {
			return err
		}
		var err error
		if r.entries, err = b.fileEntries(); err != nil {
			return err
		}
	}
	start := time.Now()
	initrd := r.initrd
	if initrd == nil {
		var err error
		if initrd, err = b.initrd(r.entries); err != nil {
			return err
		}
		if len(initrd) > 0 {
			what := fmt.Sprintf("initrd_files (%d)", len(c.InitrdFiles))
			if c.RootDirectory != "" {
				what = fmt.Sprintf("the provisioned root (%d entries)", len(r.entries))
			}
			ui.Say(fmt.Sprintf("Made the initrd: a cpio archive of %s and initrd_append (%d), %s in %.2fs",
				what, len(c.InitrdAppend), mib(int64(len(initrd))), time.Since(start).Seconds()))
		}
	}

	start = time.Now()
	kernel := r.kernel
	if kernel == nil {
		var err error
		if kernel, err = os.ReadFile(c.Kernel); err != nil {
			return fmt.Errorf("reading the kernel: %w", err)
		}
	}
	sections := []ukiimage.Section{
		{Name: ".osrel", Data: []byte(c.OSRelease)},
		{Name: ".cmdline", Data: []byte(cmdline)},
		{Name: ".linux", Data: kernel},
	}
	if len(initrd) > 0 {
		sections = append(sections, ukiimage.Section{Name: ".initrd", Data: initrd})
	}
	if err := ukiimage.Assemble(ctx, c.Stub, art.efi, sections...); err != nil {
		return fmt.Errorf("assembling the UKI: %w", err)
	}
	fi, err := os.Stat(art.efi)
	if err != nil {
		return err
	}
	ui.Say(fmt.Sprintf("Assembled the UKI %s: %s in %.2fs", art.efi, mib(fi.Size()), time.Since(start).Seconds()))

	start = time.Now()
	layout, err := newLayout(fi.Size(), r.partition, c.diskSize)
	if err != nil {
		return err
	}
	if err := makeDisk(ctx, art.raw, art.efi, layout); err != nil {
		return fmt.Errorf("making the disk: %w", err)
	}
	what := "the UKI at EFI/BOOT/BOOTX64.EFI on its EFI system partition"
	if r.partition != nil {
		what += ", the verified root on the second partition"
	}
	ui.Say(fmt.Sprintf("Made the disk %s: %s, %s, in %.2fs", art.raw, mib(layout.size), what, time.Since(start).Seconds()))
	return nil
}

// fileEntries are initrd_files as archive entries.
func (b *Builder) fileEntries() ([]ukiimage.Entry, error) {
	var entries []ukiimage.Entry
	for i, f := range b.config.InitrdFiles {
		data, err := os.ReadFile(f.Source)
		if err != nil {
			return nil, fmt.Errorf("initrd_files[%d]: %w", i, err)
		}
		entries = append(entries, ukiimage.Entry{Path: f.Destination, Mode: b.config.modes[i], Data: data})
	}
	return entries, nil
}

// fromRoot is what the build takes from the provisioned root: the archive entries of the initrd, or with
// verified_root the root's kernel and initrd and its partition.
type fromRoot struct {
	entries        []ukiimage.Entry
	kernel, initrd []byte
	partition      *rootPartition
}

// root provisions a copy of root_directory at dir and returns what the build takes from it, the verified
// root's partition written to image; dir is removed afterwards.
func (b *Builder) root(ctx context.Context, ui packersdk.Ui, hook packersdk.Hook, dir, image string) (fromRoot, error) {
	defer os.RemoveAll(dir)
	if err := b.provisionRoot(ctx, ui, hook, dir); err != nil {
		return fromRoot{}, err
	}
	if !b.config.VerifiedRoot {
		entries, err := ukiimage.TreeEntries(dir)
		return fromRoot{entries: entries}, err
	}
	kernel, initrd, err := prepareVerifiedRoot(ctx, ui, dir)
	if err != nil {
		return fromRoot{}, err
	}
	p, err := sealRoot(ctx, ui, dir, image)
	if err != nil {
		os.Remove(image)
		return fromRoot{}, err
	}
	return fromRoot{kernel: kernel, initrd: initrd, partition: p}, nil
}

// provisionRoot copies root_directory to dir, writes initrd_files into it and runs the provisioners in a
// chroot of it.
func (b *Builder) provisionRoot(ctx context.Context, ui packersdk.Ui, hook packersdk.Hook, dir string) error {
	c := &b.config
	start := time.Now()
	// cp -a keeps links, modes and owners, which provisioners in the chroot may depend on.
	if out, err := exec.CommandContext(ctx, "cp", "-a", "--", filepath.Clean(c.RootDirectory)+"/.", dir).CombinedOutput(); err != nil {
		return fmt.Errorf("copying root_directory %s: %v: %s", c.RootDirectory, err, bytes.TrimSpace(out))
	}
	for i, f := range c.InitrdFiles {
		if err := writeInto(dir, f.Source, f.Destination, b.config.modes[i]); err != nil {
			return fmt.Errorf("initrd_files[%d]: %w", i, err)
		}
	}
	ui.Say(fmt.Sprintf("Copied root_directory %s and %d initrd_files in %.2fs; provisioning in a chroot of the copy",
		c.RootDirectory, len(c.InitrdFiles), time.Since(start).Seconds()))
	return hook.Run(ctx, packersdk.HookProvision, ui, &chroot.Communicator{Root: dir}, nil)
}

// writeInto copies the file src to dest in the tree at dir, making the directories on the way (0755) and
// replacing what is there unless it is a directory. No link in the tree leads the write outside it.
func writeInto(dir, src, dest string, mode fs.FileMode) error {
	data, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return err
	}
	defer root.Close()
	name := strings.TrimPrefix(dest, "/")
	if err := root.MkdirAll(filepath.Dir(name), 0o755); err != nil {
		return err
	}
	if fi, err := root.Lstat(name); err == nil && fi.IsDir() {
		return fmt.Errorf("destination %s is a directory in root_directory", dest)
	}
	if err := root.Remove(name); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if err := root.WriteFile(name, data, mode); err != nil {
		return err
	}
	// WriteFile's mode passes through the umask; the image gets exactly the mode asked for.
	return root.Chmod(name, mode)
}

// initrd is the archive of entries followed by the appended files; nothing if neither is configured.
func (b *Builder) initrd(entries []ukiimage.Entry) ([]byte, error) {
	var initrd []byte
	if len(entries) > 0 {
		var err error
		if initrd, err = ukiimage.Cpio(entries...); err != nil {
			return nil, fmt.Errorf("making the initrd: %w", err)
		}
	}
	// The kernel reads concatenated archives in order and stops at a compressed one's end, so the
	// uncompressed archive goes first and compressed initrds after it.
	for i, f := range b.config.InitrdAppend {
		data, err := os.ReadFile(f)
		if err != nil {
			return nil, fmt.Errorf("initrd_append[%d]: %w", i, err)
		}
		initrd = append(initrd, data...)
	}
	return initrd, nil
}

func mib(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }
