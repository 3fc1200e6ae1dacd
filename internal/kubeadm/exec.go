package kubeadm

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"syscall"
	"time"
	"unicode"
)

// Runner runs kubeadm with a configuration file rendered by InitConfig or
// JoinConfig, reporting each line of kubeadm's output to progress (which may
// be nil). progress is called for one line at a time, in output order; while
// it runs, kubeadm's output is not read.
type Runner interface {
	Init(ctx context.Context, configPath string, progress func(line string)) error
	Join(ctx context.Context, configPath string, progress func(line string)) error
}

const (
	// tailLines is how much of kubeadm's output a failure carries: enough
	// to show the failing phase and kubeadm's own error message.
	tailLines = 20
	// maxLineBytes caps a line buffered without a newline.
	maxLineBytes = 64 << 10
	// waitDelay bounds the wait for output after kubeadm has exited or been
	// killed, in case something it started still holds the pipe open.
	waitDelay = 10 * time.Second
)

// tokenInOutput matches bootstrap tokens, which kubeadm init prints in its
// closing "kubeadm join" hint; they must not reach logs or errors.
var tokenInOutput = regexp.MustCompile(`\b[a-z0-9]{6}\.[a-z0-9]{16}\b`)

// Exec runs the kubeadm binary.
type Exec struct {
	// Binary defaults to "kubeadm", looked up in PATH.
	Binary string
	// IgnorePreflightErrors are passed as --ignore-preflight-errors.
	IgnorePreflightErrors []string
	// Logger defaults to discarding.
	Logger *slog.Logger
}

var _ Runner = (*Exec)(nil)

// Init runs `kubeadm init --config configPath`.
func (e *Exec) Init(ctx context.Context, configPath string, progress func(line string)) error {
	return e.run(ctx, "init", configPath, progress)
}

// Join runs `kubeadm join --config configPath`.
func (e *Exec) Join(ctx context.Context, configPath string, progress func(line string)) error {
	return e.run(ctx, "join", configPath, progress)
}

// Reset runs `kubeadm reset --force`: it removes what an interrupted init or join left on the node, so that
// the node can join again.
func (e *Exec) Reset(ctx context.Context, progress func(line string)) error {
	return e.exec(ctx, "reset", []string{"reset", "--force"}, progress)
}

// RenewCertificates runs `kubeadm certs renew all`: it signs the control-plane node's certificates and
// kubeconfigs again with the CA keys in certDir, for the validity of the cluster's ClusterConfiguration,
// which it reads through kubeconfig.
func (e *Exec) RenewCertificates(ctx context.Context, kubeconfig, certDir string, progress func(line string)) error {
	if kubeconfig == "" || certDir == "" {
		return errors.New("kubeadm certs renew: the kubeconfig and the certificates directory are required")
	}
	return e.exec(ctx, "certs renew", []string{"certs", "renew", "all", "--kubeconfig", kubeconfig, "--cert-dir", certDir}, progress)
}

func (e *Exec) run(ctx context.Context, command, configPath string, progress func(string)) error {
	if configPath == "" {
		return fmt.Errorf("kubeadm %s: config path is required", command)
	}
	args := []string{command, "--config", configPath}
	if len(e.IgnorePreflightErrors) > 0 {
		flag, err := ignoreFlag(command, e.IgnorePreflightErrors)
		if err != nil {
			return err
		}
		args = append(args, flag)
	}
	return e.exec(ctx, command, args, progress)
}

// ignoreFlag is --ignore-preflight-errors for checks.
func ignoreFlag(command string, checks []string) (string, error) {
	for _, check := range checks {
		if check == "" || strings.IndexFunc(check, func(r rune) bool { return r == ',' || unicode.IsSpace(r) || unicode.IsControl(r) }) >= 0 {
			return "", fmt.Errorf("kubeadm %s: preflight check name %q is empty or has a comma, whitespace or control characters", command, check)
		}
	}
	return "--ignore-preflight-errors=" + strings.Join(checks, ","), nil
}

// Version runs `kubeadm version -o short`: the release of the node's own kubeadm, which its image carries.
func (e *Exec) Version(ctx context.Context) (string, error) {
	var out []string
	if err := e.exec(ctx, "version", []string{"version", "-o", "short"}, func(line string) { out = append(out, line) }); err != nil {
		return "", err
	}
	if len(out) != 1 || !IsRelease(out[0]) {
		return "", fmt.Errorf("kubeadm version -o short printed %q, want one release such as v1.36.3", strings.Join(out, "\n"))
	}
	return out[0], nil
}

// upgradeCheck is the preflight check UpgradeApply ignores always: it runs a Job from the target's pause
// image on any node, and a node of the previous image that cannot pull lacks that image (see
// docs/kubernetes-upgrades.md). The Job proves only that the cluster schedules pods, which the roll needs
// anyway and which the upgrade itself does not depend on.
const upgradeCheck = "CreateJob"

// UpgradeApply runs `kubeadm upgrade apply <release>` on the node that leads a control-plane upgrade, without
// the addon phase: kube-proxy and CoreDNS follow only once every node runs release (UpgradeAddons), since
// nodes of the previous image may lack the new images. kubeadm reads the cluster through kubeconfig.
func (e *Exec) UpgradeApply(ctx context.Context, kubeconfig, release string, progress func(line string)) error {
	if !IsRelease(release) {
		return fmt.Errorf("kubeadm upgrade apply: %q is not a release such as v1.36.3", release)
	}
	ignore, err := ignoreFlag("upgrade apply", append([]string{upgradeCheck}, e.IgnorePreflightErrors...))
	if err != nil {
		return err
	}
	args := []string{"upgrade", "apply", release, "--yes", "--kubeconfig", kubeconfig, "--skip-phases=addon", ignore}
	return e.exec(ctx, "upgrade apply", args, progress)
}

// UpgradeNode runs `kubeadm upgrade node` on a control-plane node after another led the upgrade: it moves the
// node's static pods to the release kubeadm-config now names, without the addon phase (as UpgradeApply). Its
// preflight runs the node's checks as init and join do, so the node's ignored checks go to it too.
func (e *Exec) UpgradeNode(ctx context.Context, kubeconfig string, progress func(line string)) error {
	args := []string{"upgrade", "node", "--kubeconfig", kubeconfig, "--skip-phases=addon"}
	if len(e.IgnorePreflightErrors) > 0 {
		ignore, err := ignoreFlag("upgrade node", e.IgnorePreflightErrors)
		if err != nil {
			return err
		}
		args = append(args, ignore)
	}
	return e.exec(ctx, "upgrade node", args, progress)
}

// UpgradeAddons runs `kubeadm upgrade apply phase addon all <release>`: kube-proxy and CoreDNS at release.
// kubeadm itself skips them while any kube-apiserver pod runs another release.
func (e *Exec) UpgradeAddons(ctx context.Context, kubeconfig, release string, progress func(line string)) error {
	if !IsRelease(release) {
		return fmt.Errorf("kubeadm upgrade apply phase addon: %q is not a release such as v1.36.3", release)
	}
	args := []string{"upgrade", "apply", "phase", "addon", "all", release, "--kubeconfig", kubeconfig}
	return e.exec(ctx, "upgrade apply phase addon", args, progress)
}

// exec runs kubeadm with args, streaming its output to progress.
func (e *Exec) exec(ctx context.Context, command string, args []string, progress func(string)) error {
	logger := e.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	logger = logger.With("command", command)

	out := &lineWriter{emit: func(line string) {
		logger.Debug("kubeadm output", "line", line)
		if progress != nil {
			progress(line)
		}
	}}
	cmd := exec.CommandContext(ctx, cmp.Or(e.Binary, "kubeadm"), args...)
	// One writer for both streams: exec then gives kubeadm a single pipe, so
	// the lines arrive in the order kubeadm wrote them and Write is never
	// called concurrently.
	cmd.Stdout = out
	cmd.Stderr = out
	// kubeadm runs helpers (systemctl, crictl); cancelling must stop them
	// too, so kubeadm gets its own process group and the whole group is
	// killed.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error {
		err := syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		if errors.Is(err, syscall.ESRCH) {
			return os.ErrProcessDone
		}
		return err
	}
	cmd.WaitDelay = waitDelay

	logger.Info("running kubeadm", "binary", cmd.Path, "args", args)
	err := cmd.Run()
	out.flush()
	if err == nil {
		logger.Info("kubeadm finished")
		return nil
	}
	if ctxErr := ctx.Err(); ctxErr != nil && !errors.Is(err, ctxErr) {
		err = fmt.Errorf("%w (%v)", ctxErr, err)
	}
	return fmt.Errorf("kubeadm %s: %w%s", command, err, out.tailText())
}

// lineWriter splits output into lines, masks bootstrap tokens, passes each
// line on and keeps the last few for error messages.
type lineWriter struct {
	emit    func(string)
	partial []byte
	tail    []string
}

func (w *lineWriter) Write(p []byte) (int, error) {
	n := len(p)
	for len(p) > 0 {
		i := bytes.IndexByte(p, '\n')
		if i < 0 {
			w.partial = append(w.partial, p...)
			if len(w.partial) >= maxLineBytes {
				w.flush()
			}
			break
		}
		w.partial = append(w.partial, p[:i]...)
		w.flush()
		p = p[i+1:]
	}
	return n, nil
}

// flush emits the buffered line; blank lines carry nothing and are dropped.
func (w *lineWriter) flush() {
	if len(w.partial) == 0 {
		return
	}
	line := tokenInOutput.ReplaceAllString(strings.TrimSuffix(string(w.partial), "\r"), "<redacted-token>")
	w.partial = w.partial[:0]
	if len(w.tail) == tailLines {
		w.tail = append(w.tail[:0], w.tail[1:]...)
	}
	w.tail = append(w.tail, line)
	w.emit(line)
}

func (w *lineWriter) tailText() string {
	if len(w.tail) == 0 {
		return "; no output"
	}
	return fmt.Sprintf("; last %d lines of output:\n%s", len(w.tail), strings.Join(w.tail, "\n"))
}
