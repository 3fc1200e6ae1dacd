package ukiinstall

import (
	"context"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/hashicorp/packer-plugin-sdk/acctest"

	imagemanifest "github.com/berthlabs/berth/internal/manifest"
	"github.com/berthlabs/berth/internal/repotest"
	"github.com/berthlabs/berth/internal/uki/ukitest"
	"github.com/berthlabs/berth/test/measuredboot"
	"github.com/berthlabs/berth/test/packertest"
)

// TestAccQEMUImage builds examples/packer/qemu.pkr.hcl with the real packer and the real qemu builder
// (packer-plugin-qemu built from its module): a Debian 12 machine (scripts/debian-vm.sh) boots under TCG,
// berth-uki-install installs a UKI of its own kernel, initrd and command line over SSH, and berth-manifest
// predicts its PCRs. The disk Packer wrote then boots under QEMU with OVMF, no other boot option and a
// swtpm, and the PCR 4, 9, 11 and 12 the guest reads from its TPM are the manifest's.
func TestAccQEMUImage(t *testing.T) {
	if os.Getenv(acctest.TestEnvVar) == "" {
		t.Skipf("acceptance test with the real packer: make testacc-packer runs it (%s=1)", acctest.TestEnvVar)
	}
	if os.Geteuid() != 0 {
		t.Fatal("scripts/debian-vm.sh needs root (run make testacc-packer as root)")
	}
	// The qemu builder runs qemu-img on the disk it copies.
	if _, err := exec.LookPath("qemu-img"); err != nil {
		t.Fatal("qemu-img not found: the qemu builder needs Debian's qemu-utils")
	}
	packertest.Setup(t)
	addPlugin(t, "qemu", "BERTH_PACKER_QEMU_PLUGINS")
	vm := repotest.Script(t, "debian-vm.sh", "it needs root, mmdebstrap and the Debian archive")
	parts := ukitest.BootParts(t)

	dir := t.TempDir()
	output, uki, manifestPath := filepath.Join(dir, "output"), filepath.Join(dir, "berth.efi"), filepath.Join(dir, "berth-image.json")
	if out, err := runPacker(t, "init", "qemu.pkr.hcl"); err != nil {
		t.Fatalf("packer init qemu.pkr.hcl: %v\n%s", err, out)
	}
	start := time.Now()
	out, err := runPacker(t, "build", "-var", "vm="+vm, "-var", "stub="+parts.Stub, "-var", "output_directory="+output,
		"-var", "uki="+uki, "-var", "manifest="+manifestPath, "qemu.pkr.hcl")
	if err != nil {
		t.Fatalf("packer build qemu.pkr.hcl: %v\n%s", err, out)
	}
	t.Logf("packer build with the qemu builder: %.0fs", time.Since(start).Seconds())

	data, err := os.ReadFile(manifestPath)
	if err != nil {
		t.Fatal(err)
	}
	m, err := imagemanifest.Parse(data)
	if err != nil {
		t.Fatal(err)
	}
	img, ok := m.Image("berth-node-qemu")
	if !ok || img.Builder != "qemu" || img.ArtifactID != filepath.Join(output, "berth.raw") {
		t.Fatalf("manifest images %+v, want berth-node-qemu from the qemu builder", m.Images)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	start = time.Now()
	console, err := measuredboot.Machine{Disk: filepath.Join(output, "berth.raw"), Dir: filepath.Join(dir, "boot")}.Boot(ctx)
	if err != nil {
		t.Fatalf("booting the built disk: %v\n%s", err, console)
	}
	t.Logf("measured boot of the built disk: %.0fs", time.Since(start).Seconds())
	got, err := measuredboot.PCRs(console)
	if err != nil {
		t.Fatalf("%v\n%s", err, console)
	}
	if len(got) != len(img.PCRs) {
		t.Fatalf("the guest printed PCRs %v, the manifest has %v", got, img.PCRs)
	}
	for i, v := range got {
		if want := img.PCRs[fmt.Sprint(i)]; hex.EncodeToString(v) != want {
			t.Errorf("PCR %d: the TPM holds %x, the manifest predicts %s", i, v, want)
		}
	}
}
