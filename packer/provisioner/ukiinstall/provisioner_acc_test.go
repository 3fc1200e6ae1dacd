package ukiinstall

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hashicorp/packer-plugin-sdk/acctest"

	imagemanifest "github.com/berthlabs/berth/internal/manifest"
	"github.com/berthlabs/berth/internal/measure"
	"github.com/berthlabs/berth/internal/repotest"
	"github.com/berthlabs/berth/internal/uki/ukitest"
	"github.com/berthlabs/berth/test/packertest"
)

// accTemplate provisions a Debian root file system through berth-uki's chroot communicator, as it would an
// EC2 instance over SSH: berth-uki-install installs the UKI with every option at its default but stub and
// output, the file provisioner downloads what landed on the ESP, and berth-manifest predicts from output.
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

  provisioner "berth-uki-install" {
    stub   = %[2]q
    output = %[6]q
  }

  provisioner "file" {
    direction   = "download"
    source      = "/boot/efi/EFI/BOOT/BOOTX64.EFI"
    destination = %[7]q
  }

  post-processor "berth-manifest" {
    image_name = "berth-acc"
    output     = %[8]q
    uki        = %[6]q
  }
}
`

// TestAccProvisioner runs the real packer (make packer-tools) with berth-uki-install in a berth-uki build of
// the node image's Debian root (scripts/guest-root.sh) laid out as Debian keeps its boot files, and checks
// that the UKI on the ESP is made of that root's kernel, initrd and os-release, is the file output names,
// and has the PCRs berth-manifest wrote.
func TestAccProvisioner(t *testing.T) {
	if os.Getenv(acctest.TestEnvVar) == "" {
		t.Skipf("acceptance test with the real packer: make testacc-packer runs it (%s=1)", acctest.TestEnvVar)
	}
	if os.Geteuid() != 0 {
		t.Fatal("the provisioners' chroot needs root (run make testacc-packer as root)")
	}
	version := packertest.Setup(t)
	parts := ukitest.BootParts(t)
	guest := ukitest.GuestRoot(t)
	procCmdline, err := os.ReadFile("/proc/cmdline")
	if err != nil {
		t.Fatal(err)
	}
	// The chroot's /proc is this machine's: its command line is the one embedded.
	cmdline, err := ownCmdline(string(procCmdline))
	if err != nil {
		t.Skipf("this machine's own command line cannot be embedded: %v", err)
	}

	root := newDebianRoot(t, parts.Kernel)
	if out, err := exec.Command("cp", "-a", "--", guest+"/.", root.dir).CombinedOutput(); err != nil {
		t.Fatalf("copying the guest root: %v\n%s", err, out)
	}
	dir := t.TempDir()
	output, downloaded, manifestPath := filepath.Join(dir, "berth.efi"), filepath.Join(dir, "BOOTX64.EFI"), filepath.Join(dir, "berth-image.json")
	acctest.TestPlugin(t, &acctest.PluginTestCase{
		Name:      "acc-berth-uki-install",
		Init:      true,
		CheckInit: packertest.ExitedZero("packer init"),
		Template: fmt.Sprintf(accTemplate, version, parts.Stub, parts.Kernel, root.dir, filepath.Join(dir, "image"),
			output, downloaded, manifestPath),
		Check: packertest.ExitedZero("packer build"),
	})
	if t.Failed() {
		return
	}
	got, err := os.ReadFile(downloaded)
	if err != nil {
		t.Fatal(err)
	}
	if want, _ := os.ReadFile(output); !bytes.Equal(got, want) {
		t.Fatalf("the UKI on the ESP (%d bytes) differs from output (%d bytes)", len(got), len(want))
	}
	checkSections(t, downloaded, map[string][]byte{
		".osrel": root.osRelease, ".cmdline": []byte(cmdline), ".linux": root.kernel, ".initrd": root.initrd,
	})
	want, err := measure.PredictFile(downloaded)
	if err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(manifestPath)
	if err != nil {
		t.Fatal(err)
	}
	m, err := imagemanifest.Parse(data)
	if err != nil {
		t.Fatal(err)
	}
	img, _ := m.Image("berth-acc")
	if len(img.PCRs) != len(want.PCRs) {
		t.Fatalf("manifest PCRs %v, want %d", img.PCRs, len(want.PCRs))
	}
	for i, d := range want.PCRs {
		if got := img.PCRs[fmt.Sprint(i)]; got != hex.EncodeToString(d[:]) {
			t.Errorf("PCR %d: manifest %s, the UKI on the ESP %s", i, got, d)
		}
	}
}

// TestAccAWSTemplateValidates runs packer validate on examples/packer/aws.pkr.hcl with the real packer, the
// real Amazon plugin (packer-plugin-amazon built from its module by scripts/build-packer-amazon.sh) and this
// plugin: every block's options are checked by the component's own Prepare, without AWS credentials. A
// missing stub fails validation, naming berth-uki-install's option, so the plugins did run.
func TestAccAWSTemplateValidates(t *testing.T) {
	if os.Getenv(acctest.TestEnvVar) == "" {
		t.Skipf("acceptance test with the real packer: make testacc-packer runs it (%s=1)", acctest.TestEnvVar)
	}
	packertest.Setup(t)
	addPlugin(t, "amazon", "BERTH_PACKER_AMAZON_PLUGINS")
	parts := ukitest.BootParts(t)
	agent := filepath.Join(t.TempDir(), "berth-agent")
	if err := os.WriteFile(agent, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	packer := func(args ...string) (string, error) { return runPacker(t, args...) }
	if out, err := packer("init", "aws.pkr.hcl"); err != nil {
		t.Fatalf("packer init aws.pkr.hcl: %v\n%s", err, out)
	}
	if out, err := packer("validate", "-var", "stub="+parts.Stub, "-var", "agent_binary="+agent, "aws.pkr.hcl"); err != nil {
		t.Fatalf("packer validate aws.pkr.hcl: %v\n%s", err, out)
	}
	out, err := packer("validate", "-var", "stub="+parts.Stub+".missing", "-var", "agent_binary="+agent, "aws.pkr.hcl")
	// Packer wraps its messages: compare them with their lines joined.
	if flat := strings.Join(strings.Fields(out), " "); err == nil || !strings.Contains(flat, `"berth-uki-install"`) || !strings.Contains(flat, "stub: stat ") {
		t.Errorf("packer validate with a missing stub: %v\n%s", err, out)
	}
}

// addPlugin puts one of HashiCorp's plugins, built by scripts/build-packer-<name>.sh (or found where env
// says, as make sets it), beside this plugin in the directory packertest.Setup made: Packer finds plugins in
// one directory.
func addPlugin(t *testing.T, name, env string) {
	t.Helper()
	plugins := repotest.BinDir(t, env, "build-packer-"+name+".sh", "it builds packer-plugin-"+name+" from the module proxy")
	dir := filepath.Join("github.com", "hashicorp", name)
	target := filepath.Join(os.Getenv("PACKER_PLUGIN_PATH"), dir)
	if err := os.MkdirAll(target, 0o755); err != nil {
		t.Fatal(err)
	}
	entries, err := os.ReadDir(filepath.Join(plugins, dir))
	if err != nil || len(entries) == 0 {
		t.Fatalf("scripts/build-packer-%s.sh installed nothing in %s: %v", name, plugins, err)
	}
	for _, e := range entries {
		if err := os.Symlink(filepath.Join(plugins, dir, e.Name()), filepath.Join(target, e.Name())); err != nil {
			t.Fatal(err)
		}
	}
}

// runPacker runs the packer on PATH in examples/packer and returns its output.
func runPacker(t *testing.T, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command("packer", args...)
	cmd.Dir = filepath.Join(repotest.Root(t), "examples", "packer")
	out, err := cmd.CombinedOutput()
	return string(out), err
}
