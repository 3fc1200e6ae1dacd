package uki

import (
	"context"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/packer-plugin-sdk/acctest"

	"github.com/berthlabs/berth/internal/manifest"
	"github.com/berthlabs/berth/internal/repotest"
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

// TestAccNodeImage runs the real packer on examples/packer/node.pkr.hcl as a user would, with the root file
// system of scripts/debian-vm.sh (Debian 12 with systemd, a kernel, initramfs-tools and the packages a node
// needs, mounted read-only from that disk), a static berth-agent, and kubeadm and the kubelet built from the
// Kubernetes module. The disk it makes must hold the UKI and the verified root: the root verifies against
// the root hash on the UKI's command line, and holds what berth-node makes of a node and nothing of the
// build's identity (packertest.CheckNodeRoot, which also checks the qemu builder's image).
func TestAccNodeImage(t *testing.T) {
	if os.Getenv(acctest.TestEnvVar) == "" {
		t.Skipf("acceptance test with the real packer: make testacc-packer runs it (%s=1)", acctest.TestEnvVar)
	}
	if os.Geteuid() != 0 {
		t.Fatal("the provisioners' chroot and mounting the Debian root need root (run make testacc-packer as root)")
	}
	packertest.Setup(t)
	parts := ukitest.BootParts(t)
	vm := repotest.Script(t, "debian-vm.sh", "it needs root, mmdebstrap and the Debian archive")
	vmParts := packertest.Partitions(t, filepath.Join(vm, "disk.raw"))
	if len(vmParts) != 2 {
		t.Fatalf("debian-vm's disk has partitions %+v, want an ESP and the root", vmParts)
	}
	root := packertest.Mount(t, vmParts[1].Loop(t, true))
	agent := repotest.BuildBinary(t, "./nodeagent/cmd/berth-agent", "")
	kube := repotest.BinDir(t, "BERTH_KUBE_BIN", "build-k8s.sh", "building Kubernetes from its modules")
	var files []string
	for _, name := range []string{"kubeadm", "kubelet"} {
		files = append(files, fmt.Sprintf("{source=%q, destination=%q, sha256=%q}",
			filepath.Join(kube, name), "/usr/bin/"+name, packertest.FileSHA256(t, filepath.Join(kube, name))))
	}

	dir := t.TempDir()
	output, manifestPath := filepath.Join(dir, "output-node"), filepath.Join(dir, "berth-image.json")
	if out, err := examplePacker("init", "node.pkr.hcl"); err != nil {
		t.Fatalf("packer init node.pkr.hcl: %v\n%s", err, out)
	}
	start := time.Now()
	out, err := examplePacker("build", "-var", "stub="+parts.Stub, "-var", "root_directory="+root, "-var", "agent_binary="+agent,
		"-var", "kubernetes_files=["+strings.Join(files, ", ")+"]", "-var", "output_directory="+output,
		"-var", "manifest="+manifestPath, "-var", "kubernetes_version=v1.36.3", "node.pkr.hcl")
	if err != nil {
		t.Fatalf("packer build node.pkr.hcl: %v\n%s", err, out)
	}
	t.Logf("packer build node.pkr.hcl: %.0fs\n%s", time.Since(start).Seconds(), tail(string(out), 30))

	data, err := os.ReadFile(manifestPath)
	if err != nil {
		t.Fatal(err)
	}
	m, err := manifest.Parse(data)
	if err != nil {
		t.Fatal(err)
	}
	img, ok := m.Image("berth-node-local")
	raw := filepath.Join(output, "berth.raw")
	if !ok || img.Builder != "berth-uki" || img.ArtifactID != raw || img.Components["kubernetes"] != "v1.36.3" {
		t.Fatalf("manifest images %+v, want berth-node-local from berth-uki, artifact %s, kubernetes v1.36.3", m.Images, raw)
	}
	packertest.CheckNodeRoot(t, raw, filepath.Join(output, "berth.efi"), "/opt/cni/bin")
	if _, err := os.Stat(filepath.Join(output, "root")); err == nil {
		t.Error("the provisioned copy of the root was left in the output directory")
	}
	if _, err := os.Stat(filepath.Join(output, "root.img")); err == nil {
		t.Error("the root's image was left in the output directory beside the disk that holds it")
	}
}

// examplePacker runs the real packer in examples/packer, as a user of its templates would.
func examplePacker(args ...string) ([]byte, error) {
	cmd := exec.Command("packer", args...)
	cmd.Dir = filepath.Join("..", "..", "..", "examples", "packer")
	return cmd.CombinedOutput()
}
