package agent

import (
	"bytes"
	"debug/pe"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/hashicorp/packer-plugin-sdk/acctest"

	"github.com/berthlabs/berth/internal/uki/ukitest"
	"github.com/berthlabs/berth/test/packertest"
)

// accTemplate provisions the node image's Debian root file system (scripts/guest-root.sh) through
// berth-uki's chroot communicator: the real packer drives the provisioner as it would over SSH.
const accTemplate = `
packer {
  required_plugins {
    berth = {
      version = "= %[1]s"
      source  = "github.com/berthlabs/berth"
    }
  }
}

source "berth-uki" "acc" {
  stub             = %[2]q
  kernel           = %[3]q
  cmdline          = "console=ttyS0"
  root_directory   = %[4]q
  output_directory = %[5]q
}

build {
  sources = ["source.berth-uki.acc"]

  provisioner "berth-agent" {
    agent_binary      = %[6]q
    agent_sha256      = %[7]q
    agent_config      = %[8]q
    containerd_config = %[9]q

    files {
      source      = %[10]q
      destination = "/usr/bin/kubelet"
      sha256      = %[11]q
    }
  }
}
`

// TestAccProvisioner runs the real packer (make packer-tools) with berth-agent in a berth-uki build and
// reads what landed in the image's initrd; then it pins the kubelet to the wrong SHA-256 and finds the build
// failed, naming both sums, with no image left.
func TestAccProvisioner(t *testing.T) {
	if os.Getenv(acctest.TestEnvVar) == "" {
		t.Skipf("acceptance test with the real packer: make testacc-packer runs it (%s=1)", acctest.TestEnvVar)
	}
	if os.Geteuid() != 0 {
		t.Fatal("the provisioners' chroot needs root (run make testacc-packer as root)")
	}
	version := packertest.Setup(t)
	parts := ukitest.BootParts(t)
	root := ukitest.GuestRoot(t)
	src := sources(t, contents)
	template := func(output, kubeletSum string) string {
		return fmt.Sprintf(accTemplate, version, parts.Stub, parts.Kernel, root, output,
			src["berth-agent"], sum(contents["berth-agent"]), src["agent.yaml"], src["containerd.toml"],
			src["kubelet"], kubeletSum)
	}

	output := filepath.Join(t.TempDir(), "out")
	acctest.TestPlugin(t, &acctest.PluginTestCase{
		Name:      "acc-berth-agent",
		Init:      true,
		CheckInit: packertest.ExitedZero("packer init"),
		Template:  template(output, sum(contents["kubelet"])),
		Check:     packertest.ExitedZero("packer build"),
	})
	if t.Failed() {
		return
	}
	initrd := unpackInitrd(t, filepath.Join(output, "berth.efi"))
	for path, want := range map[string]struct {
		content string
		mode    os.FileMode
	}{
		"usr/local/bin/berth-agent":      {contents["berth-agent"], 0o755},
		"usr/bin/kubelet":                {contents["kubelet"], 0o755},
		"etc/berth/agent.yaml":           {contents["agent.yaml"], 0o600},
		"etc/containerd/config.toml":     {contents["containerd.toml"], 0o644},
		"etc/systemd/system/" + UnitName: {string(unit), 0o644},
		// The root the provisioner worked on is in the image too.
		"lib/x86_64-linux-gnu/libc.so.6": {"", 0o755},
	} {
		p := filepath.Join(initrd, path)
		fi, err := os.Stat(p)
		if err != nil {
			t.Errorf("%s is not in the image: %v", path, err)
			continue
		}
		if fi.Mode().Perm() != want.mode {
			t.Errorf("%s has mode %v, want %v", path, fi.Mode().Perm(), want.mode)
		}
		if data, _ := os.ReadFile(p); want.content != "" && string(data) != want.content {
			t.Errorf("%s holds %q, want %q", path, data, want.content)
		}
	}
	// The link is absolute, as systemctl enable makes it: it resolves in the image, not here.
	if target, err := os.Readlink(filepath.Join(initrd, WantsLink)); err != nil || target != UnitPath {
		t.Errorf("%s links to %q (%v), want %s", WantsLink, target, err, UnitPath)
	}
	if _, err := os.Stat(filepath.Join(initrd, DefaultStagingDirectory)); err == nil {
		t.Errorf("the staging directory %s was left in the image", DefaultStagingDirectory)
	}

	wrong := sum("another kubelet\n")
	failed := filepath.Join(t.TempDir(), "out")
	acctest.TestPlugin(t, &acctest.PluginTestCase{
		Name:     "acc-berth-agent-wrong-pin",
		Template: template(failed, wrong),
		Check: func(cmd *exec.Cmd, logfile string) error {
			log, _ := os.ReadFile(logfile)
			if cmd.ProcessState == nil || cmd.ProcessState.ExitCode() == 0 {
				return fmt.Errorf("packer build succeeded with the kubelet pinned to the wrong SHA-256:\n%s", log)
			}
			for _, want := range []string{"files[0]", "SHA-256 " + sum(contents["kubelet"]), "expected " + wrong} {
				if !bytes.Contains(log, []byte(want)) {
					return fmt.Errorf("the failed build's log does not name %q:\n%s", want, log)
				}
			}
			if _, err := os.Stat(failed); err == nil {
				return fmt.Errorf("the failed build left %s behind", failed)
			}
			return nil
		},
	})
}

// unpackInitrd unpacks the .initrd section of a UKI with GNU cpio and returns the directory.
func unpackInitrd(t *testing.T, efi string) string {
	t.Helper()
	f, err := pe.Open(efi)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	s := f.Section(".initrd")
	if s == nil {
		t.Fatalf("%s has no .initrd section", efi)
	}
	data, err := s.Data()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	cmd := exec.Command("cpio", "-i", "--make-directories", "--no-absolute-filenames", "--quiet")
	cmd.Dir, cmd.Stdin = dir, bytes.NewReader(data[:min(len(data), int(s.VirtualSize))])
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("cpio -i of the UKI's initrd: %v\n%s", err, out)
	}
	return dir
}
