// Package repotest finds the repository from a test and runs the repository's scripts that build or fetch
// a tool into a cache and print its directory on their last line (scripts/build-k8s.sh,
// scripts/boot-parts.sh, …), so that each test harness does not locate the tree its own way.
package repotest

import (
	"bytes"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// Root is the repository's root directory.
func Root(t testing.TB) string {
	t.Helper()
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		t.Fatal("repotest: cannot locate its own source file to find the repository")
	}
	return filepath.Join(filepath.Dir(file), "..", "..")
}

// Script runs scripts/<name> and returns the last line it printed, the directory of what it made; needs
// says what the script needs, for the failure message. The script's progress goes to stderr as it runs
// (a cold build takes minutes) and is repeated in the failure.
func Script(t testing.TB, name, needs string) string {
	t.Helper()
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
// scripts/<script> prints.
func BinDir(t testing.TB, env, script, needs string) string {
	t.Helper()
	if dir := os.Getenv(env); dir != "" {
		return dir
	}
	return Script(t, script, needs)
}
