// Package agent is the provisioner berth-agent: it installs the Berth node agent, its systemd unit and the
// pinned components a node needs (kubeadm, kubelet, kubectl) into an image being built. It uses nothing but
// the communicator's uploads and commands run by a POSIX sh, so it works the same over ssh (amazon-ebs,
// googlecompute, qemu) and in a chroot. Every file's SHA-256 is checked twice: locally before anything is
// uploaded, so a wrong pin fails the build at once, and on the image's side before anything is installed,
// so what the communicator delivered is what was checked.
package agent

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"path"
	"strings"

	"github.com/berthlabs/berth/packer/internal/remote"
	"github.com/hashicorp/hcl/v2/hcldec"
	packersdk "github.com/hashicorp/packer-plugin-sdk/packer"
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

// scriptName is the install script's name in the staging directory.
const scriptName = "install.sh"

// unit runs berth-agent boot at every boot of the image.
//
//go:embed berth-agent.service
var unit []byte

// Provisioner is berth-agent.
type Provisioner struct {
	config Config
}

func (p *Provisioner) ConfigSpec() hcldec.ObjectSpec { return p.config.FlatMapstructure().HCL2Spec() }

func (p *Provisioner) Prepare(raws ...any) error { return p.config.Prepare(raws...) }

func (p *Provisioner) Provision(ctx context.Context, ui packersdk.Ui, comm packersdk.Communicator, _ map[string]any) error {
	if comm == nil {
		return errors.New("the builder gives provisioners no communicator: use one that reaches the image (ssh, winrm, or berth-uki with root_directory), not communicator \"none\"")
	}
	sums := make([]string, len(p.config.items))
	for i, it := range p.config.items {
		if err := ctx.Err(); err != nil {
			return err
		}
		sum, size, err := it.file.Hash()
		if err != nil {
			return fmt.Errorf("%s: hashing %s: %w", it.option, it.file.Path, err)
		}
		if it.sha256 != "" && sum != it.sha256 {
			return fmt.Errorf("%s: %s has SHA-256 %s, expected %s: nothing was uploaded", it.option, it.file.Path, sum, it.sha256)
		}
		sums[i] = sum
		ui.Say(fmt.Sprintf("%s: %s, sha256 %s… → %s", it.name, remote.FormatSize(size), sum[:12], path.Join(p.config.InstallPrefix, it.dest)))
	}

	if err := ctx.Err(); err != nil {
		return err
	}
	staging := p.config.StagingDirectory
	if err := remote.Run(ctx, ui, comm, fmt.Sprintf("mkdir -p %s && chmod 0700 %s", remote.Quote(staging), remote.Quote(staging))); err != nil {
		return fmt.Errorf("creating the staging directory %s: %w", staging, err)
	}
	for _, it := range p.config.items {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := it.file.Upload(ui, comm, path.Join(staging, it.staged)); err != nil {
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
	command, err := p.config.executeCommand()
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	ui.Say(fmt.Sprintf("Installing %d files under %s", len(p.config.items), p.config.InstallPrefix))
	if err := remote.Run(ctx, ui, comm, command); err != nil {
		return fmt.Errorf("the install script: %w", err)
	}
	return nil
}
