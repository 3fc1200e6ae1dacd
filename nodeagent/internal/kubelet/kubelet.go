// Package kubelet runs the kubelet on machines without systemd, the way kubeadm's systemd drop-in would:
// it waits for the files kubeadm writes (the kubelet configuration and kubeadm-flags.env; the join client
// writes the same two when a node joins without kubeadm), then starts the kubelet with the same flags, and
// starts it again whenever it exits, until stopped.
package kubelet

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/berthlabs/berth/internal/backoff"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
)

// Supervisor runs one kubelet.
type Supervisor struct {
	Binary    string            // default "kubelet"
	Paths     nodestate.Paths   // where kubeadm writes the kubelet's files
	ExtraArgs map[string]string // this node's own flags (KUBELET_EXTRA_ARGS)
	Logger    *slog.Logger
	// Poll is how often the supervisor looks for kubeadm's files when no write in their directory woke it
	// first; RestartDelay is the pause before a kubelet that exited is started again.
	Poll, RestartDelay time.Duration
}

// Run waits for kubeadm's files, then keeps a kubelet running until ctx ends; it returns ctx's error.
func (s *Supervisor) Run(ctx context.Context) error {
	log := s.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log = log.With("component", "kubelet")
	poll := cmpDuration(s.Poll, 200*time.Millisecond)
	restart := cmpDuration(s.RestartDelay, 2*time.Second)
	flagsFile := filepath.Join(s.Paths.KubeletDir, "kubeadm-flags.env")
	configFile := filepath.Join(s.Paths.KubeletDir, "config.yaml")
	for {
		args, err := s.waitForStartFiles(ctx, log, poll, flagsFile, configFile)
		if err != nil {
			return err
		}
		err = s.runOnce(ctx, log, args)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		log.Warn("kubelet exited; starting it again", "error", err, "in", restart)
		if err := backoff.Sleep(ctx, restart); err != nil {
			return err
		}
	}
}

// waitForStartFiles waits until the kubelet's configuration and flags are complete and returns its
// arguments. The kubelet is on a joining node's path to Ready, so the supervisor wakes as soon as a file of
// the kubelet's directory is written (inotify) rather than at its next poll; the poll stays for what a
// watch cannot see (a directory made later, a watch the kernel refuses).
func (s *Supervisor) waitForStartFiles(ctx context.Context, log *slog.Logger, poll time.Duration, flagsFile, configFile string) ([]string, error) {
	// Watch before the first look, so that a write between a look and the wait still wakes it.
	w, werr := watchDir(s.Paths.KubeletDir)
	if werr == nil {
		defer w.Close()
	}
	lastWait := ""
	for {
		args, err := s.args(flagsFile, configFile)
		if err == nil {
			return args, nil
		}
		// Missing, or still being written: kubeadm writes its files in place, so a reader can see one
		// half-written. Either way the kubelet is not ready to start yet.
		if err.Error() != lastWait {
			log.Info("waiting for the kubelet's configuration (from kubeadm, or from a ticket without kubeadm)", "reason", err)
			lastWait = err.Error()
		}
		if werr != nil {
			err = backoff.Sleep(ctx, poll)
		} else {
			err = w.wait(ctx, poll)
		}
		if err != nil {
			return nil, err
		}
	}
}

// dirWatch is an inotify watch of one directory for files written or moved into it.
type dirWatch struct{ f *os.File }

func watchDir(dir string) (*dirWatch, error) {
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		return nil, fmt.Errorf("watching %s: %w", dir, err)
	}
	if _, err := unix.InotifyAddWatch(fd, dir, unix.IN_CLOSE_WRITE|unix.IN_MOVED_TO); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("watching %s: %w", dir, err)
	}
	// A non-blocking descriptor in an os.File waits in Go's netpoller, so reads take deadlines.
	return &dirWatch{f: os.NewFile(uintptr(fd), "inotify:"+dir)}, nil
}

// wait returns once a file was written in the directory or at most d later, and ctx's error if it ended.
func (w *dirWatch) wait(ctx context.Context, d time.Duration) error {
	if err := w.f.SetReadDeadline(time.Now().Add(d)); err != nil {
		return err
	}
	stop := context.AfterFunc(ctx, func() { w.f.SetReadDeadline(time.Now()) })
	defer stop()
	// The events only say that something changed; the caller looks at the files again either way.
	buf := make([]byte, 4096)
	_, err := w.f.Read(buf)
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
		// A watch that cannot be read is no reason to stop: the supervisor polls instead.
		return backoff.Sleep(ctx, d)
	}
	return nil
}

func (w *dirWatch) Close() error { return w.f.Close() }

func (s *Supervisor) runOnce(ctx context.Context, log *slog.Logger, args []string) error {
	bin := s.Binary
	if bin == "" {
		bin = "kubelet"
	}
	cmd := exec.CommandContext(ctx, bin, args...)
	logFile, err := os.OpenFile(filepath.Join(s.Paths.State, "kubelet.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("kubelet log: %w", err)
	}
	defer logFile.Close()
	cmd.Stdout, cmd.Stderr = logFile, logFile
	// The kubelet gets SIGTERM first so it can stop its pods' probes cleanly.
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 10 * time.Second
	log.Info("starting kubelet", "binary", bin, "args", strings.Join(args, " "), "log", logFile.Name())
	return cmd.Run()
}

// RemoveStartFiles removes the kubelet's configuration and flags, so that a supervisor started next waits
// for a join to write them again instead of starting a kubelet from a join that never finished.
func RemoveStartFiles(p nodestate.Paths) error {
	for _, name := range []string{"config.yaml", "kubeadm-flags.env"} {
		if err := os.Remove(filepath.Join(p.KubeletDir, name)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("removing the kubelet's configuration: %w", err)
		}
	}
	return nil
}

// args are the kubelet's flags as kubeadm's systemd drop-in composes them.
func (s *Supervisor) args(flagsFile, configFile string) ([]string, error) {
	if _, err := os.Stat(configFile); err != nil {
		return nil, err
	}
	kubeadmArgs, err := readFlagsEnv(flagsFile)
	if err != nil {
		return nil, err
	}
	args := []string{
		"--bootstrap-kubeconfig=" + filepath.Join(s.Paths.KubernetesDir, "bootstrap-kubelet.conf"),
		"--kubeconfig=" + filepath.Join(s.Paths.KubernetesDir, "kubelet.conf"),
		"--config=" + configFile,
	}
	args = append(args, kubeadmArgs...)
	keys := make([]string, 0, len(s.ExtraArgs))
	for k := range s.ExtraArgs {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		args = append(args, fmt.Sprintf("--%s=%s", k, s.ExtraArgs[k]))
	}
	return args, nil
}

// readFlagsEnv reads KUBELET_KUBEADM_ARGS from kubeadm-flags.env: one line, KUBELET_KUBEADM_ARGS="--a=b --c=d".
// kubeadm never writes a value with a space, so splitting on spaces is what systemd does too.
func readFlagsEnv(path string) ([]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		name, value, ok := strings.Cut(strings.TrimSpace(sc.Text()), "=")
		if !ok || name != "KUBELET_KUBEADM_ARGS" {
			continue
		}
		return strings.Fields(strings.Trim(value, `"`)), nil
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("reading %s: %w", path, err)
	}
	return nil, fmt.Errorf("%s has no KUBELET_KUBEADM_ARGS", path)
}

func cmpDuration(d, def time.Duration) time.Duration {
	if d > 0 {
		return d
	}
	return def
}
