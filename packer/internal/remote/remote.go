// Package remote is what Berth's provisioners share for working on the machine being built through Packer's
// communicator: running a command with its output shown and kept for the error, quoting for sh, and the
// checks of the paths a provisioner writes to or runs from, and the files it uploads.
package remote

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path"
	"regexp"
	"slices"
	"strings"
	"sync"
	"unicode"

	packersdk "github.com/hashicorp/packer-plugin-sdk/packer"
	"github.com/hashicorp/packer-plugin-sdk/template/interpolate"
)

// Run runs a command through the communicator, shows its output as it comes, and returns an error carrying
// that output if the command fails.
func Run(ctx context.Context, ui packersdk.Ui, comm packersdk.Communicator, command string) error {
	var out lockedBuffer
	cmd := &packersdk.RemoteCmd{Command: command, Stdout: &out, Stderr: &out}
	if err := cmd.RunWithUi(ctx, comm, ui); err != nil {
		return fmt.Errorf("running %s: %w", command, err)
	}
	switch status := cmd.ExitStatus(); status {
	case 0:
		return nil
	case packersdk.CmdDisconnect:
		return fmt.Errorf("%s: the remote side disconnected", command)
	default:
		return fmt.Errorf("%s exited with status %d:\n%s", command, status, strings.TrimSpace(out.String()))
	}
}

// lockedBuffer collects a command's stdout and stderr, which communicators write from two goroutines.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// Quote makes s one word for sh, whatever it holds.
func Quote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'"'"'`) + "'"
}

// CheckAbsolute accepts only clean absolute paths, so that what the build's output shows is the path used.
func CheckAbsolute(p string) error {
	switch {
	case !path.IsAbs(p):
		return fmt.Errorf("%q is not an absolute path", p)
	case slices.Contains(strings.Split(p, "/"), ".."):
		return fmt.Errorf("%q contains ..", p)
	case strings.IndexFunc(p, unicode.IsControl) >= 0:
		return fmt.Errorf("%q contains a control character", p)
	case path.Clean(p) != p:
		return fmt.Errorf("%q is not a clean path: write %q", p, path.Clean(p))
	}
	return nil
}

// stagingChars are what a staging directory may hold: execute_command puts a script's path between quotes
// of the user's choosing.
var stagingChars = regexp.MustCompile(`^[A-Za-z0-9._+/-]+$`)

// CheckStaging accepts a staging directory: absolute, removable afterwards, and safe inside any quotes.
func CheckStaging(p string) error {
	if err := CheckAbsolute(p); err != nil {
		return err
	}
	if p == "/" {
		return errors.New("the staging directory is removed afterwards: / cannot be it")
	}
	if !stagingChars.MatchString(p) {
		return fmt.Errorf("%q: only letters, digits and . _ + - / please, as execute_command quotes it", p)
	}
	return nil
}

// ExecuteCommand renders a provisioner's execute_command with the path of the script it runs.
func ExecuteCommand(ctx *interpolate.Context, command, script string) (string, error) {
	ctx.Data = struct{ Path string }{Path: script}
	cmd, err := interpolate.Render(command, ctx)
	if err != nil {
		return "", fmt.Errorf("execute_command: %w", err)
	}
	if strings.TrimSpace(cmd) == "" {
		return "", errors.New("execute_command is empty once rendered")
	}
	return cmd, nil
}

// CheckSource accepts a local file a provisioner uploads: it exists and is a regular file.
func CheckSource(p string) error {
	fi, err := os.Stat(p)
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("%s is not a regular file", p)
	}
	return nil
}
