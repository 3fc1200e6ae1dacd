package kubeadm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/repotest"
)

// fakeKubeadm writes a shell script standing in for kubeadm and returns its
// path; the script body sees the arguments as "$@".
func fakeKubeadm(t *testing.T, body string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "kubeadm")
	if err := os.WriteFile(path, []byte("#!/bin/sh\n"+body+"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	return path
}

// record returns a progress func that collects lines, and the lines.
func record() (func(string), *[]string) {
	var lines []string
	return func(l string) { lines = append(lines, l) }, &lines
}

func TestExecArgs(t *testing.T) {
	tests := []struct {
		name    string
		join    bool
		ignore  []string
		wantArg []string
	}{
		{"init", false, nil, []string{"init", "--config", "/etc/berth/kubeadm.yaml"}},
		{"join", true, nil, []string{"join", "--config", "/etc/berth/kubeadm.yaml"}},
		{"init ignoring checks", false, []string{"SystemVerification", "FileContent--proc-sys-net-ipv4-ip_forward"},
			[]string{"init", "--config", "/etc/berth/kubeadm.yaml", "--ignore-preflight-errors=SystemVerification,FileContent--proc-sys-net-ipv4-ip_forward"}},
		{"join ignoring one check", true, []string{"all"},
			[]string{"join", "--config", "/etc/berth/kubeadm.yaml", "--ignore-preflight-errors=all"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := &Exec{
				Binary:                fakeKubeadm(t, `for a in "$@"; do echo "arg:$a"; done`),
				IgnorePreflightErrors: tt.ignore,
			}
			progress, lines := record()
			run := e.Init
			if tt.join {
				run = e.Join
			}
			if err := run(context.Background(), "/etc/berth/kubeadm.yaml", progress); err != nil {
				t.Fatalf("run: %v", err)
			}
			var want []string
			for _, a := range tt.wantArg {
				want = append(want, "arg:"+a)
			}
			if !slices.Equal(*lines, want) {
				t.Errorf("kubeadm got args\n%q\nwant\n%q", *lines, want)
			}
		})
	}
}

func TestExecDefaultBinaryFromPath(t *testing.T) {
	dir := filepath.Dir(fakeKubeadm(t, `echo "found on PATH: $1"`))
	t.Setenv("PATH", dir)
	progress, lines := record()
	if err := (&Exec{}).Join(context.Background(), "/cfg.yaml", progress); err != nil {
		t.Fatalf("Join: %v", err)
	}
	if want := []string{"found on PATH: join"}; !slices.Equal(*lines, want) {
		t.Errorf("lines = %q, want %q", *lines, want)
	}
}

func TestExecStreamsLinesInOrder(t *testing.T) {
	bin := fakeKubeadm(t, `
echo "[preflight] Running pre-flight checks"
echo "W0101 warning on stderr" >&2
printf 'split '; printf 'across writes\n'
printf 'crlf line\r\n'
echo
echo "[kubelet-start] Starting the kubelet" >&2
printf 'no trailing newline'`)
	var logs bytes.Buffer
	e := &Exec{Binary: bin, Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))}
	progress, lines := record()
	if err := e.Init(context.Background(), "/cfg.yaml", progress); err != nil {
		t.Fatalf("Init: %v", err)
	}
	want := []string{
		"[preflight] Running pre-flight checks",
		"W0101 warning on stderr",
		"split across writes",
		"crlf line",
		"[kubelet-start] Starting the kubelet",
		"no trailing newline",
	}
	if !slices.Equal(*lines, want) {
		t.Errorf("progress got\n%q\nwant\n%q", *lines, want)
	}
	// One debug event per line, in the same order.
	last := -1
	for _, l := range want {
		i := strings.Index(logs.String(), fmt.Sprintf("line=%q", l))
		if i <= last {
			t.Fatalf("debug log lacks %q after the previous line:\n%s", l, logs.String())
		}
		last = i
	}
	if !strings.Contains(logs.String(), "msg=\"kubeadm finished\"") {
		t.Errorf("no completion event in log:\n%s", logs.String())
	}
}

func TestExecFailureCarriesTail(t *testing.T) {
	bin := fakeKubeadm(t, `
i=1
while [ $i -le 30 ]; do printf 'line-%02d\n' $i; i=$((i+1)); done
echo "error execution phase preflight: [preflight] Some fatal errors occurred" >&2
exit 3`)
	progress, lines := record()
	err := (&Exec{Binary: bin}).Init(context.Background(), "/cfg.yaml", progress)
	if err == nil {
		t.Fatal("Init succeeded, want the exit status")
	}
	var exitErr *exec.ExitError
	if !errors.As(err, &exitErr) || exitErr.ExitCode() != 3 {
		t.Errorf("error %v does not wrap exit status 3", err)
	}
	if len(*lines) != 31 {
		t.Errorf("progress got %d lines, want 31", len(*lines))
	}
	msg := err.Error()
	if !strings.HasPrefix(msg, "kubeadm init: exit status 3; last 20 lines of output:\n") {
		t.Errorf("error starts %q", msg)
	}
	for i := 1; i <= 30; i++ {
		line := fmt.Sprintf("line-%02d", i)
		if got, want := strings.Contains(msg, line), i > 11; got != want {
			t.Errorf("error contains %s: %v, want %v", line, got, want)
		}
	}
	if !strings.HasSuffix(msg, "\nerror execution phase preflight: [preflight] Some fatal errors occurred") {
		t.Errorf("error does not end with kubeadm's last line:\n%s", msg)
	}
}

func TestExecFailureWithoutOutput(t *testing.T) {
	err := (&Exec{Binary: fakeKubeadm(t, "exit 1")}).Join(context.Background(), "/cfg.yaml", nil)
	if err == nil || err.Error() != "kubeadm join: exit status 1; no output" {
		t.Errorf("error = %v", err)
	}
}

func TestExecMasksTokens(t *testing.T) {
	bin := fakeKubeadm(t, `
echo "kubeadm join 10.0.0.10:6443 --token `+testToken+` \\"
echo "	--discovery-token-ca-cert-hash `+testHash+`"
exit 1`)
	var logs bytes.Buffer
	e := &Exec{Binary: bin, Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))}
	progress, lines := record()
	err := e.Init(context.Background(), "/cfg.yaml", progress)
	if err == nil {
		t.Fatal("Init succeeded")
	}
	for what, text := range map[string]string{"error": err.Error(), "log": logs.String(), "progress": strings.Join(*lines, "\n")} {
		if strings.Contains(text, testToken) {
			t.Errorf("%s contains the token:\n%s", what, text)
		}
		if !strings.Contains(text, "--token <redacted-token>") {
			t.Errorf("%s lacks the masked token:\n%s", what, text)
		}
		if !strings.Contains(text, testHash) {
			t.Errorf("%s lost the CA hash, which is public:\n%s", what, text)
		}
	}
}

func TestExecCancelKillsProcessGroup(t *testing.T) {
	pidFile := filepath.Join(t.TempDir(), "child.pid")
	// The background sleep inherits the output pipe, as a helper started by
	// kubeadm would; killing only the shell would leave it running.
	bin := fakeKubeadm(t, `
sleep 600 &
echo $! > `+pidFile+`
echo ready
wait`)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	progress := func(line string) {
		if line == "ready" {
			cancel()
		}
	}
	err := (&Exec{Binary: bin}).Join(ctx, "/cfg.yaml", progress)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("error %v does not wrap context.Canceled", err)
	}
	if !strings.Contains(err.Error(), "ready") {
		t.Errorf("error lacks the output tail: %v", err)
	}
	b, readErr := os.ReadFile(pidFile)
	if readErr != nil {
		t.Fatal(readErr)
	}
	pid, convErr := strconv.Atoi(strings.TrimSpace(string(b)))
	if convErr != nil {
		t.Fatal(convErr)
	}
	// SIGKILL is delivered asynchronously: wait until the child is gone, or a zombie waiting to be reaped
	// by init. The bound only keeps a broken kill from hanging the test.
	deadline := time.Now().Add(10 * time.Second)
	for {
		stat, statErr := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if statErr != nil {
			return
		}
		fields := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:]))
		if len(fields) > 0 && fields[0] == "Z" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("kubeadm's child %d survived the cancel: %s", pid, stat)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestExecAlreadyCancelled(t *testing.T) {
	marker := filepath.Join(t.TempDir(), "ran")
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err := (&Exec{Binary: fakeKubeadm(t, "touch "+marker)}).Init(ctx, "/cfg.yaml", nil)
	if !errors.Is(err, context.Canceled) {
		t.Errorf("error %v does not wrap context.Canceled", err)
	}
	if _, statErr := os.Stat(marker); statErr == nil {
		t.Error("kubeadm ran although the context was already cancelled")
	}
}

func TestExecRejects(t *testing.T) {
	marker := filepath.Join(t.TempDir(), "ran")
	bin := fakeKubeadm(t, "touch "+marker)
	tests := []struct {
		name    string
		exec    Exec
		config  string
		wantErr string
	}{
		{"no config path", Exec{Binary: bin}, "", "kubeadm init: config path is required"},
		{"comma in check", Exec{Binary: bin, IgnorePreflightErrors: []string{"Swap,Mem"}}, "/cfg.yaml", "preflight check name \"Swap,Mem\""},
		{"empty check", Exec{Binary: bin, IgnorePreflightErrors: []string{""}}, "/cfg.yaml", "preflight check name \"\""},
		{"space in check", Exec{Binary: bin, IgnorePreflightErrors: []string{"Swap --v=10"}}, "/cfg.yaml", "has a comma, whitespace"},
		{"missing binary", Exec{Binary: filepath.Join(t.TempDir(), "no-kubeadm")}, "/cfg.yaml", "no-kubeadm: no such file or directory"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.exec.Init(context.Background(), tt.config, nil)
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("error = %v, want it to contain %q", err, tt.wantErr)
			}
			if _, statErr := os.Stat(marker); statErr == nil {
				t.Error("kubeadm ran")
			}
		})
	}
}

func TestExecReset(t *testing.T) {
	argsFile := filepath.Join(t.TempDir(), "args")
	bin := fakeKubeadm(t, `echo "$@" > `+argsFile+`
echo "[reset] Deleting contents of directories"`)
	progress, lines := record()
	if err := (&Exec{Binary: bin, IgnorePreflightErrors: []string{"Swap"}}).Reset(context.Background(), progress); err != nil {
		t.Fatal(err)
	}
	args, err := os.ReadFile(argsFile)
	if err != nil {
		t.Fatal(err)
	}
	// Preflight settings belong to init and join; reset takes none.
	if got := strings.TrimSpace(string(args)); got != "reset --force" {
		t.Errorf("kubeadm called with %q, want \"reset --force\"", got)
	}
	if len(*lines) != 1 || !strings.HasPrefix((*lines)[0], "[reset]") {
		t.Errorf("progress lines %q", *lines)
	}
	if err := (&Exec{Binary: fakeKubeadm(t, "echo boom; exit 3")}).Reset(context.Background(), nil); err == nil || !strings.Contains(err.Error(), "boom") {
		t.Errorf("failing reset: %v, want an error with kubeadm's output", err)
	}
}

func TestExecRenewCertificates(t *testing.T) {
	argsFile := filepath.Join(t.TempDir(), "args")
	bin := fakeKubeadm(t, `echo "$@" > `+argsFile+`
echo "[renew] certificate embedded in the kubeconfig file for the admin to use and for kubeadm itself renewed"`)
	progress, lines := record()
	if err := (&Exec{Binary: bin, IgnorePreflightErrors: []string{"Swap"}}).RenewCertificates(context.Background(), "/etc/kubernetes/admin.conf", "/etc/kubernetes/pki", progress); err != nil {
		t.Fatal(err)
	}
	args, err := os.ReadFile(argsFile)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := strings.TrimSpace(string(args)), "certs renew all --kubeconfig /etc/kubernetes/admin.conf --cert-dir /etc/kubernetes/pki"; got != want {
		t.Errorf("kubeadm called with %q, want %q", got, want)
	}
	if len(*lines) != 1 {
		t.Errorf("progress lines %q", *lines)
	}
	if err := (&Exec{Binary: bin}).RenewCertificates(context.Background(), "", "/etc/kubernetes/pki", nil); err == nil {
		t.Error("renewed without a kubeconfig")
	}
}

func TestExecUpgrade(t *testing.T) {
	argsFile := filepath.Join(t.TempDir(), "args")
	bin := fakeKubeadm(t, `echo "$@" > `+argsFile+`
echo "[upgrade] done"`)
	e := &Exec{Binary: bin, IgnorePreflightErrors: []string{"Swap"}}
	const kubeconfig = "/etc/kubernetes/admin.conf"
	tests := []struct {
		name string
		run  func() error
		want string
	}{
		// The node's own ignored checks go to the upgrades' preflight too (a lab node's SystemVerification
		// failed `upgrade node` without them); CreateJob always to apply's.
		{"apply", func() error { return e.UpgradeApply(t.Context(), kubeconfig, "v1.36.3", nil) },
			"upgrade apply v1.36.3 --yes --kubeconfig " + kubeconfig + " --skip-phases=addon --ignore-preflight-errors=CreateJob,Swap"},
		{"node", func() error { return e.UpgradeNode(t.Context(), kubeconfig, nil) },
			"upgrade node --kubeconfig " + kubeconfig + " --skip-phases=addon --ignore-preflight-errors=Swap"},
		{"node without ignored checks", func() error { return (&Exec{Binary: bin}).UpgradeNode(t.Context(), kubeconfig, nil) },
			"upgrade node --kubeconfig " + kubeconfig + " --skip-phases=addon"},
		{"addons", func() error { return e.UpgradeAddons(t.Context(), kubeconfig, "v1.36.3", nil) },
			"upgrade apply phase addon all v1.36.3 --kubeconfig " + kubeconfig},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := tt.run(); err != nil {
				t.Fatal(err)
			}
			args, err := os.ReadFile(argsFile)
			if err != nil {
				t.Fatal(err)
			}
			if got := strings.TrimSpace(string(args)); got != tt.want {
				t.Errorf("kubeadm called with %q, want %q", got, tt.want)
			}
		})
	}
	for _, release := range []string{"", "1.36.3", "v1.36.3 --force"} {
		if err := e.UpgradeApply(t.Context(), kubeconfig, release, nil); err == nil {
			t.Errorf("upgrade apply to %q ran", release)
		}
		if err := e.UpgradeAddons(t.Context(), kubeconfig, release, nil); err == nil {
			t.Errorf("addon upgrade to %q ran", release)
		}
	}
	bad := &Exec{Binary: bin, IgnorePreflightErrors: []string{"a,b"}}
	if err := bad.UpgradeApply(t.Context(), kubeconfig, "v1.36.3", nil); err == nil || !strings.Contains(err.Error(), "comma") {
		t.Errorf("upgrade apply ignoring %q: %v, want the check name refused", "a,b", err)
	}
}

func TestExecVersion(t *testing.T) {
	for _, tt := range []struct {
		name, out, want string
	}{
		{"release", "echo v1.36.3", "v1.36.3"},
		{"pre-release", "echo v1.37.0-rc.1", "v1.37.0-rc.1"},
		{"built without its version", "echo 'v0.0.0-master+$Format:%H$'", ""},
		{"two lines", "echo v1.36.3; echo v1.36.4", ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got, err := (&Exec{Binary: fakeKubeadm(t, tt.out)}).Version(t.Context())
			if tt.want == "" {
				if err == nil {
					t.Errorf("Version = %q, want an error", got)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Errorf("Version = %q, %v; want %q", got, err, tt.want)
			}
		})
	}
}

// TestExecUpgradeWithTheRealKubeadm runs the upgrade commands with the real kubeadm of the lab's release, on a
// kubeconfig that does not exist. kubeadm parses every flag, phase and argument before it loads the
// kubeconfig, so failing on the kubeconfig shows the command line is one it takes: an unknown flag or phase
// command fails first, and differently; the phase skipped is one each command lists. What the commands do to
// a cluster is the lab's to show.
func TestExecUpgradeWithTheRealKubeadm(t *testing.T) {
	bin := repotest.BinDir(t, "BERTH_KUBE_BIN", "build-k8s.sh", "building Kubernetes from its modules")
	e := &Exec{Binary: filepath.Join(bin, "kubeadm"), IgnorePreflightErrors: []string{"Swap"}}
	release, err := e.Version(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	kubeconfig := filepath.Join(t.TempDir(), "admin.conf")
	for name, run := range map[string]func() error{
		"apply":  func() error { return e.UpgradeApply(t.Context(), kubeconfig, release, nil) },
		"node":   func() error { return e.UpgradeNode(t.Context(), kubeconfig, nil) },
		"addons": func() error { return e.UpgradeAddons(t.Context(), kubeconfig, release, nil) },
	} {
		err := run()
		if err == nil || !strings.Contains(err.Error(), "failed to load admin kubeconfig: open "+kubeconfig) {
			t.Errorf("%s: %v, want kubeadm to fail only on loading the missing kubeconfig", name, err)
		}
	}
	// --skip-phases names are checked only once a cluster answers: the phase must be in the command's list.
	for _, command := range []string{"apply", "node"} {
		help, err := exec.Command(e.Binary, "upgrade", command, "--help").Output()
		if err != nil {
			t.Fatal(err)
		}
		if !regexp.MustCompile(`(?m)^addon +Upgrade the default kubeadm addons$`).Match(help) {
			t.Errorf("kubeadm upgrade %s has no phase addon to skip; its help:\n%s", command, help)
		}
	}
	bad := exec.Command(e.Binary, "upgrade", "node", "--kubeconfig", kubeconfig, "--skip-phases=addon", "--no-such-flag")
	if out, err := bad.CombinedOutput(); err == nil || !strings.Contains(string(out), "unknown flag: --no-such-flag") {
		t.Errorf("kubeadm with an unknown flag: %v\n%s\nwant it refused before the kubeconfig is loaded", err, out)
	}
}
