package agent

import (
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	packersdk "github.com/hashicorp/packer-plugin-sdk/packer"
)

// localComm is a communicator whose machine is this one: commands run with /bin/sh -c and PATH set to
// path, uploads are written where they are sent. An upload to a path ending in corrupt has its first byte
// flipped, as a faulty transfer would.
type localComm struct {
	path    string
	corrupt string
}

func (c *localComm) Start(ctx context.Context, rc *packersdk.RemoteCmd) error {
	cmd := exec.CommandContext(ctx, "/bin/sh", "-c", rc.Command)
	cmd.Env = append(os.Environ(), "PATH="+c.path)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = rc.Stdin, rc.Stdout, rc.Stderr
	if err := cmd.Start(); err != nil {
		return err
	}
	go func() {
		status := 0
		var exit *exec.ExitError
		switch err := cmd.Wait(); {
		case errors.As(err, &exit):
			status = exit.ExitCode()
		case err != nil:
			status = 255
		}
		rc.SetExited(status)
	}()
	return nil
}

func (c *localComm) Upload(path string, r io.Reader, _ *os.FileInfo) error {
	data, err := io.ReadAll(r)
	if err != nil {
		return err
	}
	if c.corrupt != "" && strings.HasSuffix(path, c.corrupt) {
		data[0] ^= 0xff
	}
	return os.WriteFile(path, data, 0o644)
}

func (c *localComm) UploadDir(string, string, []string) error {
	return errors.New("the provisioner uploads files only")
}

func (c *localComm) Download(string, io.Writer) error {
	return errors.New("the provisioner downloads nothing")
}

func (c *localComm) DownloadDir(string, string, []string) error {
	return errors.New("the provisioner downloads nothing")
}

// scriptTools are what the install script and execute_command run besides sh's builtins.
var scriptTools = []string{"sh", "sha256sum", "install", "mkdir", "chmod", "ln", "rm"}

// pathWithout is a PATH of a new directory holding links to the script's tools only: no systemctl.
func pathWithout(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	for _, tool := range scriptTools {
		p, err := exec.LookPath(tool)
		if err != nil {
			t.Fatalf("%s not found: the install script runs it on the image's side (coreutils, dash)", tool)
		}
		if err := os.Symlink(p, filepath.Join(dir, tool)); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// realProvisioner is a provisioner of contents whose staging directory and install prefix are new
// directories of this machine.
func realProvisioner(t *testing.T) (p *Provisioner, prefix, staging string, src map[string]string) {
	t.Helper()
	src = sources(t, contents)
	dir := t.TempDir()
	prefix, staging = filepath.Join(dir, "root"), filepath.Join(dir, "staging")
	raw := validConfig(src)
	raw["install_prefix"] = prefix
	raw["staging_directory"] = staging
	p = &Provisioner{}
	if err := p.Prepare(raw); err != nil {
		t.Fatal(err)
	}
	return p, prefix, staging, src
}

// TestInstallScriptRunsInRealShell provisions this machine through a communicator of real commands: the
// install script runs with /bin/sh, the real sha256sum, install and, where it is on PATH, systemctl, into
// a directory standing for the image's root. The installed unit passes systemd-analyze verify there, which
// also proves the agent is executable where the unit starts it.
func TestInstallScriptRunsInRealShell(t *testing.T) {
	for _, tc := range []struct {
		name      string
		systemctl bool
	}{
		{"systemctl enables", true},
		{"without systemctl the script links", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := os.Getenv("PATH")
			if tc.systemctl {
				if _, err := exec.LookPath("systemctl"); err != nil {
					t.Fatal("systemctl not found: this case runs systemctl --root enable (Debian package systemd)")
				}
			} else {
				path = pathWithout(t)
			}
			p, prefix, staging, src := realProvisioner(t)
			if err := p.Provision(context.Background(), packersdk.TestUi(t), &localComm{path: path}, nil); err != nil {
				t.Fatal(err)
			}

			for _, f := range []struct {
				dest string
				data []byte
				mode fs.FileMode
			}{
				{AgentPath, []byte(contents["berth-agent"]), 0o755},
				{UnitPath, unit, 0o644},
				{AgentConfigPath, []byte(contents["agent.yaml"]), 0o600},
				{ContainerdConfigPath, []byte(contents["containerd.toml"]), 0o644},
				{"/usr/bin/kubelet", []byte(contents["kubelet"]), 0o750},
				{"/usr/bin/kubeadm", []byte(contents["kubeadm"]), 0o755},
			} {
				p := filepath.Join(prefix, f.dest)
				data, err := os.ReadFile(p)
				if err != nil {
					t.Errorf("%s was not installed: %v", f.dest, err)
					continue
				}
				if !bytes.Equal(data, f.data) {
					t.Errorf("%s holds %q, want %q", f.dest, data, f.data)
				}
				if fi, err := os.Lstat(p); err != nil || fi.Mode() != f.mode {
					t.Errorf("%s has mode %v (%v), want %v", f.dest, fi.Mode(), err, f.mode)
				}
			}
			if target, err := os.Readlink(filepath.Join(prefix, WantsLink)); err != nil || target != UnitPath {
				t.Errorf("%s links to %q (%v), want %s", WantsLink, target, err, UnitPath)
			}
			if _, err := os.Stat(staging); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("the staging directory is left behind: %v", err)
			}
			if _, err := os.Stat(src["kubelet"]); err != nil {
				t.Errorf("a local source is gone: %v", err)
			}
			verifyUnit(t, prefix)
		})
	}
}

// verifyUnit runs systemd-analyze verify on the installed unit, with the host's system units (targets)
// copied into the root: it fails on unknown keys, bad values and an ExecStart that is not executable.
func verifyUnit(t *testing.T, root string) {
	t.Helper()
	analyze, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Fatal("systemd-analyze not found: the test verifies the agent's unit with it (Debian package systemd)")
	}
	units := filepath.Join(root, "usr/lib/systemd")
	if err := os.MkdirAll(units, 0o755); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("cp", "-a", "/usr/lib/systemd/system", units).CombinedOutput(); err != nil {
		t.Fatalf("copying the host's systemd units: %v\n%s", err, out)
	}
	out, err := exec.Command(analyze, "verify", "--root="+root, UnitPath).CombinedOutput()
	if err != nil || len(out) > 0 {
		t.Errorf("systemd-analyze verify %s: %v\n%s", UnitName, err, out)
	}
}

// TestInstallScriptRefusals runs the install script for real where it must refuse: nothing is installed,
// the unit is not enabled, and the staging directory is removed all the same.
func TestInstallScriptRefusals(t *testing.T) {
	for _, tc := range []struct {
		name    string
		corrupt string // the staged file corrupted on its way
		dir     string // a directory in the image where a file goes
		want    []string
	}{
		{
			name:    "a file corrupted in the upload",
			corrupt: "/04-kubelet",
			want:    []string{"04-kubelet: FAILED", "differs from the one checked before its upload", "exited with status 1"},
		},
		{
			name: "a directory where a file goes",
			dir:  "/usr/bin/kubeadm",
			want: []string{"/usr/bin/kubeadm is a directory in the image", "exited with status 1"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, prefix, staging, _ := realProvisioner(t)
			if tc.dir != "" {
				if err := os.MkdirAll(filepath.Join(prefix, tc.dir), 0o755); err != nil {
					t.Fatal(err)
				}
			}
			comm := &localComm{path: pathWithout(t), corrupt: tc.corrupt}
			err := p.Provision(context.Background(), packersdk.TestUi(t), comm, nil)
			if err == nil {
				t.Fatal("the build went on")
			}
			for _, want := range tc.want {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q lacks %q", err, want)
				}
			}
			if _, err := os.Stat(staging); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("the staging directory is left behind: %v", err)
			}
			for _, dest := range []string{AgentPath, UnitPath, "/usr/bin/kubelet", WantsLink} {
				if _, err := os.Lstat(filepath.Join(prefix, dest)); !errors.Is(err, fs.ErrNotExist) {
					t.Errorf("%s is in the image after a refusal: %v", dest, err)
				}
			}
		})
	}
}
