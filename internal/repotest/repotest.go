// Package repotest is the one place tests learn about their environment, as Go's internal/testenv is for
// the standard library: where the repository is, which Kubernetes version the harnesses run, how to build
// one of the repository's programs for a test, and what a test needs (root, tools on PATH, tools that the
// repository's scripts build into a cache) — so that `make short` can skip by one rule what needs root or
// a cluster, and `make test` fails with the step that installs what is missing.
package repotest

import (
	"bytes"
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/berthlabs/berth/test/gobuild"
)

// KubernetesVersion is the Kubernetes release that scripts/build-k8s.sh builds (test/k8stools/go.mod pins
// its modules) and that every harness runs and writes into configurations.
const KubernetesVersion = "v1.36.3"

// Root is the repository's root directory.
func Root(t testing.TB) string {
	t.Helper()
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		t.Fatal("repotest: cannot locate its own source file to find the repository")
	}
	return filepath.Join(filepath.Dir(file), "..", "..")
}

// NeedsRoot skips t under -short and fails it unless it runs as root; why says what root is for. make test
// runs as root, so outside -short a missing privilege is a failure, not a silent skip.
func NeedsRoot(t testing.TB, why string) {
	t.Helper()
	if testing.Short() {
		t.Skipf("needs root (%s): not run with -short", why)
	}
	if os.Geteuid() != 0 {
		t.Fatalf("needs root: %s (run make test as root)", why)
	}
}

// NeedsTools fails t when a command is not on PATH, naming the script that installs it. Under -short it
// skips t instead: make short installs nothing, so a machine that never ran make deps still gets a green
// edit-test loop of everything else.
func NeedsTools(t testing.TB, tools ...string) {
	t.Helper()
	var missing []string
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			missing = append(missing, tool)
		}
	}
	if len(missing) == 0 {
		return
	}
	if testing.Short() {
		t.Skipf("not on PATH: %s (scripts/install-deps.sh installs them): not run with -short", strings.Join(missing, ", "))
	}
	t.Fatalf("not on PATH: %s (scripts/install-deps.sh installs them)", strings.Join(missing, ", "))
}

// Script runs scripts/<name> and returns the last line it printed, the directory of what it made; needs
// says what the script needs, for the failure message. The script's progress goes to stderr as it runs
// (a cold build takes minutes) and is repeated in the failure. Under -short the test is skipped: these
// scripts build or fetch tools (Kubernetes, CFSSL, Packer, boot parts) and take minutes on a cold machine.
func Script(t testing.TB, name, needs string) string {
	t.Helper()
	if testing.Short() {
		t.Skipf("needs what scripts/%s makes: not run with -short", name)
	}
	var stdout, stderr bytes.Buffer
	cmd := exec.Command(filepath.Join(Root(t), "scripts", name))
	cmd.Stdout, cmd.Stderr = &stdout, io.MultiWriter(&stderr, os.Stderr)
	if err := cmd.Run(); err != nil {
		t.Fatalf("scripts/%s failed (%s): %v\n%s", name, needs, err, stderr.String())
	}
	lines := strings.Split(strings.TrimSpace(stdout.String()), "\n")
	return lines[len(lines)-1]
}

// BinDir is the directory named by the environment variable env, as make sets it, or else what
// scripts/<script> prints. Under -short the test is skipped either way: what it needs is a cluster or a
// tool run, not a unit.
func BinDir(t testing.TB, env, script, needs string) string {
	t.Helper()
	if testing.Short() {
		t.Skipf("needs what scripts/%s makes: not run with -short", script)
	}
	if dir := os.Getenv(env); dir != "" {
		return dir
	}
	return Script(t, script, needs)
}

// BuildBinary builds the repository's package pkg (a path from the module root, such as
// "./nodeagent/cmd/berth-agent") with the build tags tags ("" for none) into a directory of the test's and
// returns the binary's path. It builds as a release does (test/gobuild), so the build shares its compiled
// packages with every other test's.
func BuildBinary(t testing.TB, pkg, tags string) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), filepath.Base(pkg))
	if err := gobuild.Build(context.Background(), Root(t), pkg, out, tags); err != nil {
		t.Fatal(err)
	}
	return out
}

// MarkdownBlock returns the one fenced code block of the repository's Markdown file doc (a path from the
// root) that holds marker, without its fences, so that a test runs what the documentation tells users to
// write and the two cannot drift apart.
func MarkdownBlock(t testing.TB, doc, marker string) []byte {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(Root(t), doc))
	if err != nil {
		t.Fatal(err)
	}
	var found [][]byte
	for i, part := range bytes.Split(data, []byte("\n```")) {
		// Odd parts are the blocks, each starting with its info string's line.
		if i%2 == 0 {
			continue
		}
		_, body, _ := bytes.Cut(part, []byte("\n"))
		if bytes.Contains(body, []byte(marker)) {
			found = append(found, body)
		}
	}
	if len(found) != 1 {
		t.Fatalf("%s has %d code blocks with %q, want exactly one", doc, len(found), marker)
	}
	return found[0]
}
