package provider

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"testing"

	"github.com/berthlabs/berth/test/gobuild"
)

var built struct {
	once sync.Once
	dir  string // holds terraform-provider-berth
	err  error
}

// providerDir builds the provider binary once per test run and returns the directory that holds it.
func providerDir(t *testing.T) string {
	t.Helper()
	built.once.Do(func() {
		dir := filepath.Join(testDir, "bin")
		if err := gobuild.Build(context.Background(), "", "github.com/berthlabs/berth", filepath.Join(dir, "terraform-provider-berth"), ""); err != nil {
			built.err = fmt.Errorf("building the provider: %w", err)
			return
		}
		built.dir = dir
	})
	if built.err != nil {
		t.Fatal(built.err)
	}
	return built.dir
}

// devOverrides returns a Terraform CLI configuration whose dev_overrides make terraform run the built
// binary for berthlabs/berth, as it would an installed release. terraform init refuses such a provider.
func devOverrides(t *testing.T) string {
	t.Helper()
	return writeCLIConfig(t, fmt.Sprintf("provider_installation {\n  dev_overrides {\n    \"berthlabs/berth\" = %q\n  }\n  direct {}\n}\n", providerDir(t)))
}

// mirrorVersion is the version under which providerMirror offers the built binary.
const mirrorVersion = "0.0.1"

// providerMirror returns a Terraform CLI configuration whose filesystem mirror offers the built binary as
// berthlabs/berth, so that terraform init installs it as it would a release. Unlike a provider served
// in-process (one server for all of a configuration's provider blocks), terraform then starts a process
// for each provider configuration, as it does for users.
func providerMirror(t *testing.T) string {
	t.Helper()
	mirror := t.TempDir()
	// The unpacked layout: HOSTNAME/NAMESPACE/TYPE/VERSION/TARGET/terraform-provider-TYPE_vVERSION.
	target := filepath.Join(mirror, "registry.terraform.io", "berthlabs", "berth", mirrorVersion, runtime.GOOS+"_"+runtime.GOARCH)
	if err := os.MkdirAll(target, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(providerDir(t), "terraform-provider-berth"), filepath.Join(target, "terraform-provider-berth_v"+mirrorVersion)); err != nil {
		t.Fatal(err)
	}
	return writeCLIConfig(t, fmt.Sprintf(`provider_installation {
  filesystem_mirror {
    path    = %q
    include = ["registry.terraform.io/berthlabs/berth"]
  }
  direct {
    exclude = ["registry.terraform.io/berthlabs/berth"]
  }
}
`, mirror))
}

// writeCLIConfig writes a Terraform CLI configuration into the test's temporary directory.
func writeCLIConfig(t *testing.T, conf string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "terraform.tfrc")
	if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// runTerraform runs the terraform CLI in dir against the built provider and returns what it printed.
func runTerraform(t *testing.T, dir string, args ...string) (stdout, stderr []byte) {
	t.Helper()
	cmd := exec.Command(os.Getenv("TF_ACC_TERRAFORM_PATH"), args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "TF_CLI_CONFIG_FILE="+devOverrides(t), "TF_IN_AUTOMATION=1")
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	if err := cmd.Run(); err != nil {
		t.Fatalf("terraform %s: %v\n%s\n%s", args[0], err, out.Bytes(), errOut.Bytes())
	}
	return out.Bytes(), errOut.Bytes()
}
