package lab

import (
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/berthlabs/berth/internal/metadata"
)

// Kubectl runs the built kubectl against the lab's cluster.
func (l *Lab) Kubectl(ctx context.Context, args ...string) (string, error) {
	return run(ctx, filepath.Join(l.cfg.KubeBin, "kubectl"), append([]string{"--kubeconfig", l.Kubeconfig}, args...)...)
}

// WaitReady waits until every node in nodes is Ready, control-plane nodes also serving joins, and records
// each node's time from boot to Ready. It fails when a node's agent exits, or when ctx ends first.
func (l *Lab) WaitReady(ctx context.Context, nodes []*Node) error {
	pending := map[string]*Node{}
	for _, n := range nodes {
		pending[n.Name] = n
	}
	for len(pending) > 0 {
		ready, err := l.readyNodes(ctx)
		if err == nil {
			for name, since := range ready {
				if n, ok := pending[name]; ok {
					// A control-plane node is Ready before its kubeadm join has finished (etcd's member
					// joins after the kubelet registers); it is up once its join service listens, and a
					// test that powers off another control-plane node before then may take etcd's quorum
					// from a join still in progress.
					if n.Role == metadata.RoleControlPlane && !n.servesJoins() {
						continue
					}
					// A node may have been Ready for a while when another process waits for it: the
					// condition's transition says when it became Ready (to the second).
					d := since.Sub(n.booted)
					if since.Before(n.booted) {
						d = time.Since(n.booted)
					}
					l.Timings["ready/"+name] = d
					l.progress("%s: Ready, %.1fs after boot", name, d.Seconds())
					delete(pending, name)
				}
			}
		}
		if len(pending) == 0 {
			break
		}
		for _, n := range pending {
			if err := n.agentGone(); err != nil {
				return l.nodeFailure(n, "boot", err)
			}
		}
		select {
		case <-ctx.Done():
			for _, n := range pending {
				return l.nodeFailure(n, "waiting for Ready", fmt.Errorf("not Ready: %v (last kubectl error: %v)", ctx.Err(), err))
			}
		case <-time.After(time.Second):
		}
	}
	return nil
}

// readyNodes are the nodes whose Ready condition is True, with the time it became so.
func (l *Lab) readyNodes(ctx context.Context) (map[string]time.Time, error) {
	out, err := l.Kubectl(ctx, "get", "nodes", "-o", "json")
	if err != nil {
		return nil, err
	}
	var list struct {
		Items []struct {
			Metadata struct{ Name string }
			Status   struct {
				Conditions []struct {
					Type, Status       string
					LastTransitionTime time.Time
				}
			}
		}
	}
	if err := json.Unmarshal([]byte(out), &list); err != nil {
		return nil, err
	}
	ready := map[string]time.Time{}
	for _, it := range list.Items {
		for _, c := range it.Status.Conditions {
			if c.Type == "Ready" && c.Status == "True" {
				ready[it.Metadata.Name] = c.LastTransitionTime
			}
		}
	}
	return ready, nil
}

// WaitRestarted waits until n is Ready again with a heartbeat after since: a kubelet that came back.
func (l *Lab) WaitRestarted(ctx context.Context, n *Node, since time.Time) error {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	for {
		out, err := l.Kubectl(ctx, "get", "node", n.Name, "-o", "jsonpath={.status.conditions[?(@.type==\"Ready\")].status} {.status.conditions[?(@.type==\"Ready\")].lastHeartbeatTime}")
		if err == nil {
			var status, beat string
			fmt.Sscan(out, &status, &beat)
			if t, perr := time.Parse(time.RFC3339, beat); perr == nil && status == "True" && !t.Before(since.Truncate(time.Second)) {
				l.Timings["ready/"+n.Name] = time.Since(n.booted)
				l.progress("%s: Ready again, %.1fs after boot", n.Name, time.Since(n.booted).Seconds())
				return nil
			}
		}
		if err := n.agentGone(); err != nil {
			return l.nodeFailure(n, "reboot", err)
		}
		select {
		case <-ctx.Done():
			return l.nodeFailure(n, "waiting for Ready after reboot", fmt.Errorf("%v (last: %q, %v)", ctx.Err(), out, err))
		case <-time.After(time.Second):
		}
	}
}

// RunPod runs a pod of the lab's locally built workload image on node and waits until it runs.
func (l *Lab) RunPod(ctx context.Context, name string, node *Node) error {
	return l.runPod(ctx, name, node, "", "")
}

// podDataDir is where writer pods keep their files on their node: a directory of the node's own disk.
const podDataDir = "/var/lib/kubelet/berthlab-data"

// RunWriterPod runs a pod on node that writes content to a file of its own on the node's storage (a
// hostPath under podDataDir) once, and returns where the file is seen from the host.
func (l *Lab) RunWriterPod(ctx context.Context, name string, node *Node, content string) (string, error) {
	container := fmt.Sprintf(`    env:
    - {name: BERTH_LAB_WRITE, value: /data/%s}
    - {name: BERTH_LAB_CONTENT, value: %q}
    volumeMounts:
    - {name: data, mountPath: /data}
`, name, content)
	volumes := fmt.Sprintf(`  volumes:
  - name: data
    hostPath: {path: %s, type: DirectoryOrCreate}
`, podDataDir)
	if err := l.runPod(ctx, name, node, container, volumes); err != nil {
		return "", err
	}
	return node.path(filepath.Join("fs", podDataDir, name)), nil
}

// runPod runs a pod with the lab's workload image and the given extra YAML for its container and its spec.
func (l *Lab) runPod(ctx context.Context, name string, node *Node, container, spec string) error {
	manifest := fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata:
  name: %s
  namespace: default
spec:
  nodeName: %s
  containers:
  - name: sleeper
    image: %s
    imagePullPolicy: Never
%s  tolerations:
  - operator: Exists
%s`, name, node.Name, WorkloadImage, container, spec)
	if _, err := l.kubectlStdin(ctx, manifest, "apply", "-f", "-"); err != nil {
		return err
	}
	if _, err := l.Kubectl(ctx, "wait", "--for=jsonpath={.status.phase}=Running", "--timeout=120s", "pod/"+name); err != nil {
		desc, _ := l.Kubectl(ctx, "describe", "pod", name)
		return l.nodeFailure(node, "running pod "+name, fmt.Errorf("%w\n%s", err, desc))
	}
	l.progress("%s: pod %s Running from the locally built image %s", node.Name, name, WorkloadImage)
	return nil
}

func (l *Lab) kubectlStdin(ctx context.Context, stdin string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, filepath.Join(l.cfg.KubeBin, "kubectl"), append([]string{"--kubeconfig", l.Kubeconfig}, args...)...)
	cmd.Stdin = strings.NewReader(stdin)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}
