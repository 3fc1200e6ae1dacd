package uki

import (
	"context"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/packer-plugin-sdk/acctest"

	"github.com/berthlabs/berth/internal/manifest"
	"github.com/berthlabs/berth/internal/uki/ukitest"
	"github.com/berthlabs/berth/test/measuredboot"
	"github.com/berthlabs/berth/test/packertest"
)

// TestAccLocalImage runs the real packer (make packer-tools) on examples/packer/local.pkr.hcl, with the
// plugin installed as `packer init` finds it offline, Debian's stub and kernel, and pcrinit as /init. It then
// boots the disk the build made under OVMF with a swtpm, and checks that PCR 4, 9, 11 and 12 of that boot
// are the values berth-manifest wrote to berth-image.json.
func TestAccLocalImage(t *testing.T) {
	if os.Getenv(acctest.TestEnvVar) == "" {
		t.Skipf("acceptance test with the real packer: make testacc-packer runs it (%s=1)", acctest.TestEnvVar)
	}
	packertest.Setup(t)

	parts := ukitest.BootParts(t)
	dir := t.TempDir()
	init, err := measuredboot.BuildInit(dir)
	if err != nil {
		t.Fatal(err)
	}
	template, err := os.ReadFile("../../../examples/packer/local.pkr.hcl")
	if err != nil {
		t.Fatal(err)
	}
	output := filepath.Join(dir, "output-local")
	manifestPath := filepath.Join(dir, "berth-image.json")

	start := time.Now()
	acctest.TestPlugin(t, &acctest.PluginTestCase{
		Name:      "acc-local-image",
		Init:      true,
		CheckInit: packertest.ExitedZero("packer init"),
		Template:  string(template),
		BuildExtraArgs: []string{
			"-var", "stub=" + parts.Stub,
			"-var", "kernel=" + parts.Kernel,
			"-var", "init=" + init,
			"-var", "output_directory=" + output,
			"-var", "manifest=" + manifestPath,
			"-var", "kubernetes_version=v1.36.3",
		},
		Check: packertest.ExitedZero("packer build"),
	})
	t.Logf("packer init and build: %.1fs", time.Since(start).Seconds())
	if t.Failed() {
		return
	}

	data, err := os.ReadFile(manifestPath)
	if err != nil {
		t.Fatal(err)
	}
	m, err := manifest.Parse(data)
	if err != nil {
		t.Fatal(err)
	}
	img, ok := m.Image("berth-local")
	if !ok {
		t.Fatalf("berth-image.json has no berth-local: %s", data)
	}
	raw := filepath.Join(output, "berth.raw")
	if img.Builder != "berth-uki" || img.ArtifactID != raw || img.Components["kubernetes"] != "v1.36.3" {
		t.Errorf("manifest entry %+v, want builder berth-uki, artifact %s and kubernetes v1.36.3", img, raw)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	start = time.Now()
	console, err := measuredboot.Machine{Disk: raw, Dir: filepath.Join(dir, "boot")}.Boot(ctx)
	if err != nil {
		t.Fatalf("booting %s: %v\n--- console ---\n%s", raw, err, tail(console, 40))
	}
	got, err := measuredboot.PCRs(console)
	if err != nil {
		t.Fatalf("%v\n--- console ---\n%s", err, tail(console, 40))
	}
	t.Logf("booted the disk and read the PCRs in %.1fs", time.Since(start).Seconds())
	for _, pcr := range []int{4, 9, 11, 12} {
		want := img.PCRs[fmt.Sprint(pcr)]
		if want == "" {
			t.Errorf("PCR %d: berth-image.json has no value", pcr)
		} else if hex.EncodeToString(got[pcr]) != want {
			t.Errorf("PCR %d: berth-image.json expects %s, the boot measured %x", pcr, want, got[pcr])
		}
	}
}

func tail(s string, lines int) string {
	all := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(all[max(0, len(all)-lines):], "\n")
}
