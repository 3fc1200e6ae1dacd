package kubelet

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
)

// TestSupervisor runs a stand-in kubelet that records its arguments and exits, and checks that the
// supervisor waits for kubeadm's files, passes the drop-in's flags, restarts the kubelet and stops with ctx.
func TestSupervisor(t *testing.T) {
	dir := t.TempDir()
	paths := nodestate.Paths{State: filepath.Join(dir, "state"), KubernetesDir: filepath.Join(dir, "etc"), KubeletDir: filepath.Join(dir, "kubelet")}
	for _, d := range []string{paths.State, paths.KubernetesDir, paths.KubeletDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	record := filepath.Join(dir, "runs")
	bin := filepath.Join(dir, "fake-kubelet")
	if err := os.WriteFile(bin, []byte("#!/bin/sh\necho \"$*\" >> "+record+"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	s := &Supervisor{Binary: bin, Paths: paths, ExtraArgs: map[string]string{"cgroup-root": "/lab/n1", "b": "2"},
		Poll: time.Millisecond, RestartDelay: time.Millisecond}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()

	time.Sleep(20 * time.Millisecond)
	if _, err := os.Stat(record); err == nil {
		t.Fatal("the kubelet started before kubeadm wrote its configuration")
	}
	if err := os.WriteFile(filepath.Join(paths.KubeletDir, "config.yaml"), []byte("kind: KubeletConfiguration\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	// kubeadm writes its files in place: the supervisor may find the flags file empty before it is complete.
	flags := filepath.Join(paths.KubeletDir, "kubeadm-flags.env")
	if err := os.WriteFile(flags, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond)
	if _, err := os.Stat(record); err == nil {
		t.Fatal("the kubelet started from an empty kubeadm-flags.env")
	}
	env := "KUBELET_KUBEADM_ARGS=\"--container-runtime-endpoint=unix:///run/containerd/containerd.sock --node-ip=10.0.0.5\"\n"
	if err := os.WriteFile(flags, []byte(env), 0o644); err != nil {
		t.Fatal(err)
	}
	var runs []string
	for deadline := time.Now().Add(10 * time.Second); len(runs) < 2; {
		data, _ := os.ReadFile(record)
		runs = strings.Split(strings.TrimSpace(string(data)), "\n")
		if len(data) == 0 {
			runs = nil
		}
		if time.Now().After(deadline) {
			t.Fatalf("the kubelet was not restarted after it exited: runs %q", runs)
		}
		time.Sleep(5 * time.Millisecond)
	}
	want := "--bootstrap-kubeconfig=" + paths.KubernetesDir + "/bootstrap-kubelet.conf --kubeconfig=" + paths.KubernetesDir +
		"/kubelet.conf --config=" + paths.KubeletDir + "/config.yaml --container-runtime-endpoint=unix:///run/containerd/containerd.sock" +
		" --node-ip=10.0.0.5 --b=2 --cgroup-root=/lab/n1"
	if runs[0] != want {
		t.Errorf("kubelet arguments\n got %s\nwant %s", runs[0], want)
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("Run returned %v, want context.Canceled", err)
	}
}

// TestSupervisorWakesOnWrite checks that the kubelet starts once kubeadm has written its files, without
// waiting for the supervisor's next poll: a joining node's Ready waits for it.
func TestSupervisorWakesOnWrite(t *testing.T) {
	dir := t.TempDir()
	paths := nodestate.Paths{State: filepath.Join(dir, "state"), KubernetesDir: filepath.Join(dir, "etc"), KubeletDir: filepath.Join(dir, "kubelet")}
	for _, d := range []string{paths.State, paths.KubernetesDir, paths.KubeletDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	started := filepath.Join(dir, "started")
	bin := filepath.Join(dir, "fake-kubelet")
	if err := os.WriteFile(bin, []byte("#!/bin/sh\ntouch "+started+"\nexec sleep 60\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	s := &Supervisor{Binary: bin, Paths: paths, Poll: time.Hour, RestartDelay: time.Hour}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	// Let the supervisor find nothing and begin its wait.
	time.Sleep(50 * time.Millisecond)
	if err := os.WriteFile(filepath.Join(paths.KubeletDir, "config.yaml"), []byte("kind: KubeletConfiguration\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(paths.KubeletDir, "kubeadm-flags.env"), []byte("KUBELET_KUBEADM_ARGS=\"--node-ip=10.0.0.5\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if _, err := os.Stat(started); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the kubelet did not start after its files were written: the supervisor waited for its hourly poll")
		}
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("Run returned %v, want context.Canceled", err)
	}
}

func TestReadFlagsEnv(t *testing.T) {
	path := filepath.Join(t.TempDir(), "kubeadm-flags.env")
	if err := os.WriteFile(path, []byte("# comment\nOTHER=1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := readFlagsEnv(path); err == nil || !strings.Contains(err.Error(), "no KUBELET_KUBEADM_ARGS") {
		t.Errorf("file without the variable: %v", err)
	}
}

func TestRemoveStartFiles(t *testing.T) {
	dir := t.TempDir()
	paths := nodestate.Paths{KubeletDir: dir}
	keep := filepath.Join(dir, "pki", "kubelet-client-current.pem")
	for _, f := range []string{"config.yaml", "kubeadm-flags.env", "pki/kubelet-client-current.pem"} {
		if err := nodestate.WriteFile(filepath.Join(dir, f), []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := RemoveStartFiles(paths); err != nil {
		t.Fatal(err)
	}
	if _, err := (&Supervisor{Paths: paths}).args(filepath.Join(dir, "kubeadm-flags.env"), filepath.Join(dir, "config.yaml")); err == nil {
		t.Error("the supervisor would still start a kubelet")
	}
	if _, err := os.Stat(keep); err != nil {
		t.Errorf("other kubelet files went too: %v", err)
	}
	if err := RemoveStartFiles(paths); err != nil {
		t.Errorf("removing again: %v", err)
	}
}
