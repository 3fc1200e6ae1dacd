// Package packertest sets up the plugin's acceptance tests: the real packer (make packer-tools, found through
// BERTH_PACKER_BIN or PATH) with this tree's plugin installed where `packer init` finds it without network.
package packertest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/berthlabs/berth/internal/repotest"
)

// Setup builds and installs the plugin for t and points packer at it; it returns the plugin's version,
// which templates pin in required_plugins.
func Setup(t *testing.T) string {
	t.Helper()
	if bin := os.Getenv("BERTH_PACKER_BIN"); bin != "" {
		t.Setenv("PATH", bin+string(os.PathListSeparator)+os.Getenv("PATH"))
	}
	if _, err := exec.LookPath("packer"); err != nil {
		t.Fatal("packer not found: make testacc-packer builds it (make packer-tools) and sets BERTH_PACKER_BIN")
	}
	bin := repotest.BuildBinary(t, "./packer/cmd/packer-plugin-berth", repotest.Build{})
	dir := t.TempDir()
	script := filepath.Join(repotest.Root(t), "scripts", "install-packer-plugin.sh")
	out, err := exec.Command(script, bin, dir).CombinedOutput()
	if err != nil {
		t.Fatalf("installing the plugin: %v\n%s", err, out)
	}
	name := filepath.Base(strings.TrimSpace(string(out)))
	version, _, ok := strings.Cut(strings.TrimPrefix(name, "packer-plugin-berth_v"), "_")
	if !ok {
		t.Fatalf("the plugin was installed as %s, not packer-plugin-berth_v<version>_...", name)
	}
	t.Setenv("PACKER_PLUGIN_PATH", dir)
	t.Setenv("CHECKPOINT_DISABLE", "1")
	return version
}

// ExitedZero is an acctest check that what (packer init, packer build) succeeded; it shows the end of the
// log when not.
func ExitedZero(what string) func(*exec.Cmd, string) error {
	return func(cmd *exec.Cmd, logfile string) error {
		if cmd.ProcessState == nil || cmd.ProcessState.ExitCode() != 0 {
			log, _ := os.ReadFile(logfile)
			lines := strings.Split(strings.TrimRight(string(log), "\n"), "\n")
			return fmt.Errorf("%s failed:\n%s", what, strings.Join(lines[max(0, len(lines)-40):], "\n"))
		}
		return nil
	}
}
