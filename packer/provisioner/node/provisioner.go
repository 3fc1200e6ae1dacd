// Package node is the provisioner berth-node: it makes the image being built a Kubernetes node that kubeadm
// join accepts, the same way on every builder (a chroot, or an SSH build on EC2, GCE or QEMU). It installs
// the container runtime and the tools kubeadm runs, configures containerd, the kernel and the kubelet as
// kubeadm expects, keeps the container images a first boot needs, refuses an image that still misses any of
// it, naming what, and removes what must differ between the instances that boot the image.
package node

import (
	"bytes"
	"context"
	"embed"
	"errors"
	"fmt"
	"path"
	"strings"
	"text/template"

	"github.com/berthlabs/berth/packer/internal/remote"
	"github.com/hashicorp/hcl/v2/hcldec"
	packersdk "github.com/hashicorp/packer-plugin-sdk/packer"
)

// Where the provisioner puts what it writes in the image.
const (
	ContainerdConfigPath = "/etc/containerd/config.toml"
	KubeletUnitPath      = "/etc/systemd/system/kubelet.service"
	KubeadmDropInPath    = "/etc/systemd/system/kubelet.service.d/10-kubeadm.conf"
	ImagesUnitPath       = "/etc/systemd/system/berth-images.service"
	ContainerdDropInPath = "/etc/systemd/system/containerd.service.d/berth-node-root.conf"
	ModulesPath          = "/etc/modules-load.d/berth-node.conf"
	SysctlPath           = "/etc/sysctl.d/90-berth-node.conf"
	// ImagesDir holds the container image archives berth-images.service imports at every boot.
	ImagesDir = "/usr/share/berth/images"
	// KubeletPath is where the kubelet's unit runs it from: install it there (berth-agent's files).
	KubeletPath = "/usr/bin/kubelet"
)

const scriptName = "node.sh"

//go:embed files
var files embed.FS

var containerdTemplate = template.Must(template.ParseFS(files, "files/containerd.toml.tmpl"))

// Provisioner is berth-node.
type Provisioner struct {
	config Config
}

func (p *Provisioner) ConfigSpec() hcldec.ObjectSpec { return p.config.FlatMapstructure().HCL2Spec() }

func (p *Provisioner) Prepare(raws ...any) error { return p.config.Prepare(raws...) }

// upload is a file the script installs: staged under its name, checked by its SHA-256 in the image.
type upload struct {
	file   remote.File
	staged string
	sha256 string
}

func (p *Provisioner) Provision(ctx context.Context, ui packersdk.Ui, comm packersdk.Communicator, _ map[string]any) error {
	if comm == nil {
		return errors.New("the builder gives provisioners no communicator: use one that reaches the image (ssh, or berth-uki with root_directory), not communicator \"none\"")
	}
	uploads, err := p.uploads()
	if err != nil {
		return err
	}
	for i := range uploads {
		u := &uploads[i]
		sum, size, err := u.file.Hash()
		if err != nil {
			return fmt.Errorf("hashing %s: %w", u.staged, err)
		}
		if u.sha256 != "" && sum != u.sha256 {
			return fmt.Errorf("image_archives: %s has SHA-256 %s, expected %s: nothing was uploaded", u.file.Path, sum, u.sha256)
		}
		u.sha256 = sum
		if u.file.Path != "" {
			ui.Say(fmt.Sprintf("%s: %s, sha256 %s…", u.file.Path, remote.FormatSize(size), sum[:12]))
		}
	}
	staging := p.config.StagingDirectory
	if err := remote.Run(ctx, ui, comm, fmt.Sprintf("mkdir -p %s && chmod 0700 %s", remote.Quote(staging), remote.Quote(staging))); err != nil {
		return fmt.Errorf("creating the staging directory %s: %w", staging, err)
	}
	for _, u := range uploads {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := u.file.Upload(ui, comm, path.Join(staging, u.staged)); err != nil {
			return fmt.Errorf("uploading %s: %w", u.staged, err)
		}
	}
	script, err := p.script(uploads)
	if err != nil {
		return err
	}
	if err := comm.Upload(path.Join(staging, scriptName), strings.NewReader(script), nil); err != nil {
		return fmt.Errorf("uploading the script: %w", err)
	}
	command, err := p.config.executeCommand()
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	ui.Say("Making the image a Kubernetes node")
	if err := remote.Run(ctx, ui, comm, command); err != nil {
		return fmt.Errorf("the node script: %w", err)
	}
	return nil
}

// uploads lists what the script installs, in the order of its names in the staging directory: the files
// the provisioner writes, then containerd's configuration, then the image archives.
func (p *Provisioner) uploads() ([]upload, error) {
	var uploads []upload
	for _, name := range []string{"kubelet.service", "10-kubeadm.conf", "berth-images.service", "modules.conf", "sysctl.conf", "containerd-root.conf"} {
		data, err := files.ReadFile("files/" + name)
		if err != nil {
			return nil, err
		}
		uploads = append(uploads, upload{file: remote.File{Content: data}, staged: name})
	}
	containerd := remote.File{Path: p.config.ContainerdConfig}
	if containerd.Path == "" {
		var b bytes.Buffer
		if err := containerdTemplate.Execute(&b, p.config); err != nil {
			return nil, fmt.Errorf("writing containerd's configuration: %w", err)
		}
		containerd.Content = b.Bytes()
	}
	uploads = append(uploads, upload{file: containerd, staged: "config.toml"})
	for i, a := range p.config.ImageArchives {
		uploads = append(uploads, upload{file: remote.File{Path: a.Source}, staged: archiveName(i), sha256: a.SHA256})
	}
	return uploads, nil
}

// archiveName is the i-th image archive's name, in the staging directory and in ImagesDir.
func archiveName(i int) string { return fmt.Sprintf("archive-%02d.tar", i) }
