//go:generate packer-sdc mapstructure-to-hcl2 -type Config,File

// Package agent is the provisioner berth-agent: it installs the Berth node agent, its systemd unit and the
// pinned components a node needs (kubeadm, kubelet, kubectl) into an image being built. It uses nothing but
// the communicator's uploads and commands run by a POSIX sh, so it works the same over ssh (amazon-ebs,
// googlecompute, qemu) and in a chroot. Every file's SHA-256 is checked twice: locally before anything is
// uploaded, so a wrong pin fails the build at once, and on the image's side before anything is installed,
// so what the communicator delivered is what was checked.
package agent

import (
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"unicode"

	"github.com/hashicorp/hcl/v2/hcldec"
	"github.com/hashicorp/packer-plugin-sdk/common"
	packersdk "github.com/hashicorp/packer-plugin-sdk/packer"
	"github.com/hashicorp/packer-plugin-sdk/template/config"
	"github.com/hashicorp/packer-plugin-sdk/template/interpolate"
)

// Where the provisioner puts the agent and its configuration in the image; the unit names the first two.
const (
	AgentPath            = "/usr/local/bin/berth-agent"
	AgentConfigPath      = "/etc/berth/agent.yaml"
	ContainerdConfigPath = "/etc/containerd/config.toml"
	UnitPath             = "/etc/systemd/system/" + UnitName
	// WantsLink is the link that enables the unit, as systemctl enable makes it.
	WantsLink = "/etc/systemd/system/multi-user.target.wants/" + UnitName
)

// UnitName is the agent's systemd unit.
const UnitName = "berth-agent.service"

// Defaults of the options that have one.
const (
	DefaultInstallPrefix    = "/"
	DefaultStagingDirectory = "/tmp/berth-provision"
	DefaultExecuteCommand   = "sh '{{.Path}}'"
	DefaultMode             = "0755"
)

// scriptName is the install script's name in the staging directory.
const scriptName = "install.sh"

// unit runs berth-agent boot at every boot of the image.
//
//go:embed berth-agent.service
var unit []byte

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
	option  string // the option it comes from, for errors: agent_binary, files[2]
	name    string // what the build's output calls it
	source  string // the local file; empty for content
	content []byte
	dest    string // path in the image, without install_prefix
	mode    string // four octal digits
	sha256  string // the pin; empty where none is required
	staged  string // name in the staging directory
}

// Provisioner is berth-agent.
type Provisioner struct {
	config Config
	items  []item
}

func (p *Provisioner) ConfigSpec() hcldec.ObjectSpec { return p.config.FlatMapstructure().HCL2Spec() }

func (p *Provisioner) Prepare(raws ...any) error {
	err := config.Decode(&p.config, &config.DecodeOpts{
		PluginType:         "berth-agent",
		Interpolate:        true,
		InterpolateContext: &p.config.ctx,
		// Rendered in Provision, when the script's path is known.
		InterpolateFilter: &interpolate.RenderFilter{Exclude: []string{"execute_command"}},
	}, raws...)
	if err != nil {
		return err
	}
	c := &p.config
	c.InstallPrefix = cmp.Or(c.InstallPrefix, DefaultInstallPrefix)
	c.StagingDirectory = cmp.Or(c.StagingDirectory, DefaultStagingDirectory)
	c.ExecuteCommand = cmp.Or(c.ExecuteCommand, DefaultExecuteCommand)

	var errs []error
	if err := checkAbsolute(c.InstallPrefix); err != nil {
		errs = append(errs, fmt.Errorf("install_prefix: %w", err))
	}
	if err := checkStaging(c.StagingDirectory); err != nil {
		errs = append(errs, fmt.Errorf("staging_directory: %w", err))
	}
	if _, err := p.executeCommand(); err != nil {
		errs = append(errs, err)
	}

	p.items = nil
	add := func(it item) {
		it.staged = stagedName(len(p.items), it.dest)
		p.items = append(p.items, it)
	}
	if c.AgentBinary == "" {
		errs = append(errs, errors.New("agent_binary is required: the berth-agent binary to install"))
	} else if err := checkSource(c.AgentBinary); err != nil {
		errs = append(errs, fmt.Errorf("agent_binary: %w", err))
	}
	if c.AgentSHA256 != "" {
		if err := checkSHA256(c.AgentSHA256); err != nil {
			errs = append(errs, fmt.Errorf("agent_sha256: %w", err))
		}
	}
	if c.AgentBinary != "" {
		add(item{option: "agent_binary", name: "berth-agent", source: c.AgentBinary, dest: AgentPath, mode: "0755", sha256: c.AgentSHA256})
	}
	add(item{option: "the agent's unit", name: UnitName, content: unit, dest: UnitPath, mode: "0644"})
	if c.AgentConfig != "" {
		if err := checkSource(c.AgentConfig); err != nil {
			errs = append(errs, fmt.Errorf("agent_config: %w", err))
		}
		add(item{option: "agent_config", name: "agent.yaml", source: c.AgentConfig, dest: AgentConfigPath, mode: "0600"})
	}
	if c.ContainerdConfig != "" {
		if err := checkSource(c.ContainerdConfig); err != nil {
			errs = append(errs, fmt.Errorf("containerd_config: %w", err))
		}
		add(item{option: "containerd_config", name: "containerd config.toml", source: c.ContainerdConfig, dest: ContainerdConfigPath, mode: "0644"})
	}
	for i, f := range c.Files {
		option := fmt.Sprintf("files[%d]", i)
		it, fileErrs := checkFile(option, f)
		errs = append(errs, fileErrs...)
		add(it)
	}

	owner := map[string]string{}
	for _, it := range p.items {
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
	it := item{option: option, name: path.Base(f.Destination), source: f.Source, sha256: f.SHA256}
	if f.Source == "" {
		errs = append(errs, fmt.Errorf("%s: source is required", option))
	} else if err := checkSource(f.Source); err != nil {
		errs = append(errs, fmt.Errorf("%s: source: %w", option, err))
	}
	switch err := checkAbsolute(f.Destination); {
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
	} else if err := checkSHA256(f.SHA256); err != nil {
		errs = append(errs, fmt.Errorf("%s: sha256: %w", option, err))
	}
	mode, err := parseMode(cmp.Or(f.Mode, DefaultMode))
	if err != nil {
		errs = append(errs, fmt.Errorf("%s: mode: %w", option, err))
	}
	it.mode = mode
	return it, errs
}

func checkSource(p string) error {
	fi, err := os.Stat(p)
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("%s is not a regular file", p)
	}
	return nil
}

var sha256Hex = regexp.MustCompile(`^[0-9a-f]{64}$`)

func checkSHA256(s string) error {
	if !sha256Hex.MatchString(s) {
		return fmt.Errorf("%q is not a SHA-256: want 64 lowercase hex digits", s)
	}
	return nil
}

// checkAbsolute accepts only clean absolute paths, so what the build's output shows is where files land.
func checkAbsolute(p string) error {
	switch {
	case !path.IsAbs(p):
		return fmt.Errorf("%q is not an absolute path", p)
	case slices.Contains(strings.Split(p, "/"), ".."):
		return fmt.Errorf("%q contains ..", p)
	case strings.IndexFunc(p, unicode.IsControl) >= 0:
		return fmt.Errorf("%q contains a control character", p)
	case path.Clean(p) != p:
		return fmt.Errorf("%q is not a clean path: write %q", p, path.Clean(p))
	}
	return nil
}

// stagingChars are what a staging directory may hold: execute_command puts the script's path between
// quotes of the user's choosing.
var stagingChars = regexp.MustCompile(`^[A-Za-z0-9._+/-]+$`)

func checkStaging(p string) error {
	if err := checkAbsolute(p); err != nil {
		return err
	}
	if p == "/" {
		return errors.New("the staging directory is removed after the install: / cannot be it")
	}
	if !stagingChars.MatchString(p) {
		return fmt.Errorf("%q: only letters, digits and . _ + - / please, as execute_command quotes it", p)
	}
	return nil
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
func (p *Provisioner) executeCommand() (string, error) {
	p.config.ctx.Data = struct{ Path string }{Path: path.Join(p.config.StagingDirectory, scriptName)}
	cmd, err := interpolate.Render(p.config.ExecuteCommand, &p.config.ctx)
	if err != nil {
		return "", fmt.Errorf("execute_command: %w", err)
	}
	if strings.TrimSpace(cmd) == "" {
		return "", errors.New("execute_command is empty once rendered")
	}
	return cmd, nil
}

func (p *Provisioner) Provision(ctx context.Context, ui packersdk.Ui, comm packersdk.Communicator, _ map[string]any) error {
	if comm == nil {
		return errors.New("the builder gives provisioners no communicator: use one that reaches the image (ssh, winrm, or berth-uki with root_directory), not communicator \"none\"")
	}
	sums := make([]string, len(p.items))
	for i, it := range p.items {
		if err := ctx.Err(); err != nil {
			return err
		}
		sum, size, err := it.hash()
		if err != nil {
			return fmt.Errorf("%s: hashing %s: %w", it.option, it.source, err)
		}
		if it.sha256 != "" && sum != it.sha256 {
			return fmt.Errorf("%s: %s has SHA-256 %s, expected %s: nothing was uploaded", it.option, it.source, sum, it.sha256)
		}
		sums[i] = sum
		ui.Say(fmt.Sprintf("%s: %s, sha256 %s… → %s", it.name, formatSize(size), sum[:12], path.Join(p.config.InstallPrefix, it.dest)))
	}

	if err := ctx.Err(); err != nil {
		return err
	}
	staging := p.config.StagingDirectory
	if err := run(ctx, ui, comm, fmt.Sprintf("mkdir -p %s && chmod 0700 %s", quote(staging), quote(staging))); err != nil {
		return fmt.Errorf("creating the staging directory %s: %w", staging, err)
	}
	for _, it := range p.items {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := it.upload(ui, comm, path.Join(staging, it.staged)); err != nil {
			return fmt.Errorf("uploading %s: %w", it.name, err)
		}
	}

	if err := ctx.Err(); err != nil {
		return err
	}
	script := p.script(sums)
	if err := comm.Upload(path.Join(staging, scriptName), strings.NewReader(script), nil); err != nil {
		return fmt.Errorf("uploading the install script: %w", err)
	}
	command, err := p.executeCommand()
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	ui.Say(fmt.Sprintf("Installing %d files under %s", len(p.items), p.config.InstallPrefix))
	if err := run(ctx, ui, comm, command); err != nil {
		return fmt.Errorf("the install script: %w", err)
	}
	return nil
}

// open returns the item's content and, for a local file, its information, which scp takes its length
// from (without it, the communicator copies the file to learn it).
func (it item) open() (io.ReadCloser, *os.FileInfo, error) {
	if it.source == "" {
		return io.NopCloser(bytes.NewReader(it.content)), nil, nil
	}
	f, err := os.Open(it.source)
	if err != nil {
		return nil, nil, err
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, nil, err
	}
	return f, &fi, nil
}

// hash streams the item through SHA-256: a kubelet need not sit in memory.
func (it item) hash() (string, int64, error) {
	r, _, err := it.open()
	if err != nil {
		return "", 0, err
	}
	defer r.Close()
	h := sha256.New()
	n, err := io.Copy(h, r)
	if err != nil {
		return "", 0, err
	}
	return hex.EncodeToString(h.Sum(nil)), n, nil
}

func (it item) upload(ui packersdk.Ui, comm packersdk.Communicator, dst string) error {
	r, fi, err := it.open()
	if err != nil {
		return err
	}
	defer r.Close()
	if fi == nil {
		return comm.Upload(dst, r, nil)
	}
	progress := ui.TrackProgress(path.Base(it.source), 0, (*fi).Size(), r)
	defer progress.Close()
	return comm.Upload(dst, progress, fi)
}

// run runs a command through the communicator, shows its output as it comes, and returns an error
// carrying that output if the command fails.
func run(ctx context.Context, ui packersdk.Ui, comm packersdk.Communicator, command string) error {
	var out lockedBuffer
	cmd := &packersdk.RemoteCmd{Command: command, Stdout: &out, Stderr: &out}
	if err := cmd.RunWithUi(ctx, comm, ui); err != nil {
		return fmt.Errorf("running %s: %w", command, err)
	}
	switch status := cmd.ExitStatus(); status {
	case 0:
		return nil
	case packersdk.CmdDisconnect:
		return fmt.Errorf("%s: the remote side disconnected", command)
	default:
		return fmt.Errorf("%s exited with status %d:\n%s", command, status, strings.TrimSpace(out.String()))
	}
}

// lockedBuffer collects a command's stdout and stderr, which communicators write from two goroutines.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func formatSize(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	v, suffix := float64(n)/unit, "KiB"
	for _, s := range []string{"MiB", "GiB"} {
		if v < unit {
			break
		}
		v, suffix = v/unit, s
	}
	return fmt.Sprintf("%.1f %s", v, suffix)
}
