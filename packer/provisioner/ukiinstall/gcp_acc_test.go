package ukiinstall

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hashicorp/packer-plugin-sdk/acctest"

	"github.com/berthlabs/berth/internal/repotest"
	"github.com/berthlabs/berth/internal/uki/ukitest"
	"github.com/berthlabs/berth/test/packertest"
)

// TestAccGCPTemplateValidates runs packer validate on examples/packer/gcp.pkr.hcl with the real packer, the
// real Google Compute plugin (packer-plugin-googlecompute v1.1.6 built from its module by
// scripts/build-packer-googlecompute.sh) and this plugin: every block's options are checked by the
// component's own Prepare. Packer runs in a network namespace of its own with nothing but loopback, so
// validation needs no Google credentials, project or API: it reached nothing else. A missing stub fails
// validation naming berth-uki-install's option, and an empty project_id naming googlecompute's, so both
// plugins did run.
func TestAccGCPTemplateValidates(t *testing.T) {
	if os.Getenv(acctest.TestEnvVar) == "" {
		t.Skipf("acceptance test with the real packer: make testacc-packer runs it (%s=1)", acctest.TestEnvVar)
	}
	packertest.Setup(t)
	addPlugin(t, "googlecompute", "BERTH_PACKER_GOOGLECOMPUTE_PLUGINS")
	parts := ukitest.BootParts(t)
	agent := filepath.Join(t.TempDir(), "berth-agent")
	if err := os.WriteFile(agent, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	// No credentials from this machine's environment or gcloud configuration reach packer.
	for _, env := range []string{"GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_OAUTH_ACCESS_TOKEN", "CLOUDSDK_CONFIG", "GCE_METADATA_HOST"} {
		t.Setenv(env, "")
	}
	t.Setenv("HOME", t.TempDir())
	packer := func(args ...string) (string, error) { return runPackerOffline(t, args...) }
	if out, err := packer("init", "gcp.pkr.hcl"); err != nil {
		t.Fatalf("packer init gcp.pkr.hcl: %v\n%s", err, out)
	}
	vars := func(project, stub string) []string {
		return []string{"-var", "project_id=" + project, "-var", "stub=" + stub, "-var", "agent_binary=" + agent}
	}
	if out, err := packer(append(append([]string{"validate"}, vars("berth-build", parts.Stub)...), "gcp.pkr.hcl")...); err != nil {
		t.Fatalf("packer validate gcp.pkr.hcl: %v\n%s", err, out)
	}
	for _, tc := range []struct {
		name       string
		args       []string
		block, msg string
	}{
		{"a missing stub", vars("berth-build", parts.Stub+".missing"), `"berth-uki-install"`, "stub: stat "},
		// googlecompute names no block, only the line of its source block.
		{"no project", vars("", parts.Stub), `source "googlecompute" "node"`, "a project_id must be specified"},
	} {
		out, err := packer(append(append([]string{"validate"}, tc.args...), "gcp.pkr.hcl")...)
		// Packer wraps its messages: compare them with their lines joined.
		flat := strings.Join(strings.Fields(out), " ")
		if line := sourceLine(t, tc.block); line != "" {
			tc.block = line
		}
		if err == nil || !strings.Contains(flat, tc.block) || !strings.Contains(flat, tc.msg) {
			t.Errorf("packer validate with %s: %v\n%s", tc.name, err, out)
		}
	}
}

// runPackerOffline runs the packer on PATH in examples/packer, as runPacker does, in a network namespace
// whose only interface is loopback: a new one as root, or one of a new user namespace otherwise.
func runPackerOffline(t *testing.T, args ...string) (string, error) {
	t.Helper()
	packer, err := exec.LookPath("packer")
	if err != nil {
		t.Fatal(err)
	}
	unshare := []string{"--net"}
	if os.Geteuid() != 0 {
		unshare = []string{"--user", "--map-root-user", "--net"}
	}
	// ip is only in /usr/sbin on Debian, which a non-root PATH may leave out.
	script := `PATH=$PATH:/usr/sbin:/sbin; ip link set lo up && exec "$@"`
	cmd := exec.Command("unshare", append(append(unshare, "--", "sh", "-c", script, "sh", packer), args...)...)
	cmd.Dir = filepath.Join(repotest.Root(t), "examples", "packer")
	out, err := cmd.CombinedOutput()
	if err != nil && strings.Contains(string(out), "unshare failed") {
		t.Fatalf("no network namespace for packer (make testacc-packer runs as root): %s", out)
	}
	return string(out), err
}

// sourceLine is "on gcp.pkr.hcl line N:" for the line of examples/packer/gcp.pkr.hcl that starts with
// prefix, where Packer reports a builder's errors; "" when prefix is no such line's start.
func sourceLine(t *testing.T, prefix string) string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(repotest.Root(t), "examples", "packer", "gcp.pkr.hcl"))
	if err != nil {
		t.Fatal(err)
	}
	for i, line := range strings.Split(string(data), "\n") {
		if strings.HasPrefix(line, prefix) {
			return fmt.Sprintf("on gcp.pkr.hcl line %d:", i+1)
		}
	}
	return ""
}
