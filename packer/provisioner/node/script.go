package node

import (
	"fmt"
	"strings"
	"text/template"

	"github.com/berthlabs/berth/packer/internal/remote"
	"github.com/berthlabs/berth/packer/provisioner/agent"
)

var scriptTemplate = template.Must(template.New("node.sh.tmpl").Funcs(template.FuncMap{"quote": remote.Quote}).
	ParseFS(files, "files/node.sh.tmpl"))

// script is the node script: run by a POSIX sh in the image, it checks every staged file against the
// SHA-256 checked locally, installs missing packages and the provisioner's files, refuses an image that
// lacks what kubeadm join needs, keeps the container images, turns swap off and generalizes the image. It
// removes the staging directory, even when it fails.
func (p *Provisioner) script(uploads []upload) (string, error) {
	c := p.config
	archives := make([]string, len(c.ImageArchives))
	for i := range archives {
		archives[i] = archiveName(i)
	}
	sums := make([]struct{ SHA256, Staged string }, len(uploads))
	for i, u := range uploads {
		sums[i].SHA256, sums[i].Staged = u.sha256, u.staged
	}
	var b strings.Builder
	if err := scriptTemplate.Execute(&b, map[string]any{
		"Staging":          c.StagingDirectory,
		"Uploads":          sums,
		"InstallPackages":  *c.InstallPackages,
		"Packages":         c.Packages,
		"KubeletUnit":      KubeletUnitPath,
		"KubeadmDropIn":    KubeadmDropInPath,
		"ImagesUnit":       ImagesUnitPath,
		"ContainerdDropIn": ContainerdDropInPath,
		"Modules":          ModulesPath,
		"Sysctl":           SysctlPath,
		"ContainerdConfig": ContainerdConfigPath,
		"ImagesDir":        ImagesDir,
		"Archives":         archives,
		"CNIBinDir":        c.CNIBinDir,
		"Kubelet":          KubeletPath,
		"Agent":            agent.AgentPath,
		"Images":           c.Images,
		"Generalize":       *c.Generalize,
	}); err != nil {
		return "", fmt.Errorf("writing the node script: %w", err)
	}
	return b.String(), nil
}
