package manifest

import (
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hashicorp/packer-plugin-sdk/acctest"

	imagemanifest "github.com/berthlabs/berth/internal/manifest"
	"github.com/berthlabs/berth/internal/measure"
	"github.com/berthlabs/berth/internal/uki/ukitest"
	"github.com/berthlabs/berth/test/packertest"
)

const accTemplate = `
packer {
  required_plugins {
    berth = {
      version = "= %[1]s"
      source  = "github.com/berthlabs/berth"
    }
  }
}

source "file" "uki" {
  source = %[2]q
  target = %[3]q
}

build {
  sources = ["source.file.uki"]

  post-processor "berth-manifest" {
    image_name  = %[4]q
    output      = %[5]q
    artifact_id = %[3]q
    components  = { kubernetes = "v1.36.3" }
  }
}
`

// TestAccManifest runs the real packer (make packer-tools) with the plugin installed as `packer init` finds
// it offline: the file builder copies a real UKI, and berth-manifest writes the predictions into a manifest
// that already holds another image, which it keeps. A bad image name fails the build with the reason.
func TestAccManifest(t *testing.T) {
	if os.Getenv(acctest.TestEnvVar) == "" {
		t.Skipf("acceptance test with the real packer: make testacc-packer runs it (%s=1)", acctest.TestEnvVar)
	}
	version := packertest.Setup(t)

	parts := ukitest.BootParts(t)
	uki := ukitest.Build(t, parts.Stub,
		ukitest.Section{Name: ".osrel", Data: []byte("ID=berth\nVERSION_ID=test\n")},
		ukitest.Section{Name: ".cmdline", Data: []byte("console=ttyS0 berth.test=1")},
		ukitest.Section{Name: ".linux", Data: mustRead(t, parts.Kernel)},
		ukitest.Section{Name: ".initrd", Data: ukitest.Cpio("init", []byte("#!/bin/sh\n"))},
	)
	want, err := measure.PredictFile(uki)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	out := filepath.Join(dir, "berth-image.json")
	existing := &imagemanifest.Manifest{Version: imagemanifest.Version, Images: []imagemanifest.Image{{Name: "berth-older", Builder: "qemu",
		ArtifactID: "older.qcow2", PCRs: map[string]string{"11": strings.Repeat("ab", 32)}}}}
	data, err := existing.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(out, data, 0o644); err != nil {
		t.Fatal(err)
	}
	target := filepath.Join(dir, "image.efi")

	acctest.TestPlugin(t, &acctest.PluginTestCase{
		Name:      "acc-manifest",
		Init:      true,
		CheckInit: packertest.ExitedZero("packer init"),
		Template:  fmt.Sprintf(accTemplate, version, uki, target, "berth-test", out),
		Check: func(cmd *exec.Cmd, logfile string) error {
			if cmd.ProcessState == nil || cmd.ProcessState.ExitCode() != 0 {
				return fmt.Errorf("packer build failed (see %s)", logfile)
			}
			data, err := os.ReadFile(out)
			if err != nil {
				return err
			}
			m, err := imagemanifest.Parse(data)
			if err != nil {
				return err
			}
			if got := strings.Join(m.Names(), ","); got != "berth-older,berth-test" {
				return fmt.Errorf("manifest images %s, want the older one kept and berth-test added", got)
			}
			img, _ := m.Image("berth-test")
			if img.Builder != "file" || img.ArtifactID != target || img.Components["kubernetes"] != "v1.36.3" {
				return fmt.Errorf("image entry %+v", img)
			}
			if len(img.PCRs) != len(want.PCRs) {
				return fmt.Errorf("manifest has PCRs %v, want %d of them", img.PCRs, len(want.PCRs))
			}
			for i, d := range want.PCRs {
				if got := img.PCRs[fmt.Sprint(i)]; got != hex.EncodeToString(d[:]) {
					return fmt.Errorf("PCR %d: manifest %s, prediction %x", i, got, d)
				}
			}
			return nil
		},
	})

	acctest.TestPlugin(t, &acctest.PluginTestCase{
		Name:      "acc-manifest-bad-name",
		Init:      true,
		CheckInit: packertest.ExitedZero("packer init"),
		Template:  fmt.Sprintf(accTemplate, version, uki, filepath.Join(dir, "other.efi"), "Berth_Test", out),
		Check: func(cmd *exec.Cmd, logfile string) error {
			if cmd.ProcessState == nil || cmd.ProcessState.ExitCode() == 0 {
				return errors.New("packer build succeeded with an invalid image_name")
			}
			log, err := os.ReadFile(logfile)
			if err != nil {
				return err
			}
			if !strings.Contains(string(log), `image_name: name "Berth_Test" has 'B' at position 0`) {
				return fmt.Errorf("the build failed without naming the bad image_name (see %s)", logfile)
			}
			return nil
		},
	})
}

func mustRead(t *testing.T, path string) []byte {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return data
}
