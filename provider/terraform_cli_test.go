package provider

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
)

var built struct {
	once    sync.Once
	cliConf string
	err     error
}

// devOverrides builds the provider binary once per test run and returns a Terraform CLI configuration
// whose dev_overrides make terraform run that binary for berthlabs/berth, as it would an installed release.
func devOverrides(t *testing.T) string {
	t.Helper()
	built.once.Do(func() {
		dir := filepath.Join(testDir, "bin")
		goTool, err := exec.LookPath("go")
		if err != nil {
			built.err = fmt.Errorf("go not found on PATH: %w", err)
			return
		}
		build := exec.Command(goTool, "build", "-o", filepath.Join(dir, "terraform-provider-berth"), "github.com/berthlabs/berth")
		if out, err := build.CombinedOutput(); err != nil {
			built.err = fmt.Errorf("building the provider: %w\n%s", err, out)
			return
		}
		built.cliConf = filepath.Join(dir, "dev.tfrc")
		conf := fmt.Sprintf("provider_installation {\n  dev_overrides {\n    \"berthlabs/berth\" = %q\n  }\n  direct {}\n}\n", dir)
		built.err = os.WriteFile(built.cliConf, []byte(conf), 0o600)
	})
	if built.err != nil {
		t.Fatal(built.err)
	}
	return built.cliConf
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
