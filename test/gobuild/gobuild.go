// Package gobuild builds the repository's programs for tests and for the lab the way scripts/release.sh
// builds a release: without cgo and with -trimpath. Both settings are part of the key under which Go caches
// every compiled package, so one configuration for every binary a run of make test builds outside the race
// detector (the release test's, the lab's agent and images, the storm's agents, the acceptance tests'
// provider and plugin, the guest's init) compiles the module and its dependencies once instead of once per
// configuration; on a cold build cache each extra configuration cost minutes. The binaries carry no cgo, so
// they also run in a guest image without the host's libc.
package gobuild

import (
	"context"
	"fmt"
	"os"
	"os/exec"
)

// Build builds the package pkg (an import path, or a path relative to dir) into out, with the build tags
// tags ("" for none), running go in dir. Symbols and debug information are stripped: only the link differs,
// which Go does not cache anyway.
func Build(ctx context.Context, dir, pkg, out, tags string) error {
	args := []string{"build", "-trimpath", "-ldflags=-s -w", "-o", out}
	if tags != "" {
		args = append(args, "-tags", tags)
	}
	cmd := exec.CommandContext(ctx, "go", append(args, pkg)...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if msg, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build %s: %w\n%s", pkg, err, msg)
	}
	return nil
}
