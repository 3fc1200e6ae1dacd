package agent

import (
	"fmt"
	"path"
	"strings"

	"github.com/berthlabs/berth/packer/internal/remote"
)

// script is the install script: run by a POSIX sh on the machine the communicator reaches, it checks
// every staged file against the SHA-256 checked locally, installs them under install_prefix, enables the
// agent's unit and removes the staging directory, even when it fails.
func (p *Provisioner) script(sums []string) string {
	prefix := p.config.InstallPrefix
	var b strings.Builder
	b.WriteString("#!/bin/sh\n# Written by the berth-agent provisioner of packer-plugin-berth.\nset -eu\n")
	fmt.Fprintf(&b, "staging=%s\n", remote.Quote(p.config.StagingDirectory))
	b.WriteString(`trap 'rm -rf "$staging"' EXIT
cd "$staging"

# What arrived is what was checked before the upload; nothing is installed otherwise.
sha256sum -c <<'EOF' || { echo "berth-agent: a staged file differs from the one checked before its upload; nothing was installed" >&2; exit 1; }
`)
	for i, it := range p.config.items {
		fmt.Fprintf(&b, "%s  %s\n", sums[i], it.staged)
	}
	b.WriteString("EOF\n\n# install would put a file into a directory of the same name: refuse before installing anything.\nfor target in")
	for _, it := range p.config.items {
		fmt.Fprintf(&b, " %s", remote.Quote(path.Join(prefix, it.dest)))
	}
	b.WriteString(`; do
	if [ -d "$target" ]; then
		echo "berth-agent: $target is a directory in the image; nothing was installed" >&2
		exit 1
	fi
done

`)
	for _, it := range p.config.items {
		target := path.Join(prefix, it.dest)
		fmt.Fprintf(&b, "install -D -m %s %s %s\necho %s\n", it.mode, remote.Quote(it.staged), remote.Quote(target), remote.Quote("installed "+target+" (mode "+it.mode+")"))
	}

	// systemctl enable works offline (in a chroot, or on a mounted root with --root); without systemctl,
	// the link it would make is made here.
	systemctl := "systemctl enable " + UnitName
	if prefix != "/" {
		systemctl = fmt.Sprintf("systemctl --root=%s enable %s", remote.Quote(prefix), UnitName)
	}
	link := path.Join(prefix, WantsLink)
	fmt.Fprintf(&b, `
if command -v systemctl >/dev/null 2>&1; then
	%s
else
	mkdir -p %s
	ln -sf %s %s
	echo "enabled %s (linked into %s)"
fi
`, systemctl, remote.Quote(path.Dir(link)), UnitPath, remote.Quote(link), UnitName, path.Dir(WantsLink))
	return b.String()
}
