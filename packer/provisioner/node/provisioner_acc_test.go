package node

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/hashicorp/packer-plugin-sdk/acctest"

	"github.com/berthlabs/berth/internal/uki/ukitest"
	"github.com/berthlabs/berth/test/packertest"
)

// refusedTemplate bakes the agent into the local image's root (scripts/guest-root.sh: busybox, cryptsetup,
// no container runtime, no systemd) and asks berth-node to make it a node without installing anything.
const refusedTemplate = `
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
    agent_binary = %[6]q
  }

  provisioner "berth-node" {
    install_packages = false
    images           = []
  }
}
`

// TestAccRefusesImageWithoutRuntime runs the real packer (make packer-tools) on an image without a
// container runtime: the build fails, the log names what kubeadm join would miss, and no image is left.
func TestAccRefusesImageWithoutRuntime(t *testing.T) {
	if os.Getenv(acctest.TestEnvVar) == "" {
		t.Skipf("acceptance test with the real packer: make testacc-packer runs it (%s=1)", acctest.TestEnvVar)
	}
	if os.Geteuid() != 0 {
		t.Fatal("the provisioners' chroot needs root (run make testacc-packer as root)")
	}
	version := packertest.Setup(t)
	parts := ukitest.BootParts(t)
	root := ukitest.GuestRoot(t)
	agent := filepath.Join(t.TempDir(), "berth-agent")
	if err := os.WriteFile(agent, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	output := filepath.Join(t.TempDir(), "out")
	acctest.TestPlugin(t, &acctest.PluginTestCase{
		Name:      "acc-berth-node-refused",
		Init:      true,
		CheckInit: packertest.ExitedZero("packer init"),
		Template:  fmt.Sprintf(refusedTemplate, version, parts.Stub, parts.Kernel, root, output, agent),
		Check: func(cmd *exec.Cmd, logfile string) error {
			log, _ := os.ReadFile(logfile)
			if cmd.ProcessState == nil || cmd.ProcessState.ExitCode() == 0 {
				return fmt.Errorf("packer build made a node image without a container runtime:\n%s", log)
			}
			for _, want := range []string{
				"the image lacks what kubeadm join needs",
				"containerd: the container runtime", "runc:", "systemctl:", "kubeadm:", KubeletPath + ":",
				"conntrack:", DefaultCNIBinDir + "/bridge:", "kernel module br_netfilter for ",
			} {
				if !bytes.Contains(log, []byte(want)) {
					return fmt.Errorf("the failed build's log does not name %q:\n%s", want, log)
				}
			}
			// The agent is there: the refusal does not name it.
			if bytes.Contains(log, []byte("/usr/local/bin/berth-agent:")) {
				return fmt.Errorf("the refusal names the agent berth-agent installed:\n%s", log)
			}
			if _, err := os.Stat(output); err == nil {
				return fmt.Errorf("the failed build left %s behind", output)
			}
			return nil
		},
	})
}
