package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/luks"
	"github.com/berthlabs/berth/internal/repotest"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
)

// buildAgent builds berth-agent into a directory of t's: the exit codes and messages under test are those
// of the process, as a script or systemd sees them.
func buildAgent(t *testing.T) string {
	t.Helper()
	return repotest.BuildBinary(t, "./nodeagent/cmd/berth-agent", "")
}

type result struct {
	code           int
	stdout, stderr string
}

// runAgent runs the binary with stdout and stderr on pipes, as under systemd or in a script.
func runAgent(t *testing.T, bin string, args ...string) result {
	t.Helper()
	var stdout, stderr bytes.Buffer
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	return result{code: exitCode(t, cmd.Run()), stdout: stdout.String(), stderr: stderr.String()}
}

func exitCode(t *testing.T, err error) int {
	t.Helper()
	var ee *exec.ExitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &ee):
		return ee.ExitCode()
	default:
		t.Fatalf("running berth-agent: %v", err)
		return -1
	}
}

func (r result) check(t *testing.T, code int, stdout, stderr []string) {
	t.Helper()
	if r.code != code {
		t.Errorf("exit code %d, want %d\nstdout: %s\nstderr: %s", r.code, code, r.stdout, r.stderr)
	}
	for _, w := range stdout {
		if !strings.Contains(r.stdout, w) {
			t.Errorf("stdout %q does not contain %q", r.stdout, w)
		}
	}
	for _, w := range stderr {
		if !strings.Contains(r.stderr, w) {
			t.Errorf("stderr %q does not contain %q", r.stderr, w)
		}
	}
}

func writeFile(t *testing.T, dir, name, content string) string {
	t.Helper()
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestCommandLine(t *testing.T) {
	bin := buildAgent(t)
	dir := t.TempDir()
	missing := filepath.Join(dir, "absent.yaml")
	cases := []struct {
		name           string
		args           []string
		code           int
		stdout, stderr []string
	}{
		{name: "no command", code: 2, stderr: []string{"Usage:", "Exit codes: 0 done, 1 failed, 2 wrong command line, 3 configuration"}},
		{name: "version", args: []string{"version"}, code: 0, stdout: []string{"berth-agent dev (Kubernetes v1.36.3"}},
		{name: "help", args: []string{"--help"}, code: 0, stdout: []string{"berth-agent boot", "status: 0 member, 4 will join"}},
		{name: "unknown command", args: []string{"frobnicate"}, code: 2, stderr: []string{`berth-agent: unknown command "frobnicate"`}},
		{name: "boot --help", args: []string{"boot", "--help"}, code: 0,
			stdout: []string{"Usage: berth-agent boot [--config FILE]", "-config string", "-debug-listen string", "-log-level string"}},
		{name: "joinservice -h", args: []string{"joinservice", "-h"}, code: 0,
			stdout: []string{"Usage: berth-agent joinservice", "-service-config string", "-debug-listen string"}},
		{name: "help status", args: []string{"help", "status"}, code: 0,
			stdout: []string{"Usage: berth-agent status", "-json", "its state field"}},
		{name: "recover --help", args: []string{"recover", "--help"}, code: 0, stdout: []string{"Usage: berth-agent recover", "-root-key-file string"}},
		{name: "measure --help", args: []string{"measure", "--help"}, code: 0, stdout: []string{"Usage: berth-agent measure --uki FILE"}},
		{name: "boot takes no --json", args: []string{"boot", "--json"}, code: 2,
			stderr: []string{"flag provided but not defined: -json\nUsage: berth-agent boot", "(berth-agent boot --help lists the flags)"}},
		{name: "status takes no --debug-listen", args: []string{"status", "--debug-listen", "127.0.0.1:0"}, code: 2,
			stderr: []string{"flag provided but not defined: -debug-listen"}},
		{name: "boot takes no --service-config", args: []string{"boot", "--service-config", missing}, code: 2,
			stderr: []string{"flag provided but not defined: -service-config"}},
		{name: "stray argument", args: []string{"boot", "--config", missing, "now"}, code: 2,
			stderr: []string{`berth-agent boot: unexpected argument "now"`}},
		{name: "bad log level", args: []string{"boot", "--config", missing, "--log-level", "loud"}, code: 2,
			stderr: []string{`berth-agent boot: --log-level: "loud" is not debug, info, warn or error`}},
		{name: "both configurations", args: []string{"joinservice", "--config", missing, "--service-config", missing}, code: 2,
			stderr: []string{"berth-agent joinservice: --config and --service-config exclude each other"}},
		{name: "status without configuration", args: []string{"status", "--config", missing}, code: 3,
			stderr: []string{"berth-agent status: reading agent configuration: open " + missing + ": no such file or directory\n"}},
		{name: "status --json without configuration", args: []string{"status", "--json", "--config", missing}, code: 3,
			stderr: []string{"berth-agent status: reading agent configuration: open " + missing}},
		{name: "doctor --help", args: []string{"doctor", "--help"}, code: 0, stdout: []string{"Usage: berth-agent doctor", "-manifest string"}},
		{name: "doctor --image without --manifest", args: []string{"doctor", "--image", "berth-node-aws"}, code: 2,
			stderr: []string{"berth-agent doctor: --image needs --manifest"}},
		{name: "doctor --manifest without --image", args: []string{"doctor", "--manifest", missing}, code: 3,
			stderr: []string{"berth-agent doctor: --manifest needs --image"}},
		{name: "ebs-name without a device", args: []string{"ebs-name"}, code: 2, stderr: []string{"berth-agent ebs-name: the device is required"}},
		{name: "ebs-name of a file", args: []string{"ebs-name", "/proc/self/exe"}, code: 1,
			stderr: []string{"berth-agent ebs-name: /proc/self/exe is not an NVMe device"}},
		{name: "doctor with a missing manifest", args: []string{"doctor", "--manifest", missing, "--image", "berth-node-aws"}, code: 3,
			stderr: []string{"berth-agent doctor: manifest: open " + missing}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := runAgent(t, bin, tc.args...)
			r.check(t, tc.code, tc.stdout, tc.stderr)
			// Help asked for is an answer, on stdout; a mistake is reported on stderr alone.
			if tc.code == 0 && r.stderr != "" {
				t.Errorf("stderr %q, want nothing", r.stderr)
			}
			if tc.code != 0 && r.stdout != "" {
				t.Errorf("stdout %q, want nothing", r.stdout)
			}
		})
	}

	// Under systemd stderr is journald's socket: a failure is a JSON log event among the command's others.
	t.Run("boot without configuration logs JSON", func(t *testing.T) {
		r := runAgent(t, bin, "boot", "--config", missing)
		var event struct{ Level, Msg, Error string }
		if err := json.Unmarshal([]byte(r.stderr), &event); err != nil {
			t.Fatalf("stderr %q is not one JSON event: %v", r.stderr, err)
		}
		if r.code != 3 || event.Level != "ERROR" || event.Msg != "configuration" ||
			event.Error != "reading agent configuration: open "+missing+": no such file or directory" {
			t.Errorf("exit code %d, event %+v; want 3, an ERROR \"configuration\" naming %s", r.code, event, missing)
		}
	})
	t.Run("joinservice without service configuration logs JSON", func(t *testing.T) {
		r := runAgent(t, bin, "joinservice", "--service-config", missing)
		r.check(t, 3, nil, []string{`"level":"ERROR","msg":"configuration","error":"reading join service configuration: open ` + missing})
	})
}

// TestConfigurationErrors: a wrong agent.yaml stops every command before it does anything, with exit
// code 3 and a message naming the file and each wrong field.
func TestConfigurationErrors(t *testing.T) {
	bin := buildAgent(t)
	dir := t.TempDir()
	const valid = "metadataURL: http://127.0.0.1:1\nstateDisk: /dev/null\n"
	// heading is "parsing agent configuration" (and the file) for a file whose YAML does not fit the
	// fields, "agent configuration" for one whose values Validate refuses; want[0] follows it.
	cases := []struct {
		name, content, heading string
		want                   []string
	}{
		{name: "duration without a unit", content: valid + "retryMax: 5\n", heading: "parsing agent configuration",
			want: []string{": line 3: retryMax: a duration such as 5s or 1m30s, not 5\n"}},
		{name: "key of another case", content: "metadataURL: http://127.0.0.1:1\nstatedisk: /dev/null\n", heading: "parsing agent configuration",
			want: []string{`: line 2: unknown field "statedisk" (keys are case-sensitive: did you mean "stateDisk"?)` + "\n"}},
		{name: "unknown field", content: valid + "unknownField: 1\n", heading: "parsing agent configuration",
			want: []string{`: line 3: unknown field "unknownField"` + "\n"}},
		{name: "every problem of the YAML at once", content: "statedisk: /dev/null\nretryMax: 5\n", heading: "parsing agent configuration",
			want: []string{":\n  line 1: unknown field \"statedisk\"", "\n  line 2: retryMax: a duration such as 5s"}},
		{name: "PCR out of range", content: valid + "pcrs: [7, 24]\n", heading: "agent configuration",
			want: []string{": line 3: pcrs: 24 is not a PCR index (0 to 23)\n"}},
		{name: "PCR listed twice", content: valid + "pcrs: [7, 7]\n", heading: "agent configuration",
			want: []string{": line 3: pcrs: 7 is listed twice\n"}},
		// A worker once took this to time.NewTicker after its join, panicked and restarted without end.
		{name: "negative duration", content: valid + "localUnlockRefresh: -5m\n", heading: "agent configuration",
			want: []string{": line 3: localUnlockRefresh: -5m0s is negative"}},
		{name: "every validation problem at once", content: "pcrs: [-1]\ninitListen: localhost\nmetadataURL: ftp://m\n", heading: "agent configuration",
			want: []string{":\n  line 3: metadataURL \"ftp://m\" is not an http(s) URL", "\n  line 2: initListen: \"localhost\" is not host:port",
				"\n  stateDisk is required", "\n  line 1: pcrs: -1 is not a PCR index (0 to 23)"}},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			path := writeFile(t, dir, fmt.Sprintf("agent-%d.yaml", i), tc.content)
			heading := tc.heading + " " + path
			// The heading starts the message; the problems after the first each have their line.
			want := append([]string{heading + tc.want[0]}, tc.want[1:]...)
			r := runAgent(t, bin, "status", "--config", path)
			r.check(t, 3, nil, append(want, "berth-agent status: "+heading))
			if r.stdout != "" {
				t.Errorf("stdout %q, want nothing", r.stdout)
			}
			r = runAgent(t, bin, "boot", "--config", path)
			var event struct{ Msg, Error string }
			if err := json.Unmarshal([]byte(r.stderr), &event); err != nil {
				t.Fatalf("boot's stderr %q is not one JSON event: %v", r.stderr, err)
			}
			if r.code != 3 || event.Msg != "configuration" || !strings.HasPrefix(event.Error+"\n", want[0]) {
				t.Errorf("boot: exit code %d, event %+v; want 3 and an error starting %q", r.code, event, want[0])
			}
		})
	}
}

// statusNode writes the configuration of a node without a metadata service whose state disk is disk, and
// returns its path and its state directory.
func statusNode(t *testing.T, disk string) (config, state string) {
	t.Helper()
	dir := t.TempDir()
	userData := writeFile(t, dir, "user-data.json", `{"clusterName": "lab", "joinEndpoints": ["127.0.0.1:9000"], "joinPort": 9000,
		"joinCAPin": "sha256:`+strings.Repeat("ab", 32)+`"}`)
	state = filepath.Join(dir, "state")
	config = writeFile(t, dir, "agent.yaml", "userDataFile: "+userData+"\nsourceAddress: 127.0.0.1\nstateDisk: "+disk+
		"\npaths:\n  state: "+state+"\n  kubernetesDir: "+filepath.Join(dir, "k8s")+"\n  kubeletDir: "+filepath.Join(dir, "kubelet")+"\n")
	return config, state
}

// blankDisk is an image file holding nothing, as a new node's state disk.
func blankDisk(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "disk.img")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(32 << 20); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestStatus: status's exit code is the node's state, so that a script can branch on it; every state is
// reached here with the real cryptsetup and files, and also read from --json.
func TestStatus(t *testing.T) {
	if _, err := exec.LookPath("cryptsetup"); err != nil {
		t.Skip("status reads the state disk with cryptsetup, which is not installed")
	}
	bin := buildAgent(t)

	memberConfig, state := statusNode(t, blankDisk(t))
	since := time.Date(2026, 11, 2, 10, 0, 0, 0, time.UTC)
	if err := nodestate.Write(state, &nodestate.State{ClusterID: "c-1", NodeName: "w-0", Role: "worker", Via: "join", Since: since}); err != nil {
		t.Fatal(err)
	}
	willJoinConfig, _ := statusNode(t, blankDisk(t))
	foreign := blankDisk(t)
	if err := luks.New(foreign, nil).Format(t.Context(), bytes.Repeat([]byte{7}, luks.MinKeySize), "someone-elses"); err != nil {
		t.Fatal(err)
	}
	blockedConfig, _ := statusNode(t, foreign)
	absentDisk := filepath.Join(t.TempDir(), "absent.img")
	unreadableDiskConfig, _ := statusNode(t, absentDisk)
	noMetadataConfig, _ := statusNode(t, blankDisk(t))
	if err := os.Remove(filepath.Join(filepath.Dir(noMetadataConfig), "user-data.json")); err != nil {
		t.Fatal(err)
	}
	corruptConfig, corruptState := statusNode(t, blankDisk(t))
	writeFile(t, mkdir(t, corruptState), "node.json", "{")

	cases := []struct {
		name, config string
		code         int
		state        string
		stdout       []string
	}{
		{"member", memberConfig, 0, "member", []string{`status:      member of cluster c-1 as worker "w-0" since 2026-11-02 10:00:00Z (via join)`}},
		{"will join", willJoinConfig, 4, "will-join", []string{"state disk:  not formatted", "status:      not a cluster member yet: the next boot joins"}},
		{"blocked", blockedConfig, 5, "blocked", []string{`state disk:  foreign LUKS volume labelled "someone-elses"`,
			`status:      the next boot refuses the state disk ` + foreign + `: it is a LUKS volume labelled "someone-elses"`}},
		{"disk unreadable", unreadableDiskConfig, 6, "unknown", []string{"status:      cannot tell whether the next boot joins: the state disk " +
			absentDisk + " is unreadable (checking " + absentDisk + " for a LUKS header"}},
		{"metadata unreadable", noMetadataConfig, 6, "unknown", []string{"node:        unknown: reading user-data",
			"status:      cannot tell whether the next boot joins: the instance metadata is unreadable (reading user-data"}},
		{"membership record unreadable", corruptConfig, 6, "unknown", []string{"status:      cannot tell: the node's membership record is unreadable: parsing node state"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := runAgent(t, bin, "status", "--config", tc.config)
			r.check(t, tc.code, tc.stdout, nil)
			if r.stderr != "" {
				t.Errorf("stderr %q, want nothing", r.stderr)
			}
			r = runAgent(t, bin, "status", "--json", "--config", tc.config)
			var s struct{ State, Summary string }
			if err := json.Unmarshal([]byte(r.stdout), &s); err != nil {
				t.Fatalf("--json: stdout %q: %v", r.stdout, err)
			}
			if r.code != tc.code || s.State != tc.state {
				t.Errorf("--json: exit code %d, state %q; want %d, %q (stderr %s)", r.code, s.State, tc.code, tc.state, r.stderr)
			}
		})
	}
}

func mkdir(t *testing.T, dir string) string {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestDoctor runs doctor on this machine, which is no node: it still reports every check, with the broken
// configuration as one finding, in both forms, and exits 1; an image the manifest lacks is named.
func TestDoctor(t *testing.T) {
	bin := buildAgent(t)
	missing := filepath.Join(t.TempDir(), "agent.yaml")
	zero := strings.Repeat("0", 64)
	manifestFile := writeFile(t, t.TempDir(), "berth-image.json", `{"version": 1, "images": [{"name": "berth-node-qemu",
		"builder": "qemu", "artifact_id": "berth.raw", "region": "", "pcrs": {"4": "`+zero+`", "9": "`+zero+`", "11": "`+zero+`", "12": "`+zero+`"},
		"components": {}}]}`)

	r := runAgent(t, bin, "doctor", "--config", missing, "--manifest", manifestFile, "--image", "berth-node-qemu")
	r.check(t, 1, []string{"FAIL  configuration", "reading agent configuration: open " + missing, "pcr 4", "cmdline", "containerd", "kubelet"}, nil)
	r = runAgent(t, bin, "doctor", "--json", "--config", missing, "--manifest", manifestFile, "--image", "berth-node-qemu")
	var checks []struct {
		Name   string
		OK     bool
		Detail string
	}
	if err := json.Unmarshal([]byte(r.stdout), &checks); err != nil {
		t.Fatalf("--json: stdout %q: %v", r.stdout, err)
	}
	names := map[string]bool{}
	for _, c := range checks {
		names[c.Name] = true
	}
	for _, want := range []string{"configuration", "tpm", "pcr 4", "pcr 9", "pcr 11", "pcr 12", "cmdline", "containerd", "swap", "kubeadm", "kubelet"} {
		if !names[want] {
			t.Errorf("--json lacks the check %q: %s", want, r.stdout)
		}
	}
	if r.code != 1 || len(checks) == 0 || checks[0].Name != "configuration" || checks[0].OK {
		t.Errorf("--json: exit code %d, checks %+v; want 1 with the configuration failing first", r.code, checks)
	}

	r = runAgent(t, bin, "doctor", "--config", missing, "--manifest", manifestFile, "--image", "berth-node-aws")
	r.check(t, 3, nil, []string{`has no image "berth-node-aws" (it has [berth-node-qemu])`})
}
