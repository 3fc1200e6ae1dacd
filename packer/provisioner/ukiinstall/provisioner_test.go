package ukiinstall

import (
	"bytes"
	"context"
	"debug/pe"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	packersdk "github.com/hashicorp/packer-plugin-sdk/packer"

	imagemanifest "github.com/berthlabs/berth/internal/manifest"
	"github.com/berthlabs/berth/internal/measure"
	"github.com/berthlabs/berth/internal/uki/ukitest"
	"github.com/berthlabs/berth/packer/internal/verity"
	"github.com/berthlabs/berth/packer/postprocessor/manifest"
	"github.com/berthlabs/berth/test/packertest"
)

func TestPrepare(t *testing.T) {
	dir := t.TempDir()
	stub := filepath.Join(dir, "linuxx64.efi.stub")
	if err := os.WriteFile(stub, []byte("MZ"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		change map[string]any
		want   []string
	}{
		{"valid", nil, nil},
		{"no stub", map[string]any{"stub": ""}, []string{"stub is required"}},
		{"stub missing", map[string]any{"stub": stub + ".gone"}, []string{"stub: stat "}},
		{"stub a directory", map[string]any{"stub": dir}, []string{"stub: " + dir + " is not a regular file"}},
		{"relative paths", map[string]any{"kernel": "boot/vmlinuz", "initrd": "/boot/../initrd.img", "os_release": "os-release", "esp": "efi"},
			[]string{`kernel: "boot/vmlinuz" is not an absolute path`, `initrd: "/boot/../initrd.img" contains ..`, "os_release: ", "esp: "}},
		{"esp /", map[string]any{"esp": "/"}, []string{"esp: / is not the mount point"}},
		{"staging /", map[string]any{"staging_directory": "/"}, []string{"staging_directory: the staging directory is removed"}},
		{"staging quoted", map[string]any{"staging_directory": "/tmp/it's"}, []string{"staging_directory: ", "only letters"}},
		{"cmdline initrd=", map[string]any{"cmdline": "root=/dev/nvme0n1p1 initrd=\\initrd.img"}, []string{`cmdline: has initrd=\initrd.img`}},
		{"cmdline non-ASCII", map[string]any{"cmdline": "root=/dev/sda1 café"}, []string{"cmdline: has a non-ASCII"}},
		{"cmdline blank", map[string]any{"cmdline": "  "}, []string{"cmdline: is empty"}},
		{"output a directory", map[string]any{"output": dir}, []string{"output: " + dir + " is a directory"}},
		{"execute_command", map[string]any{"execute_command": "{{.Nope"}, []string{"execute_command"}},
		{"verified_root device relative", map[string]any{"verified_root": map[string]any{"device": "vdb"}}, []string{`verified_root.device: "vdb" is not an absolute path`}},
		{"verified_root device not a device", map[string]any{"verified_root": map[string]any{"device": "/tmp/image.raw"}}, []string{"verified_root.device: /tmp/image.raw is not a device"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			raw := map[string]any{"stub": stub}
			maps.Copy(raw, tc.change)
			var p Provisioner
			err := p.Prepare(raw)
			if tc.want == nil {
				if err != nil {
					t.Fatal(err)
				}
				c := p.config
				if c.Kernel != DefaultKernel || c.Initrd != DefaultInitrd || c.OSRelease != DefaultOSRelease || c.ESP != DefaultESP ||
					c.Output != DefaultOutput || c.StagingDirectory != DefaultStagingDirectory || c.ExecuteCommand != DefaultExecuteCommand {
					t.Errorf("defaults not applied: %+v", c)
				}
				return
			}
			if err == nil {
				t.Fatalf("Prepare accepted %v", tc.change)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("Prepare error %q does not contain %q", err, w)
				}
			}
		})
	}
}

func TestOwnCmdline(t *testing.T) {
	for _, tc := range []struct{ proc, want, err string }{
		{proc: "BOOT_IMAGE=/boot/vmlinuz-6.1.0-28-cloud-amd64 root=PARTUUID=6d3a ro console=tty0 console=ttyS0,115200   earlyprintk=ttyS0,115200\n",
			want: "root=PARTUUID=6d3a ro console=tty0 console=ttyS0,115200 earlyprintk=ttyS0,115200"},
		{proc: "initrd=\\EFI\\debian\\initrd.img root=/dev/vda1 quiet -- init-arg\n", want: "root=/dev/vda1 quiet -- init-arg"},
		{proc: "BOOT_IMAGE=/vmlinuz\n", err: "is empty"},
		{proc: "root=/dev/vda1 ñ\n", err: "non-ASCII"},
	} {
		got, err := ownCmdline(tc.proc)
		if got != tc.want || (err == nil) != (tc.err == "") || (err != nil && !strings.Contains(err.Error(), tc.err)) {
			t.Errorf("ownCmdline(%q) = %q, %v; want %q, error containing %q", tc.proc, got, err, tc.want, tc.err)
		}
	}
}

// TestVerifiedRootScripts checks the shell of the verified root's scripts; TestAccQEMUImage runs them on a real machine and boots the result.
func TestVerifiedRootScripts(t *testing.T) {
	c := Config{StagingDirectory: DefaultStagingDirectory, ESP: DefaultESP, VerifiedRoot: &VerifiedRoot{Device: "/dev/vdb"}}
	scripts := map[string]string{"prepare": c.prepare(), "seal": c.seal(), "install": c.install("00")}
	for name, script := range scripts {
		cmd := exec.Command("sh", "-n")
		cmd.Stdin = strings.NewReader(script)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("%s is not valid sh: %v\n%s", name, err, out)
		}
	}
	// The bind of the machine's root must never be below what the scripts remove with rm -rf.
	if strings.HasPrefix(snapshotDir, c.StagingDirectory) || !strings.Contains(c.seal(), "rmdir \"$snapshot\"") {
		t.Errorf("the root's snapshot %s is below the staging directory or removed otherwise than by rmdir", snapshotDir)
	}
	if !strings.Contains(c.prepare(), verity.InitrdScript(c.ESP)) {
		t.Error("prepare does not run verity.InitrdScript for the machine's ESP")
	}
}

// hostCommunicator reaches this machine: commands run with sh, files are the paths given. With every
// option pointing into a directory that looks like a Debian root, Provision runs its real scripts.
type hostCommunicator struct{}

func (hostCommunicator) Start(ctx context.Context, rc *packersdk.RemoteCmd) error {
	cmd := exec.CommandContext(ctx, "sh", "-c", rc.Command)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = rc.Stdin, rc.Stdout, rc.Stderr
	if err := cmd.Start(); err != nil {
		return err
	}
	go func() {
		status := 0
		if err := cmd.Wait(); err != nil {
			var ee *exec.ExitError
			if !errors.As(err, &ee) {
				status = packersdk.CmdDisconnect
			} else {
				status = ee.ExitCode()
			}
		}
		rc.SetExited(status)
	}()
	return nil
}

func (hostCommunicator) Upload(dst string, r io.Reader, _ *os.FileInfo) error {
	data, err := io.ReadAll(r)
	if err != nil {
		return err
	}
	return os.WriteFile(dst, data, 0o644)
}

func (hostCommunicator) UploadDir(string, string, []string) error {
	return errors.New("not used by berth-uki-install")
}

func (hostCommunicator) Download(src string, w io.Writer) error {
	f, err := os.Open(src)
	if err != nil {
		return err
	}
	defer f.Close()
	_, err = io.Copy(w, f)
	return err
}

func (hostCommunicator) DownloadDir(string, string, []string) error {
	return errors.New("not used by berth-uki-install")
}

// debianRoot is a directory laid out as Debian keeps its boot files: versioned kernel and initrd in /boot
// with links to them in /, os-release a relative link, and an ESP directory.
type debianRoot struct {
	dir                       string
	kernel, initrd, osRelease []byte
}

func newDebianRoot(t *testing.T, kernel string) debianRoot {
	t.Helper()
	k, err := os.ReadFile(kernel)
	if err != nil {
		t.Fatal(err)
	}
	r := debianRoot{
		dir:       t.TempDir(),
		kernel:    k,
		initrd:    ukitest.Cpio("init", []byte("#!/bin/sh\n")),
		osRelease: []byte("PRETTY_NAME=\"Debian GNU/Linux 12 (bookworm)\"\nID=debian\nVERSION_ID=\"12\"\n"),
	}
	for name, data := range map[string][]byte{
		"boot/vmlinuz-6.1.0-28-cloud-amd64":    r.kernel,
		"boot/initrd.img-6.1.0-28-cloud-amd64": r.initrd,
		"usr/lib/os-release":                   r.osRelease,
	} {
		p := filepath.Join(r.dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for link, target := range map[string]string{
		"vmlinuz":        "boot/vmlinuz-6.1.0-28-cloud-amd64",
		"initrd.img":     "boot/initrd.img-6.1.0-28-cloud-amd64",
		"etc/os-release": "../usr/lib/os-release",
	} {
		p := filepath.Join(r.dir, link)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(target, p); err != nil {
			t.Fatal(err)
		}
	}
	for _, d := range []string{"boot/efi/EFI/debian", "tmp"} {
		if err := os.MkdirAll(filepath.Join(r.dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return r
}

// config points every path of the machine into the root.
func (r debianRoot) config(stub, output string) map[string]any {
	return map[string]any{
		"stub":              stub,
		"kernel":            filepath.Join(r.dir, "vmlinuz"),
		"initrd":            filepath.Join(r.dir, "initrd.img"),
		"os_release":        filepath.Join(r.dir, "etc/os-release"),
		"esp":               filepath.Join(r.dir, "boot/efi"),
		"staging_directory": filepath.Join(r.dir, "tmp/berth-uki-install"),
		"output":            output,
	}
}

// TestProvision installs a UKI made from Debian's real stub and kernel into a directory laid out as a
// Debian root, through real sh scripts, and checks that the installed UKI is made of the machine's files
// and that berth-manifest, given the output, records the prediction of the installed UKI.
func TestProvision(t *testing.T) {
	parts := ukitest.BootParts(t)
	procCmdline, err := os.ReadFile("/proc/cmdline")
	if err != nil {
		t.Fatal(err)
	}
	ownLine, err := ownCmdline(string(procCmdline))
	if err != nil {
		t.Skipf("this machine's own command line cannot be embedded: %v", err)
	}
	for _, tc := range []struct{ name, cmdline, want string }{
		{"configured cmdline", "root=PARTUUID=6d3a ro console=ttyS0,115200", "root=PARTUUID=6d3a ro console=ttyS0,115200"},
		{"the machine's cmdline", "", ownLine},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := newDebianRoot(t, parts.Kernel)
			output := filepath.Join(t.TempDir(), "out", "berth.efi")
			raw := root.config(parts.Stub, output)
			if tc.cmdline != "" {
				raw["cmdline"] = tc.cmdline
			}
			var p Provisioner
			if err := p.Prepare(raw); err != nil {
				t.Fatal(err)
			}
			if err := p.Provision(context.Background(), packersdk.TestUi(t), hostCommunicator{}, nil); err != nil {
				t.Fatal(err)
			}
			installed := filepath.Join(root.dir, "boot/efi/EFI/BOOT/BOOTX64.EFI")
			got, err := os.ReadFile(installed)
			if err != nil {
				t.Fatal(err)
			}
			if want, _ := os.ReadFile(output); !bytes.Equal(got, want) {
				t.Fatalf("the installed UKI (%d bytes) differs from output (%d bytes)", len(got), len(want))
			}
			checkSections(t, installed, map[string][]byte{
				".osrel": root.osRelease, ".cmdline": []byte(tc.want), ".linux": root.kernel, ".initrd": root.initrd,
			})
			if _, err := os.Stat(filepath.Join(root.dir, "tmp/berth-uki-install")); err == nil {
				t.Error("the staging directory was left behind")
			}
			checkManifest(t, installed, output)
		})
	}
}

// checkSections compares the UKI's sections with what they should hold.
func checkSections(t *testing.T, uki string, want map[string][]byte) {
	t.Helper()
	f, err := pe.Open(uki)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for name, data := range want {
		s := f.Section(name)
		if s == nil {
			t.Errorf("the UKI has no %s section", name)
			continue
		}
		got, err := s.Data()
		if err != nil {
			t.Fatal(err)
		}
		if got = got[:min(len(got), int(s.VirtualSize))]; !bytes.Equal(got, data) {
			t.Errorf("section %s holds %d bytes that differ from the machine's %d", name, len(got), len(data))
		}
	}
}

// checkManifest runs berth-manifest as an amazon-ebs build would (uki = output) and compares its entry
// with the prediction of the installed UKI.
func checkManifest(t *testing.T, installed, output string) {
	t.Helper()
	want, err := measure.PredictFile(installed)
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "berth-image.json")
	var pp manifest.PostProcessor
	if err := pp.Configure(map[string]any{"image_name": "berth-node-aws", "output": out, "uki": output, "packer_builder_type": "amazon-ebs"}); err != nil {
		t.Fatal(err)
	}
	if _, _, _, err := pp.PostProcess(context.Background(), packersdk.TestUi(t), amiArtifact("eu-central-1:ami-0123456789abcdef0")); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	m, err := imagemanifest.Parse(data)
	if err != nil {
		t.Fatal(err)
	}
	img, _ := m.Image("berth-node-aws")
	if img.ArtifactID != "ami-0123456789abcdef0" || img.Region != "eu-central-1" {
		t.Errorf("manifest entry %+v, want the AMI in eu-central-1", img)
	}
	if len(img.PCRs) != len(want.PCRs) {
		t.Fatalf("manifest PCRs %v, want %d", img.PCRs, len(want.PCRs))
	}
	for i, d := range want.PCRs {
		if got := img.PCRs[fmt.Sprint(i)]; got != hex.EncodeToString(d[:]) {
			t.Errorf("PCR %d: manifest %s, installed UKI %s", i, got, d)
		}
	}
}

// amiArtifact is amazon-ebs's artifact as post-processors see it: an id and no files.
type amiArtifact string

func (a amiArtifact) BuilderId() string { return "mitchellh.amazonebs" }
func (a amiArtifact) Files() []string   { return nil }
func (a amiArtifact) Id() string        { return string(a) }
func (a amiArtifact) String() string    { return string(a) }
func (a amiArtifact) State(string) any  { return nil }
func (a amiArtifact) Destroy() error    { return nil }

// TestProvisionFails checks that a machine without the kernel, or without the ESP, fails the build with
// the reason, leaves no staging directory and installs nothing.
func TestProvisionFails(t *testing.T) {
	parts := ukitest.BootParts(t)
	for _, tc := range []struct {
		name   string
		change func(root debianRoot, raw map[string]any)
		want   string
	}{
		{"no kernel", func(root debianRoot, _ map[string]any) {
			os.Remove(filepath.Join(root.dir, "boot/vmlinuz-6.1.0-28-cloud-amd64"))
		},
			"kernel " + "%s/vmlinuz is not a regular file on this machine"},
		{"no ESP", func(root debianRoot, raw map[string]any) { raw["esp"] = filepath.Join(root.dir, "efi") },
			"the EFI system partition %s/efi is not a directory on this machine"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := newDebianRoot(t, parts.Kernel)
			raw := root.config(parts.Stub, filepath.Join(t.TempDir(), "berth.efi"))
			raw["cmdline"] = "root=/dev/nvme0n1p1"
			tc.change(root, raw)
			var p Provisioner
			if err := p.Prepare(raw); err != nil {
				t.Fatal(err)
			}
			err := p.Provision(context.Background(), packersdk.TestUi(t), hostCommunicator{}, nil)
			if want := fmt.Sprintf(tc.want, root.dir); err == nil || !strings.Contains(err.Error(), want) {
				t.Fatalf("Provision = %v, want an error containing %q", err, want)
			}
			if _, err := os.Stat(filepath.Join(root.dir, "tmp/berth-uki-install")); err == nil {
				t.Error("the staging directory was left behind")
			}
			if _, err := os.Stat(filepath.Join(root.dir, "boot/efi/EFI/BOOT/BOOTX64.EFI")); err == nil {
				t.Error("a UKI was installed")
			}
		})
	}
}

func TestNoCommunicator(t *testing.T) {
	err := (&Provisioner{}).Provision(context.Background(), packersdk.TestUi(t), nil, nil)
	if err == nil || !strings.Contains(err.Error(), "no communicator") {
		t.Errorf("Provision without a communicator = %v", err)
	}
}

// TestDocsListEveryOption keeps the hand-written documentation in step with Config: every option of the
// HCL2 spec that packer-sdc generates is documented, and nothing else is.
func TestDocsListEveryOption(t *testing.T) {
	packertest.DocumentsEveryOption(t, "packer/docs/provisioners/uki-install.mdx", (&Provisioner{}).ConfigSpec())
}
