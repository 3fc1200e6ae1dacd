//go:generate packer-sdc mapstructure-to-hcl2 -type Config,InitrdFile

// Package uki is the builder berth-uki: it makes a measured image from local files alone, with no network
// and no machine to provision: a unified kernel image (UKI: systemd-stub with the kernel, an initrd, the
// command line and os-release) and a raw UEFI disk whose EFI system partition boots that UKI from the
// removable-media path. Every byte the boot measures comes from the template's inputs, so berth-manifest's
// prediction of the UKI is the whole story of PCR 4, 9, 11 and 12.
package uki

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/hcl/v2/hcldec"
	"github.com/hashicorp/packer-plugin-sdk/common"
	packersdk "github.com/hashicorp/packer-plugin-sdk/packer"
	"github.com/hashicorp/packer-plugin-sdk/template/config"
	"github.com/hashicorp/packer-plugin-sdk/template/interpolate"

	ukiimage "github.com/berthlabs/berth/internal/uki"
)

// BuilderID identifies the builder's artifacts.
const BuilderID = "berthlabs.uki"

// Defaults of the options that have one.
const (
	DefaultName      = "berth"
	DefaultOSRelease = "ID=berth\nNAME=Berth\n"
	DefaultMode      = "0755"
	// DefaultDiskSize is the disk's size unless the UKI needs more.
	DefaultDiskSize = 64 << 20
)

// Config is the builder's configuration.
type Config struct {
	common.PackerConfig `mapstructure:",squash"`

	// systemd-stub, such as `/usr/lib/systemd/boot/efi/linuxx64.efi.stub` from systemd-boot-efi.
	Stub string `mapstructure:"stub" required:"true"`
	// The kernel (vmlinuz) the UKI boots.
	Kernel string `mapstructure:"kernel" required:"true"`
	// The kernel command line, embedded in the UKI and so measured.
	Cmdline string `mapstructure:"cmdline" required:"true"`
	// Content of the UKI's .osrel section. Defaults to `ID=berth` and `NAME=Berth`.
	OSRelease string `mapstructure:"os_release"`
	// A directory tree that becomes the initrd's root file system, such as one made by
	// `mmdebstrap --variant=extract`. The build copies it, writes initrd_files into the copy, runs the
	// template's provisioners in a chroot of the copy (chroot needs root: run packer build as root), then
	// archives the copy as the start of the initrd. Without it, provisioners have no machine to reach.
	RootDirectory string `mapstructure:"root_directory"`
	// Files put in an uncompressed cpio archive, the start of the initrd; with root_directory, they are
	// written into its copy, replacing files of the same path.
	InitrdFiles []InitrdFile `mapstructure:"initrd_files"`
	// Existing initrd files, such as Debian's zstd initrd, appended after the generated archive.
	InitrdAppend []string `mapstructure:"initrd_append"`
	// Directory the UKI and the disk go to; it must not exist unless packer build runs with -force.
	// Defaults to `output-<build name>`.
	OutputDirectory string `mapstructure:"output_directory"`
	// Name of the outputs: `<name>.efi` and `<name>.raw`. Defaults to `berth`.
	Name string `mapstructure:"name"`
	// Size of the raw disk: a number of MiB, or a number with K, M, G or T. Defaults to 64 MiB, or what
	// the UKI needs if that is more.
	DiskSize string `mapstructure:"disk_size"`

	ctx interpolate.Context
}

// InitrdFile is a file of the generated initrd archive.
type InitrdFile struct {
	// The local file.
	Source string `mapstructure:"source" required:"true"`
	// Absolute path in the initrd, such as `/init`.
	Destination string `mapstructure:"destination" required:"true"`
	// Octal mode in the initrd. Defaults to `0755`.
	Mode string `mapstructure:"mode"`
}

// Builder is berth-uki.
type Builder struct {
	config   Config
	diskSize int64 // bytes; 0 for the default
	modes    []fs.FileMode
}

var namePattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]*$`)

// tools are the programs the build runs, with the Debian package that has each.
var tools = [][2]string{
	{"objcopy", "binutils"},
	{"sfdisk", "fdisk"},
	{"mkfs.vfat", "dosfstools"},
	{"mmd", "mtools"},
	{"mcopy", "mtools"},
}

func (b *Builder) ConfigSpec() hcldec.ObjectSpec { return b.config.FlatMapstructure().HCL2Spec() }

func (b *Builder) Prepare(raws ...any) ([]string, []string, error) {
	err := config.Decode(&b.config, &config.DecodeOpts{
		PluginType:         "berth-uki",
		Interpolate:        true,
		InterpolateContext: &b.config.ctx,
	}, raws...)
	if err != nil {
		return nil, nil, err
	}
	c := &b.config
	c.OSRelease = cmp.Or(c.OSRelease, DefaultOSRelease)
	c.Name = cmp.Or(c.Name, DefaultName)
	c.OutputDirectory = cmp.Or(c.OutputDirectory, "output-"+c.PackerBuildName)

	var errs []error
	for _, f := range []struct{ option, path string }{{"stub", c.Stub}, {"kernel", c.Kernel}} {
		if f.path == "" {
			errs = append(errs, fmt.Errorf("%s is required", f.option))
		} else if err := regularFile(f.path); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", f.option, err))
		}
	}
	if strings.TrimSpace(c.Cmdline) == "" {
		errs = append(errs, errors.New("cmdline is required: the kernel command line the UKI embeds, such as console=ttyS0"))
	}
	if !namePattern.MatchString(c.Name) {
		errs = append(errs, fmt.Errorf("name %q: want letters, digits, '.', '_' and '-', starting with a letter or digit", c.Name))
	}
	b.modes = make([]fs.FileMode, len(c.InitrdFiles))
	dests := map[string]int{}
	for i, f := range c.InitrdFiles {
		opt := fmt.Sprintf("initrd_files[%d]", i)
		if f.Source == "" {
			errs = append(errs, fmt.Errorf("%s: source is required", opt))
		} else if err := regularFile(f.Source); err != nil {
			errs = append(errs, fmt.Errorf("%s: source: %w", opt, err))
		}
		switch {
		case !strings.HasPrefix(f.Destination, "/") || filepath.Clean(f.Destination) != f.Destination || f.Destination == "/":
			errs = append(errs, fmt.Errorf("%s: destination %q: want a clean absolute path of a file, such as /init", opt, f.Destination))
		default:
			if j, ok := dests[f.Destination]; ok {
				errs = append(errs, fmt.Errorf("%s: destination %s is also initrd_files[%d]'s", opt, f.Destination, j))
			}
			dests[f.Destination] = i
		}
		mode, err := strconv.ParseUint(cmp.Or(f.Mode, DefaultMode), 8, 32)
		if err != nil || mode > 0o777 {
			errs = append(errs, fmt.Errorf("%s: mode %q: want octal permission bits such as 0755", opt, f.Mode))
		}
		b.modes[i] = fs.FileMode(mode)
	}
	if c.RootDirectory != "" {
		if fi, err := os.Stat(c.RootDirectory); err != nil {
			errs = append(errs, fmt.Errorf("root_directory: %w", err))
		} else if !fi.IsDir() {
			errs = append(errs, fmt.Errorf("root_directory: %s is not a directory", c.RootDirectory))
		}
	}
	for i, f := range c.InitrdAppend {
		if err := regularFile(f); err != nil {
			errs = append(errs, fmt.Errorf("initrd_append[%d]: %w", i, err))
		}
	}
	if c.DiskSize != "" {
		if b.diskSize, err = parseSize(c.DiskSize); err != nil {
			errs = append(errs, fmt.Errorf("disk_size: %w", err))
		}
	}
	if d := filepath.Clean(c.OutputDirectory); d == "." || d == ".." || d == "/" {
		// -force removes the output directory first: never the working directory or the root.
		errs = append(errs, fmt.Errorf("output_directory %q: want a directory of its own for the outputs", c.OutputDirectory))
	} else if _, err := os.Stat(c.OutputDirectory); err == nil && !c.PackerForce {
		errs = append(errs, fmt.Errorf("output_directory %s exists: remove it, or run packer build -force to replace it", c.OutputDirectory))
	}
	for _, t := range tools {
		if _, err := lookTool(t[0]); err != nil {
			errs = append(errs, fmt.Errorf("%s not found: install Debian's %s (make deps)", t[0], t[1]))
		}
	}
	return nil, nil, errors.Join(errs...)
}

func regularFile(path string) error {
	fi, err := os.Stat(path)
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("%s is not a regular file", path)
	}
	return nil
}

// parseSize reads a size such as 64, 64M or 1G; a plain number is MiB, as for Packer's qemu builder.
func parseSize(s string) (int64, error) {
	num, unit := s, int64(1<<20)
	for i, suffix := range []string{"K", "M", "G", "T"} {
		if n, ok := strings.CutSuffix(strings.ToUpper(s), suffix); ok {
			num, unit = n, 1<<(10*(i+1))
			break
		}
	}
	n, err := strconv.ParseInt(num, 10, 64)
	if err != nil || n <= 0 || n > (1<<50)/unit {
		return 0, fmt.Errorf("%q: want a positive size such as 64M or 1G", s)
	}
	return n * unit, nil
}

// lookTool finds a tool also in the sbin directories, which a user's PATH often lacks.
func lookTool(name string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	for _, dir := range []string{"/usr/sbin", "/sbin"} {
		p := filepath.Join(dir, name)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s not found", name)
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
	var entries []ukiimage.Entry
	var err error
	if c.RootDirectory != "" {
		if entries, err = b.provisionRoot(ctx, ui, hook, filepath.Join(c.OutputDirectory, "root")); err != nil {
			return err
		}
	} else {
		// Packer runs provisioners only through the hook: with no root to provision, they get no
		// communicator, and berth-agent says so.
		if err := hook.Run(ctx, packersdk.HookProvision, ui, nil, nil); err != nil {
			return err
		}
		if entries, err = b.fileEntries(); err != nil {
			return err
		}
	}
	start := time.Now()
	initrd, err := b.initrd(entries)
	if err != nil {
		return err
	}
	if len(initrd) > 0 {
		what := fmt.Sprintf("initrd_files (%d)", len(c.InitrdFiles))
		if c.RootDirectory != "" {
			what = fmt.Sprintf("the provisioned root (%d entries)", len(entries))
		}
		ui.Say(fmt.Sprintf("Made the initrd: a cpio archive of %s and initrd_append (%d), %s in %.2fs",
			what, len(c.InitrdAppend), mib(int64(len(initrd))), time.Since(start).Seconds()))
	}

	start = time.Now()
	kernel, err := os.ReadFile(c.Kernel)
	if err != nil {
		return fmt.Errorf("reading the kernel: %w", err)
	}
	sections := []ukiimage.Section{
		{Name: ".osrel", Data: []byte(c.OSRelease)},
		{Name: ".cmdline", Data: []byte(c.Cmdline)},
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
	diskSize := b.diskSize
	if diskSize == 0 {
		diskSize = max(DefaultDiskSize, minDiskSize(fi.Size()))
	}
	if err := makeDisk(ctx, art.raw, art.efi, diskSize); err != nil {
		return fmt.Errorf("making the disk: %w", err)
	}
	ui.Say(fmt.Sprintf("Made the disk %s: %s, the UKI at EFI/BOOT/BOOTX64.EFI on its EFI system partition, in %.2fs",
		art.raw, mib(diskSize), time.Since(start).Seconds()))
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
		entries = append(entries, ukiimage.Entry{Path: f.Destination, Mode: b.modes[i], Data: data})
	}
	return entries, nil
}

// provisionRoot copies root_directory to dir, writes initrd_files into it, runs the provisioners in a
// chroot of it and returns it as archive entries; dir is removed afterwards.
func (b *Builder) provisionRoot(ctx context.Context, ui packersdk.Ui, hook packersdk.Hook, dir string) ([]ukiimage.Entry, error) {
	c := &b.config
	start := time.Now()
	// cp -a keeps links, modes and owners, which provisioners in the chroot may depend on.
	if out, err := exec.CommandContext(ctx, "cp", "-a", "--", filepath.Clean(c.RootDirectory)+"/.", dir).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("copying root_directory %s: %v: %s", c.RootDirectory, err, bytes.TrimSpace(out))
	}
	defer os.RemoveAll(dir)
	for i, f := range c.InitrdFiles {
		if err := writeInto(dir, f.Source, f.Destination, b.modes[i]); err != nil {
			return nil, fmt.Errorf("initrd_files[%d]: %w", i, err)
		}
	}
	ui.Say(fmt.Sprintf("Copied root_directory %s and %d initrd_files in %.2fs; provisioning in a chroot of the copy",
		c.RootDirectory, len(c.InitrdFiles), time.Since(start).Seconds()))
	if err := hook.Run(ctx, packersdk.HookProvision, ui, &chrootCommunicator{root: dir}, nil); err != nil {
		return nil, err
	}
	return ukiimage.TreeEntries(dir)
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

// Artifact is the UKI and the disk that boots it.
type Artifact struct {
	dir, efi, raw string
}

func (a *Artifact) BuilderId() string { return BuilderID }

// Files lists the disk first: it is what a machine is launched from.
func (a *Artifact) Files() []string { return []string{a.raw, a.efi} }

// Id is the disk image's path.
func (a *Artifact) Id() string { return a.raw }

func (a *Artifact) String() string {
	return fmt.Sprintf("disk image %s booting the unified kernel image %s", a.raw, a.efi)
}

func (a *Artifact) State(string) any { return nil }

func (a *Artifact) Destroy() error { return os.RemoveAll(a.dir) }
