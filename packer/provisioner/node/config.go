//go:generate packer-sdc mapstructure-to-hcl2 -type Config,Archive

package node

import (
	"cmp"
	"errors"
	"fmt"
	"path"
	"regexp"
	"strings"

	"github.com/berthlabs/berth/packer/internal/remote"
	"github.com/hashicorp/packer-plugin-sdk/common"
	"github.com/hashicorp/packer-plugin-sdk/template/config"
	"github.com/hashicorp/packer-plugin-sdk/template/interpolate"
)

// Defaults of the options that have one.
const (
	// DefaultPauseImage is the pause image of the Kubernetes release Berth builds (kubeadm's PauseVersion).
	DefaultPauseImage       = "registry.k8s.io/pause:3.10.2"
	DefaultCNIBinDir        = "/opt/cni/bin"
	DefaultStagingDirectory = "/tmp/berth-node"
	DefaultExecuteCommand   = "sh '{{.Path}}'"
)

// DefaultPackages are Debian's packages of what kubeadm join and a pod network need on a node: the container
// runtime, the CNI plugins, and the tools kubeadm's preflight checks and kube-proxy run; and cryptsetup, with
// which the agent opens its state disk.
var DefaultPackages = []string{
	"containerd", "runc", "containernetworking-plugins", "conntrack", "socat", "ethtool", "iptables", "kmod",
	"ca-certificates", "cryptsetup-bin",
}

// Config is the provisioner's configuration.
type Config struct {
	common.PackerConfig `mapstructure:",squash"`

	// Debian packages the image must have, installed with apt-get where missing. Defaults to
	// DefaultPackages; an image whose base has none of them starts with a network path to its archive.
	Packages []string `mapstructure:"packages"`
	// Whether to install missing packages. Defaults to true; false installs nothing, for images whose root
	// comes with what a node needs, and the build is then refused if anything is missing.
	InstallPackages *bool `mapstructure:"install_packages"`
	// The pause image containerd runs pods' sandboxes from. Defaults to kubeadm's.
	PauseImage string `mapstructure:"pause_image"`
	// Container images pulled at build time by the image's own containerd (so only where it runs: an SSH
	// build) and kept in the image. Defaults to the pause image; [] pulls none.
	Images []string `mapstructure:"images"`
	// Container image archives (docker or OCI tar files, as `ctr images export` or `skopeo copy` write them)
	// kept in the image, each pinned by its SHA-256.
	ImageArchives []Archive `mapstructure:"image_archives"`
	// containerd's configuration instead of the one the provisioner writes (the systemd cgroup driver, the
	// pause image, cni_bin_dir).
	ContainerdConfig string `mapstructure:"containerd_config"`
	// Where containerd finds CNI plugins, the pod network's own among them. Defaults to /opt/cni/bin; the
	// distribution's plugins are linked into it.
	CNIBinDir string `mapstructure:"cni_bin_dir"`
	// Whether to remove what must differ between instances (machine-id, SSH host keys, cloud-init's state,
	// apt's lists, logs) at the end. Defaults to true.
	Generalize *bool `mapstructure:"generalize"`
	// Directory on the machine being built where files wait to be installed; removed afterwards.
	// Defaults to `/tmp/berth-node`.
	StagingDirectory string `mapstructure:"staging_directory"`
	// Command that runs the script, whose path is `{{.Path}}`. Defaults to `sh '{{.Path}}'`; use
	// `sudo -n sh '{{.Path}}'` where the communicator does not log in as root.
	ExecuteCommand string `mapstructure:"execute_command"`

	ctx interpolate.Context
}

// Archive is a container image archive to keep in the image.
type Archive struct {
	// The local file.
	Source string `mapstructure:"source" required:"true"`
	// SHA-256 of the file, 64 lowercase hex digits.
	SHA256 string `mapstructure:"sha256" required:"true"`
}

// debianPackage is a Debian package name (Debian policy 5.6.1), optionally with an architecture.
var debianPackage = regexp.MustCompile(`^[a-z0-9][a-z0-9+.-]+(:[a-z0-9-]+)?$`)

// imageReference is what an image reference may hold: the script quotes it, but a reference with other
// characters is a mistake the build should name now, not containerd later.
var imageReference = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._/:@-]*$`)

// Prepare decodes and checks the configuration, naming every problem at once.
func (c *Config) Prepare(raws ...any) error {
	err := config.Decode(c, &config.DecodeOpts{
		PluginType:         "berth-node",
		Interpolate:        true,
		InterpolateContext: &c.ctx,
		// Rendered in Provision, when the script's path is known.
		InterpolateFilter: &interpolate.RenderFilter{Exclude: []string{"execute_command"}},
	}, raws...)
	if err != nil {
		return err
	}
	if c.Packages == nil {
		c.Packages = DefaultPackages
	}
	if c.InstallPackages == nil {
		c.InstallPackages = new(bool)
		*c.InstallPackages = true
	}
	if c.Generalize == nil {
		c.Generalize = new(bool)
		*c.Generalize = true
	}
	c.PauseImage = cmp.Or(c.PauseImage, DefaultPauseImage)
	if c.Images == nil {
		c.Images = []string{c.PauseImage}
	}
	c.CNIBinDir = cmp.Or(c.CNIBinDir, DefaultCNIBinDir)
	c.StagingDirectory = cmp.Or(c.StagingDirectory, DefaultStagingDirectory)
	c.ExecuteCommand = cmp.Or(c.ExecuteCommand, DefaultExecuteCommand)

	var errs []error
	for i, p := range c.Packages {
		if !debianPackage.MatchString(p) {
			errs = append(errs, fmt.Errorf("packages[%d]: %q is not a Debian package name", i, p))
		}
	}
	if !imageReference.MatchString(c.PauseImage) {
		errs = append(errs, fmt.Errorf("pause_image: %q is not an image reference such as %s", c.PauseImage, DefaultPauseImage))
	}
	for i, ref := range c.Images {
		if !imageReference.MatchString(ref) {
			errs = append(errs, fmt.Errorf("images[%d]: %q is not an image reference such as %s", i, ref, DefaultPauseImage))
		}
	}
	for i, a := range c.ImageArchives {
		if a.Source == "" {
			errs = append(errs, fmt.Errorf("image_archives[%d]: source is required", i))
		} else if err := remote.CheckSource(a.Source); err != nil {
			errs = append(errs, fmt.Errorf("image_archives[%d]: source: %w", i, err))
		}
		if err := remote.CheckSHA256(a.SHA256); err != nil {
			errs = append(errs, fmt.Errorf("image_archives[%d]: sha256: %w", i, err))
		}
	}
	if c.ContainerdConfig != "" {
		if err := remote.CheckSource(c.ContainerdConfig); err != nil {
			errs = append(errs, fmt.Errorf("containerd_config: %w", err))
		}
	}
	if err := remote.CheckAbsolute(c.CNIBinDir); err != nil {
		errs = append(errs, fmt.Errorf("cni_bin_dir: %w", err))
	} else if strings.ContainsAny(c.CNIBinDir, `"\`) {
		errs = append(errs, fmt.Errorf("cni_bin_dir: %q holds a character containerd's configuration would need escaped", c.CNIBinDir))
	}
	if err := remote.CheckStaging(c.StagingDirectory); err != nil {
		errs = append(errs, fmt.Errorf("staging_directory: %w", err))
	}
	if _, err := c.executeCommand(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// executeCommand is execute_command with the script's path.
func (c *Config) executeCommand() (string, error) {
	return remote.ExecuteCommand(&c.ctx, c.ExecuteCommand, path.Join(c.StagingDirectory, scriptName))
}
