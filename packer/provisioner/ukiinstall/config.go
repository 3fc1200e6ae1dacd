//go:generate packer-sdc mapstructure-to-hcl2 -type Config,VerifiedRoot

package ukiinstall

import (
	"cmp"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"unicode"

	"github.com/berthlabs/berth/packer/internal/remote"
	"github.com/hashicorp/packer-plugin-sdk/common"
	"github.com/hashicorp/packer-plugin-sdk/template/config"
	"github.com/hashicorp/packer-plugin-sdk/template/interpolate"
)

// Defaults of the options that have one. The kernel and initrd are the links Debian's linux-base keeps to
// the newest installed kernel: in / unless /etc/kernel-img.conf says link_in_boot = yes.
const (
	DefaultKernel           = "/vmlinuz"
	DefaultInitrd           = "/initrd.img"
	DefaultOSRelease        = "/etc/os-release"
	DefaultESP              = "/boot/efi"
	DefaultOutput           = "berth.efi"
	DefaultStagingDirectory = "/tmp/berth-uki-install"
	DefaultExecuteCommand   = "sh '{{.Path}}'"
)

// Config is the provisioner's configuration.
type Config struct {
	common.PackerConfig `mapstructure:",squash"`

	// systemd-stub on the machine Packer runs on, such as `/usr/lib/systemd/boot/efi/linuxx64.efi.stub`
	// from Debian 12's systemd-boot-efi: the stub whose measurements berth-manifest predicts.
	Stub string `mapstructure:"stub" required:"true"`
	// The kernel on the machine being provisioned. Defaults to `/vmlinuz`; links are followed there.
	Kernel string `mapstructure:"kernel"`
	// The initrd on the machine being provisioned. Defaults to `/initrd.img`; links are followed there.
	Initrd string `mapstructure:"initrd"`
	// The os-release file on the machine being provisioned, the UKI's .osrel section. Defaults to
	// `/etc/os-release`.
	OSRelease string `mapstructure:"os_release"`
	// The kernel command line embedded in the UKI. Defaults to the machine's own (`/proc/cmdline`) without
	// the items `BOOT_IMAGE=` and `initrd=` its boot loader added.
	Cmdline string `mapstructure:"cmdline"`
	// Mount point of the EFI system partition on the machine being provisioned; the UKI goes to
	// `EFI/BOOT/BOOTX64.EFI` in it. Defaults to `/boot/efi`.
	ESP string `mapstructure:"esp"`
	// Where the UKI is written on the machine Packer runs on, for berth-manifest's `uki`. Defaults to
	// `berth.efi`.
	Output string `mapstructure:"output"`
	// Directory on the machine being provisioned where the files wait; removed afterwards. Defaults to
	// `/tmp/berth-uki-install`.
	StagingDirectory string `mapstructure:"staging_directory"`
	// Makes the image's root file system read-only and verified: the machine's root becomes an erofs file
	// system under dm-verity on a disk of its own, whose root hash the UKI's command line carries, so that
	// PCR 11 and 12 change with any byte of it. Without it, the UKI is installed on the machine's own ESP
	// and its root stays a writable file system that the initrd mounts unmeasured.
	VerifiedRoot *VerifiedRoot `mapstructure:"verified_root"`
	// Command that runs the provisioner's scripts, whose path is `{{.Path}}`. Defaults to `sh '{{.Path}}'`;
	// use `sudo -n sh '{{.Path}}'` where the communicator does not log in as root.
	ExecuteCommand string `mapstructure:"execute_command"`

	ctx interpolate.Context
}

// VerifiedRoot is where the image with a verified root goes. The build machine needs veritysetup
// (cryptsetup-bin), mkfs.erofs (erofs-utils), mkfs.vfat (dosfstools), sfdisk and initramfs-tools.
type VerifiedRoot struct {
	// The disk that becomes the image, attached to the build machine beside the one it runs from (the
	// qemu builder's disk_additional_size, amazon-ebssurrogate's launch_block_device_mappings): its
	// contents are replaced by a GPT with an EFI system partition holding the UKI and a partition with the
	// root file system (erofs, lz4) followed by its dm-verity hash tree. It must hold the root file system
	// compressed, about 1 % more, and 64 MiB. A link made by a udev rule that this build installed (such as
	// /dev/disk/by-ebs-name/sdf) works too: udev applies its rules again when the device is missing.
	Device string `mapstructure:"device" required:"true"`
}

// Prepare decodes and checks the configuration, naming every problem at once.
func (c *Config) Prepare(raws ...any) error {
	err := config.Decode(c, &config.DecodeOpts{
		PluginType:         "berth-uki-install",
		Interpolate:        true,
		InterpolateContext: &c.ctx,
		// Rendered in Provision, for each script's path.
		InterpolateFilter: &interpolate.RenderFilter{Exclude: []string{"execute_command"}},
	}, raws...)
	if err != nil {
		return err
	}
	c.Kernel = cmp.Or(c.Kernel, DefaultKernel)
	c.Initrd = cmp.Or(c.Initrd, DefaultInitrd)
	c.OSRelease = cmp.Or(c.OSRelease, DefaultOSRelease)
	c.ESP = cmp.Or(c.ESP, DefaultESP)
	c.Output = cmp.Or(c.Output, DefaultOutput)
	c.StagingDirectory = cmp.Or(c.StagingDirectory, DefaultStagingDirectory)
	c.ExecuteCommand = cmp.Or(c.ExecuteCommand, DefaultExecuteCommand)

	var errs []error
	if c.Stub == "" {
		errs = append(errs, errors.New("stub is required: systemd-stub on this machine, such as /usr/lib/systemd/boot/efi/linuxx64.efi.stub"))
	} else if fi, err := os.Stat(c.Stub); err != nil {
		errs = append(errs, fmt.Errorf("stub: %w", err))
	} else if !fi.Mode().IsRegular() {
		errs = append(errs, fmt.Errorf("stub: %s is not a regular file", c.Stub))
	}
	for _, o := range []struct{ name, value string }{
		{"kernel", c.Kernel}, {"initrd", c.Initrd}, {"os_release", c.OSRelease}, {"esp", c.ESP},
	} {
		if err := remote.CheckAbsolute(o.value); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", o.name, err))
		}
	}
	if c.ESP == "/" {
		errs = append(errs, errors.New("esp: / is not the mount point of an EFI system partition"))
	}
	if c.VerifiedRoot != nil {
		if err := remote.CheckAbsolute(c.VerifiedRoot.Device); err != nil {
			errs = append(errs, fmt.Errorf("verified_root.device: %w", err))
		} else if !strings.HasPrefix(c.VerifiedRoot.Device, "/dev/") {
			errs = append(errs, fmt.Errorf("verified_root.device: %s is not a device: want the disk that becomes the image, such as /dev/vdb", c.VerifiedRoot.Device))
		}
	}
	if err := remote.CheckStaging(c.StagingDirectory); err != nil {
		errs = append(errs, fmt.Errorf("staging_directory: %w", err))
	}
	if c.Cmdline != "" {
		if err := checkCmdline(c.Cmdline); err != nil {
			errs = append(errs, fmt.Errorf("cmdline: %w", err))
		}
	}
	if fi, err := os.Stat(c.Output); err == nil && fi.IsDir() {
		errs = append(errs, fmt.Errorf("output: %s is a directory: name the UKI file, such as %s", c.Output, filepath.Join(c.Output, DefaultOutput)))
	}
	for _, name := range []string{collectScript, installScript, prepareScript, sealScript} {
		if _, err := c.executeCommand(name); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// bootLoaderItems are the command-line items a boot loader adds that mean nothing to a UKI: GRUB's
// BOOT_IMAGE names the kernel file it loaded, and initrd= would make the kernel's EFI stub load another
// initrd from the ESP, which the prediction does not model.
var bootLoaderItems = []string{"BOOT_IMAGE=", "initrd="}

// ownCmdline is the machine's /proc/cmdline without the items its boot loader added, its items joined by
// single spaces.
func ownCmdline(proc string) (string, error) {
	var kept []string
	for _, item := range strings.Fields(proc) {
		if !slices.ContainsFunc(bootLoaderItems, func(p string) bool { return strings.HasPrefix(item, p) }) {
			kept = append(kept, item)
		}
	}
	line := strings.Join(kept, " ")
	if err := checkCmdline(line); err != nil {
		return "", fmt.Errorf("the machine's /proc/cmdline %q: %w", strings.TrimSpace(proc), err)
	}
	return line, nil
}

// checkCmdline refuses what systemd-stub would not hand the kernel as it is, so that the predicted PCR 9
// is the measured one.
func checkCmdline(line string) error {
	switch {
	case strings.TrimSpace(line) == "":
		return errors.New("is empty: the kernel would get no root=")
	case strings.IndexFunc(line, func(r rune) bool { return r > unicode.MaxASCII || unicode.IsControl(r) }) >= 0:
		return errors.New("has a non-ASCII or control character: systemd-stub would change it before the kernel measures it")
	}
	for _, item := range strings.Fields(line) {
		if strings.HasPrefix(item, "initrd=") {
			return fmt.Errorf("has %s: the kernel would load an initrd from the ESP, outside the UKI and its prediction", item)
		}
	}
	return nil
}

// executeCommand is execute_command with the path of the script called name.
func (c *Config) executeCommand(name string) (string, error) {
	return remote.ExecuteCommand(&c.ctx, c.ExecuteCommand, path.Join(c.StagingDirectory, name))
}
