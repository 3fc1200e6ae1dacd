// Package packertest sets up the plugin's acceptance tests: the real packer (make packer-tools, found through
// BERTH_PACKER_BIN or PATH) with this tree's plugin installed where `packer init` finds it without network;
// the check, shared by the components' unit tests, that their documentation lists exactly their options; and
// the checks of a baked node image's verified root, whichever builder made it (noderoot.go).
package packertest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/berthlabs/berth/internal/repotest"
	"github.com/hashicorp/hcl/v2/hcldec"
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
	bin := repotest.BuildBinary(t, "./packer/cmd/packer-plugin-berth", "")
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

// DocumentsEveryOption fails t unless the hand-written page (relative to the repository) documents every
// option of spec, in lines that start with "- `option`", and nothing else; packer-sdc generates spec from
// the component's Config, so the page cannot drift from it.
func DocumentsEveryOption(t *testing.T, page string, spec hcldec.ObjectSpec) {
	t.Helper()
	doc, err := os.ReadFile(filepath.Join(repotest.Root(t), page))
	if err != nil {
		t.Fatal(err)
	}
	documented := map[string]bool{}
	for _, line := range strings.Split(string(doc), "\n") {
		if name, ok := strings.CutPrefix(line, "- `"); ok {
			name, _, _ = strings.Cut(name, "`")
			documented[name] = true
		}
	}
	for name := range spec {
		if strings.HasPrefix(name, "packer_") {
			continue
		}
		if !documented[name] {
			t.Errorf("option %s is not documented in %s", name, page)
		}
		delete(documented, name)
	}
	for name := range documented {
		t.Errorf("%s documents %s, which is no option", page, name)
	}
}
