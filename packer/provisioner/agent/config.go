//go:generate packer-sdc mapstructure-to-hcl2 -type Config,File

package agent

import (
	"cmp"
	"errors"
	"fmt"
	"path"
	"strconv"
	"strings"
	"unicode"

	"github.com/berthlabs/berth/packer/internal/remote"
	"github.com/hashicorp/packer-plugin-sdk/common"
	"github.com/hashicorp/packer-plugin-sdk/template/config"
	"github.com/hashicorp/packer-plugin-sdk/template/interpolate"
)

// Defaults of the options that have one.
const (
	DefaultInstallPrefix    = "/"
	DefaultStagingDirectory = "/tmp/berth-provision"
	DefaultExecuteCommand   = "sh '{{.Path}}'"
	DefaultMode             = "0755"
)

// Config is the provisioner's configuration.
type Config struct {
	common.PackerConfig `mapstructure:",squash"`

	// The berth-agent binary to install, as /usr/local/bin/berth-agent.
	AgentBinary string `mapstructure:"agent_binary" required:"true"`
	// SHA-256 of agent_binary, 64 lowercase hex digits; the build fails if the binary differs.
	AgentSHA256 string `mapstructure:"agent_sha256"`
	// Pinned components such as kubeadm, kubelet and kubectl.
	Files []File `mapstructure:"files"`
	// The agent's configuration, installed as /etc/berth/agent.yaml with mode 0600.
	AgentConfig string `mapstructure:"agent_config"`
	// containerd's configuration, installed as /etc/containerd/config.toml with mode 0644.
	ContainerdConfig string `mapstructure:"containerd_config"`
	// Where the image's root is on the machine the communicator reaches: every file lands under it.
	// Defaults to `/`; set it for builders that provision a root file system mounted elsewhere.
	InstallPrefix string `mapstructure:"install_prefix"`
	// Directory on the machine the communicator reaches where files wait to be installed; removed
	// afterwards. Defaults to `/tmp/berth-provision`.
	StagingDirectory string `mapstructure:"staging_directory"`
	// Command that runs the install script, whose path is `{{.Path}}`. Defaults to `sh '{{.Path}}'`;
	// use `sudo -n sh '{{.Path}}'` where the communicator does not log in as root.
	ExecuteCommand string `mapstructure:"execute_command"`

	ctx interpolate.Context

	// Listed by Prepare: what Provision installs, in order.
	items []item
}

// File is a pinned component to install.
type File struct {
	// The local file.
	Source string `mapstructure:"source" required:"true"`
	// Absolute path in the image, such as `/usr/bin/kubelet`.
	Destination string `mapstructure:"destination" required:"true"`
	// SHA-256 of the file, 64 lowercase hex digits.
	SHA256 string `mapstructure:"sha256" required:"true"`
	// Octal mode of the installed file. Defaults to `0755`.
	Mode string `mapstructure:"mode"`
}

// item is one file the provisioner installs.
type item struct {
	option string // the option it comes from, for errors: agent_binary, files[2]
	name   string // what the build's output calls it
	file   remote.File
	dest   string // path in the image, without install_prefix
	mode   string // four octal digits
	sha256 string // the pin; empty where none is required
	staged string // name in the staging directory
}

// Prepare decodes and checks the configuration, naming every problem at once, and lists the files to
// install for Provision.
func (c *Config) Prepare(raws ...any) error {
	err := config.Decode(c, &config.DecodeOpts{
		PluginType:         "berth-agent",
		Interpolate:        true,
		InterpolateContext: &c.ctx,
		// Rendered in Provision, when the script's path is known.
		InterpolateFilter: &interpolate.RenderFilter{Exclude: []string{"execute_command"}},
	}, raws...)
	if err != nil {
		return err
	}
	c.InstallPrefix = cmp.Or(c.InstallPrefix, DefaultInstallPrefix)
	c.StagingDirectory = cmp.Or(c.StagingDirectory, DefaultStagingDirectory)
	c.ExecuteCommand = cmp.Or(c.ExecuteCommand, DefaultExecuteCommand)

	var errs []error
	if err := remote.CheckAbsolute(c.InstallPrefix); err != nil {
		errs = append(errs, fmt.Errorf("install_prefix: %w", err))
	}
	if err := remote.CheckStaging(c.StagingDirectory); err != nil {
		errs = append(errs, fmt.Errorf("staging_directory: %w", err))
	}
	if _, err := c.executeCommand(); err != nil {
		errs = append(errs, err)
	}

	c.items = nil
	add := func(it item) {
		it.staged = stagedName(len(c.items), it.dest)
		c.items = append(c.items, it)
	}
	if c.AgentBinary == "" {
		errs = append(errs, errors.New("agent_binary is required: the berth-agent binary to install"))
	} else if err := remote.CheckSource(c.AgentBinary); err != nil {
		errs = append(errs, fmt.Errorf("agent_binary: %w", err))
	}
	if c.AgentSHA256 != "" {
		if err := remote.CheckSHA256(c.AgentSHA256); err != nil {
			errs = append(errs, fmt.Errorf("agent_sha256: %w", err))
		}
	}
	if c.AgentBinary != "" {
		add(item{option: "agent_binary", name: "berth-agent", file: remote.File{Path: c.AgentBinary}, dest: AgentPath, mode: "0755", sha256: c.AgentSHA256})
	}
	add(item{option: "the agent's unit", name: UnitName, file: remote.File{Content: unit}, dest: UnitPath, mode: "0644"})
	if c.AgentConfig != "" {
		if err := remote.CheckSource(c.AgentConfig); err != nil {
			errs = append(errs, fmt.Errorf("agent_config: %w", err))
		}
		add(item{option: "agent_config", name: "agent.yaml", file: remote.File{Path: c.AgentConfig}, dest: AgentConfigPath, mode: "0600"})
	}
	if c.ContainerdConfig != "" {
		if err := remote.CheckSource(c.ContainerdConfig); err != nil {
			errs = append(errs, fmt.Errorf("containerd_config: %w", err))
		}
		add(item{option: "containerd_config", name: "containerd config.toml", file: remote.File{Path: c.ContainerdConfig}, dest: ContainerdConfigPath, mode: "0644"})
	}
	for i, f := range c.Files {
		option := fmt.Sprintf("files[%d]", i)
		it, fileErrs := checkFile(option, f)
		errs = append(errs, fileErrs...)
		add(it)
	}

	owner := map[string]string{}
	for _, it := range c.items {
		if it.dest == "" {
			continue
		}
		if other, ok := owner[it.dest]; ok {
			errs = append(errs, fmt.Errorf("%s: destination %s is also that of %s", it.option, it.dest, other))
			continue
		}
		owner[it.dest] = it.option
	}
	return errors.Join(errs...)
}

// checkFile checks one entry of files and returns what it installs.
func checkFile(option string, f File) (item, []error) {
	var errs []error
	it := item{option: option, name: path.Base(f.Destination), file: remote.File{Path: f.Source}, sha256: f.SHA256}
	if f.Source == "" {
		errs = append(errs, fmt.Errorf("%s: source is required", option))
	} else if err := remote.CheckSource(f.Source); err != nil {
		errs = append(errs, fmt.Errorf("%s: source: %w", option, err))
	}
	switch err := remote.CheckAbsolute(f.Destination); {
	case f.Destination == "":
		errs = append(errs, fmt.Errorf("%s: destination is required: the absolute path in the image, such as /usr/bin/kubelet", option))
	case strings.HasSuffix(f.Destination, "/"):
		errs = append(errs, fmt.Errorf("%s: destination %q ends in /: name the file itself, such as /usr/bin/kubelet", option, f.Destination))
	case err != nil:
		errs = append(errs, fmt.Errorf("%s: destination: %w", option, err))
	default:
		it.dest = f.Destination
	}
	if f.SHA256 == "" {
		errs = append(errs, fmt.Errorf("%s: sha256 is required: the file's SHA-256 as 64 lowercase hex digits", option))
	} else if err := remote.CheckSHA256(f.SHA256); err != nil {
		errs = append(errs, fmt.Errorf("%s: sha256: %w", option, err))
	}
	mode, err := parseMode(cmp.Or(f.Mode, DefaultMode))
	if err != nil {
		errs = append(errs, fmt.Errorf("%s: mode: %w", option, err))
	}
	it.mode = mode
	return it, errs
}

// parseMode returns an octal mode as install -m takes it, with four digits.
func parseMode(s string) (string, error) {
	if len(s) < 3 || len(s) > 4 {
		return "", fmt.Errorf("%q is not an octal mode such as 0755", s)
	}
	m, err := strconv.ParseUint(s, 8, 32)
	if err != nil {
		return "", fmt.Errorf("%q is not an octal mode such as 0755", s)
	}
	return fmt.Sprintf("%04o", m), nil
}

// stagedName is the i-th file's name in the staging directory: unique, and readable in sha256sum's output.
func stagedName(i int, dest string) string {
	base := strings.Map(func(r rune) rune {
		if r < 0x80 && (unicode.IsLetter(r) || unicode.IsDigit(r) || strings.ContainsRune("._+-", r)) {
			return r
		}
		return '_'
	}, path.Base(dest))
	return fmt.Sprintf("%02d-%s", i, base)
}

// executeCommand is execute_command with the script's path.
func (c *Config) executeCommand() (string, error) {
	return remote.ExecuteCommand(&c.ctx, c.ExecuteCommand, path.Join(c.StagingDirectory, scriptName))
}
