//go:generate packer-sdc mapstructure-to-hcl2 -type Config,InitrdFile

package uki

import (
	"cmp"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/hashicorp/packer-plugin-sdk/common"
	"github.com/hashicorp/packer-plugin-sdk/template/config"
	"github.com/hashicorp/packer-plugin-sdk/template/interpolate"
)

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
	// The kernel (vmlinuz) the UKI boots. Required, unless verified_root boots the root's own.
	Kernel string `mapstructure:"kernel"`
	// The kernel command line, embedded in the UKI and so measured.
	Cmdline string `mapstructure:"cmdline" required:"true"`
	// Content of the UKI's .osrel section. Defaults to `ID=berth` and `NAME=Berth`.
	OSRelease string `mapstructure:"os_release"`
	// A directory tree that becomes the initrd's root file system, such as one made by
	// `mmdebstrap --variant=extract`. The build copies it, writes initrd_files into the copy, runs the
	// template's provisioners in a chroot of the copy (chroot needs root: run packer build as root), then
	// archives the copy as the start of the initrd. Without it, provisioners have no machine to reach.
	RootDirectory string `mapstructure:"root_directory"`
	// Makes the provisioned root_directory the image's root file system, read-only and verified, instead
	// of the initrd: the raw disk gets a second partition with the root as erofs (lz4) followed by its
	// dm-verity hash tree, and the UKI's command line carries the root hash, so that PCR 9 and 11 change
	// with any byte of the root. After the provisioners, the build teaches the root's initramfs-tools to
	// open it (packer/internal/verity) and rebuilds its initrd; the UKI boots the root's own kernel
	// (`/vmlinuz`) and initrd (`/initrd.img`), so root_directory needs a Debian kernel package,
	// initramfs-tools and cryptsetup-bin (veritysetup), and kernel and initrd_append are left out. This
	// machine needs mkfs.erofs (erofs-utils) and veritysetup (cryptsetup-bin).
	VerifiedRoot bool `mapstructure:"verified_root"`
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

	// Derived by Prepare.
	diskSize int64 // bytes; 0 for the default
	modes    []fs.FileMode
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

var namePattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]*$`)

// tools are the programs the build runs, with the Debian package that has each.
var tools = [][2]string{
	{"objcopy", "binutils"},
	{"sfdisk", "fdisk"},
	{"mkfs.vfat", "dosfstools"},
	{"mmd", "mtools"},
	{"mcopy", "mtools"},
}

// verityTools are what verified_root runs besides tools.
var verityTools = [][2]string{
	{"mkfs.erofs", "erofs-utils"},
	{"veritysetup", "cryptsetup-bin"},
}

// Prepare decodes and checks the configuration, naming every problem at once, and keeps what it derives
// (modes, disk size) for the build.
func (c *Config) Prepare(raws ...any) error {
	err := config.Decode(c, &config.DecodeOpts{
		PluginType:         "berth-uki",
		Interpolate:        true,
		InterpolateContext: &c.ctx,
	}, raws...)
	if err != nil {
		return err
	}
	c.OSRelease = cmp.Or(c.OSRelease, DefaultOSRelease)
	c.Name = cmp.Or(c.Name, DefaultName)
	c.OutputDirectory = cmp.Or(c.OutputDirectory, "output-"+c.PackerBuildName)

	var errs []error
	files := []struct{ option, path string }{{"stub", c.Stub}}
	switch {
	case !c.VerifiedRoot:
		files = append(files, struct{ option, path string }{"kernel", c.Kernel})
	case c.Kernel != "":
		errs = append(errs, errors.New("kernel: verified_root boots the root's own kernel (/vmlinuz), whose modules and initrd the root has: leave kernel out"))
	}
	for _, f := range files {
		if f.path == "" {
			errs = append(errs, fmt.Errorf("%s is required", f.option))
		} else if err := regularFile(f.path); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", f.option, err))
		}
	}
	if c.VerifiedRoot {
		if c.RootDirectory == "" {
			errs = append(errs, errors.New("verified_root needs root_directory: the root file system it makes verified"))
		}
		if len(c.InitrdAppend) > 0 {
			errs = append(errs, errors.New("initrd_append: verified_root boots the root's own initrd, rebuilt to open the verified root: leave initrd_append out"))
		}
	}
	if strings.TrimSpace(c.Cmdline) == "" {
		errs = append(errs, errors.New("cmdline is required: the kernel command line the UKI embeds, such as console=ttyS0"))
	}
	if !namePattern.MatchString(c.Name) {
		errs = append(errs, fmt.Errorf("name %q: want letters, digits, '.', '_' and '-', starting with a letter or digit", c.Name))
	}
	c.modes = make([]fs.FileMode, len(c.InitrdFiles))
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
		c.modes[i] = fs.FileMode(mode)
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
		if c.diskSize, err = parseSize(c.DiskSize); err != nil {
			errs = append(errs, fmt.Errorf("disk_size: %w", err))
		}
	}
	if d := filepath.Clean(c.OutputDirectory); d == "." || d == ".." || d == "/" {
		// -force removes the output directory first: never the working directory or the root.
		errs = append(errs, fmt.Errorf("output_directory %q: want a directory of its own for the outputs", c.OutputDirectory))
	} else if _, err := os.Stat(c.OutputDirectory); err == nil && !c.PackerForce {
		errs = append(errs, fmt.Errorf("output_directory %s exists: remove it, or run packer build -force to replace it", c.OutputDirectory))
	}
	need := tools
	if c.VerifiedRoot {
		need = slices.Concat(tools, verityTools)
	}
	for _, t := range need {
		if _, err := lookTool(t[0]); err != nil {
			errs = append(errs, fmt.Errorf("%s not found: install Debian's %s (make deps)", t[0], t[1]))
		}
	}
	return errors.Join(errs...)
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
