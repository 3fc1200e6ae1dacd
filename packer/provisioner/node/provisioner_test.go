package node

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/hashicorp/hcl/v2"
	"github.com/hashicorp/hcl/v2/hcldec"
	"github.com/hashicorp/hcl/v2/hclsyntax"
	packersdk "github.com/hashicorp/packer-plugin-sdk/packer"

	"github.com/berthlabs/berth/internal/repotest"
	"github.com/berthlabs/berth/packer/internal/chroot"
	"github.com/berthlabs/berth/packer/internal/chroot/chroottest"
	"github.com/berthlabs/berth/test/packertest"
)

// prepared is a provisioner configured from HCL, as packer hands it the decoded block.
func prepared(t *testing.T, text string) (*Provisioner, error) {
	t.Helper()
	file, diags := hclsyntax.ParseConfig([]byte(text), "node.pkr.hcl", hcl.InitialPos)
	if diags.HasErrors() {
		t.Fatal(diags)
	}
	p := &Provisioner{}
	val, diags := hcldec.Decode(file.Body, p.ConfigSpec(), nil)
	if diags.HasErrors() {
		t.Fatal(diags)
	}
	return p, p.Prepare(val)
}

func TestPrepareDefaults(t *testing.T) {
	p, err := prepared(t, "")
	if err != nil {
		t.Fatal(err)
	}
	c := p.config
	if !slices.Equal(c.Packages, DefaultPackages) || !*c.InstallPackages || !*c.Generalize ||
		c.PauseImage != DefaultPauseImage || !slices.Equal(c.Images, []string{DefaultPauseImage}) ||
		c.CNIBinDir != DefaultCNIBinDir || c.StagingDirectory != DefaultStagingDirectory {
		t.Errorf("defaults: %+v", c)
	}
}

// TestPrepareKeepsEmptyLists: `images = []` and `packages = []` mean none, not the defaults.
func TestPrepareKeepsEmptyLists(t *testing.T) {
	p, err := prepared(t, "images = []\npackages = []\ninstall_packages = false\ngeneralize = false\npause_image = \"mirror.example/pause:3.10.2\"\n")
	if err != nil {
		t.Fatal(err)
	}
	c := p.config
	if len(c.Images) != 0 || len(c.Packages) != 0 || *c.InstallPackages || *c.Generalize || c.PauseImage != "mirror.example/pause:3.10.2" {
		t.Errorf("decoded %+v", c)
	}
}

// TestPrepareNamesEveryMistake: one build run names them all.
func TestPrepareNamesEveryMistake(t *testing.T) {
	_, err := prepared(t, `
packages    = ["containerd", "Bad Name"]
images      = ["registry.k8s.io/pause:3.10.2", "two words"]
pause_image = "quote\"d"
cni_bin_dir = "opt/cni/bin"
staging_directory = "/"
image_archives {
  source = "/nonexistent/pause.tar"
  sha256 = "abc"
}
image_archives {
  sha256 = "0000000000000000000000000000000000000000000000000000000000000000"
}
`)
	if err == nil {
		t.Fatal("Prepare accepted a configuration full of mistakes")
	}
	for _, want := range []string{
		`packages[1]: "Bad Name" is not a Debian package name`,
		`images[1]: "two words" is not an image reference`,
		`pause_image: "quote\"d" is not an image reference`,
		`cni_bin_dir: "opt/cni/bin" is not an absolute path`,
		"staging_directory: the staging directory is removed afterwards",
		"image_archives[0]: source: stat /nonexistent/pause.tar",
		`image_archives[0]: sha256: "abc" is not a SHA-256`,
		"image_archives[1]: source is required",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the error does not say %q:\n%v", want, err)
		}
	}
	if strings.Contains(err.Error(), "packages[0]") || strings.Contains(err.Error(), "images[0]") || strings.Contains(err.Error(), "image_archives[1]: sha256") {
		t.Errorf("the error names a valid entry:\n%v", err)
	}
}

func TestDocsListEveryOption(t *testing.T) {
	packertest.DocumentsEveryOption(t, "packer/docs/provisioners/node.mdx", (&Provisioner{}).ConfigSpec())
}

// TestContainerdConfig has the real containerd read the configuration the provisioner writes: the systemd
// cgroup driver kubeadm configures the kubelet with, the pause image, the CNI directory.
func TestContainerdConfig(t *testing.T) {
	repotest.NeedsTools(t, "containerd")
	p, err := prepared(t, "pause_image = \"mirror.example/pause:3.10.2\"\ncni_bin_dir = \"/var/lib/cni/bin\"\n")
	if err != nil {
		t.Fatal(err)
	}
	uploads, err := p.uploads()
	if err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(uploads, func(u upload) bool { return u.staged == "config.toml" })
	if i < 0 {
		t.Fatal("no config.toml among the uploads")
	}
	path := filepath.Join(t.TempDir(), "config.toml")
	if err := os.WriteFile(path, uploads[i].file.Content, 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("containerd", "--config", path, "config", "dump").CombinedOutput()
	if err != nil {
		t.Fatalf("containerd config dump: %v\n%s", err, out)
	}
	for _, want := range []string{"SystemdCgroup = true", `sandbox_image = "mirror.example/pause:3.10.2"`, `bin_dir = "/var/lib/cni/bin"`} {
		if !strings.Contains(string(out), want) {
			t.Errorf("containerd's view of the configuration lacks %q:\n%s", want, out)
		}
	}
}

// busyboxTree is a root with every busybox applet and nothing of a node: the image of a builder that forgot
// the container runtime.
func busyboxTree(t *testing.T) (string, packersdk.Communicator) {
	t.Helper()
	root := chroottest.ShellTree(t)
	comm := &chroot.Communicator{Root: root}
	if out, status := chroottest.Run(t, comm, "/bin/busybox --install -s"); status != 0 {
		t.Fatalf("busybox --install: %s", out)
	}
	return root, comm
}

// TestRefusesImageWithoutRuntime runs the node script in a chroot of an image without a container runtime,
// a kubelet or systemd: the build fails and names every one of them at once, and the staging directory is
// gone.
func TestRefusesImageWithoutRuntime(t *testing.T) {
	root, comm := busyboxTree(t)
	p, err := prepared(t, "install_packages = false\nimages = []\n")
	if err != nil {
		t.Fatal(err)
	}
	err = p.Provision(context.Background(), packersdk.TestUi(t), comm, nil)
	if err == nil {
		t.Fatal("the image without a container runtime was accepted")
	}
	for _, want := range []string{
		"the image lacks what kubeadm join needs",
		"containerd: the container runtime", "runc:", "kubeadm:", "systemctl:", KubeletPath + ":",
		"/usr/local/bin/berth-agent:", "conntrack:", "iptables or nft:", "socat:",
		DefaultCNIBinDir + "/bridge:", DefaultCNIBinDir + "/loopback:", "/lib/modules:",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the refusal does not name %q:\n%v", want, err)
		}
	}
	// busybox has mount, cp and losetup: what the image has is not listed.
	for _, has := range []string{"mount:", "losetup:", " cp:"} {
		if strings.Contains(err.Error(), has) {
			t.Errorf("the refusal names %q, which the image has:\n%v", has, err)
		}
	}
	if _, err := os.Stat(filepath.Join(root, DefaultStagingDirectory)); !os.IsNotExist(err) {
		t.Errorf("the staging directory is left in the image: %v", err)
	}
}

// TestNoPackageManager: missing packages and no apt-get to install them is a refusal that says what to do.
func TestNoPackageManager(t *testing.T) {
	_, comm := busyboxTree(t)
	p, err := prepared(t, "packages = [\"containerd\", \"runc\"]\n")
	if err != nil {
		t.Fatal(err)
	}
	err = p.Provision(context.Background(), packersdk.TestUi(t), comm, nil)
	if err == nil || !strings.Contains(err.Error(), "the image lacks containerd runc and has no apt-get to install them") ||
		!strings.Contains(err.Error(), "install_packages = false") {
		t.Errorf("Provision = %v", err)
	}
}

// TestArchivePinnedBeforeUpload: an image archive that differs from its pin fails the build before anything
// reaches the image.
func TestArchivePinnedBeforeUpload(t *testing.T) {
	archive := filepath.Join(t.TempDir(), "pause.tar")
	if err := os.WriteFile(archive, []byte("an archive"), 0o644); err != nil {
		t.Fatal(err)
	}
	h := sha256.Sum256([]byte("another archive"))
	wrong := hex.EncodeToString(h[:])
	p, err := prepared(t, "image_archives {\n  source = \""+archive+"\"\n  sha256 = \""+wrong+"\"\n}\n")
	if err != nil {
		t.Fatal(err)
	}
	comm := new(packersdk.MockCommunicator)
	err = p.Provision(context.Background(), packersdk.TestUi(t), comm, nil)
	if err == nil || !strings.Contains(err.Error(), "expected "+wrong) || !strings.Contains(err.Error(), "nothing was uploaded") {
		t.Errorf("Provision = %v", err)
	}
	if comm.StartCalled || comm.UploadCalled {
		t.Error("the communicator was used before the archive's pin was checked")
	}
}

// TestDebianVMHasDefaultPackages: the Debian machine the QEMU tests build from stands in for a cloud image
// with the archive already applied (the tests reach none), so it must carry every default package.
func TestDebianVMHasDefaultPackages(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(repotest.Root(t), "scripts", "debian-vm.sh"))
	if err != nil {
		t.Fatal(err)
	}
	has := map[string]bool{}
	for _, line := range strings.Split(string(data), "\n") {
		for _, prefix := range []string{"packages=", "packages+=,"} {
			if list, ok := strings.CutPrefix(line, prefix); ok {
				for _, p := range strings.Split(list, ",") {
					has[p] = true
				}
			}
		}
	}
	for _, p := range DefaultPackages {
		if !has[p] {
			t.Errorf("scripts/debian-vm.sh does not install %s, one of berth-node's default packages", p)
		}
	}
}
