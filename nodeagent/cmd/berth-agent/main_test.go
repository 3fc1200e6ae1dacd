package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestRun(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "absent.yaml")
	bad := filepath.Join(t.TempDir(), "bad.yaml")
	if err := os.WriteFile(bad, []byte("metadataURL: http://127.0.0.1:1\nstateDisk: /dev/null\nunknownField: 1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name   string
		args   []string
		code   int
		stdout string
		stderr string
	}{
		{name: "no command", args: nil, code: 2, stderr: "Usage:"},
		{name: "version", args: []string{"version"}, code: 0, stdout: "berth-agent dev (Kubernetes v1.36.3"},
		{name: "help", args: []string{"help"}, code: 0, stdout: "berth-agent boot"},
		{name: "unknown command", args: []string{"frobnicate"}, code: 2, stderr: `unknown command "frobnicate"`},
		{name: "bad flag", args: []string{"status", "--nope"}, code: 2, stderr: "flag provided but not defined"},
		{name: "bad log level", args: []string{"status", "--config", missing, "--log-level", "loud"}, code: 2, stderr: "--log-level"},
		{name: "missing configuration", args: []string{"boot", "--config", missing}, code: 1, stderr: "reading agent configuration"},
		{name: "unknown configuration field", args: []string{"boot", "--config", bad}, code: 1, stderr: "unknownField"},
		{name: "service config on boot", args: []string{"boot", "--service-config", missing}, code: 2, stderr: "--service-config is a flag of joinservice"},
		{name: "missing service configuration", args: []string{"joinservice", "--service-config", missing}, code: 1, stderr: "reading join service configuration"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var stdout, stderr strings.Builder
			code := run(tc.args, &stdout, &stderr)
			if code != tc.code {
				t.Errorf("exit code %d, want %d\nstdout: %s\nstderr: %s", code, tc.code, stdout.String(), stderr.String())
			}
			if !strings.Contains(stdout.String(), tc.stdout) {
				t.Errorf("stdout %q does not contain %q", stdout.String(), tc.stdout)
			}
			if !strings.Contains(stderr.String(), tc.stderr) {
				t.Errorf("stderr %q does not contain %q", stderr.String(), tc.stderr)
			}
		})
	}
}
