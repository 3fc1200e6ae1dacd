package lab

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"time"
)

// Kubectl runs the built kubectl against the lab's cluster.
func (l *Lab) Kubectl(ctx context.Context, args ...string) (string, error) {
	return run(ctx, filepath.Join(l.cfg.KubeBin, "kubectl"), append([]string{"--kubeconfig", l.Kubeconfig}, args...)...)
}

// WaitReady waits until every node in nodes is Ready, and records each node's time from boot to Ready.
func (l *Lab) WaitReady(ctx context.Context, nodes []*Node) error {
	ctx, cancel := context.WithTimeout(ctx, 4*time.Minute)
	defer cancel()
	pending := map[string]*Node{}
	for _, n := range nodes {
		pending[n.Name] = n
	}
	for len(pending) > 0 {
		ready, err := l.readyNodes(ctx)
		if err == nil {
			for name := range ready {
				if n, ok := pending[name]; ok {
					l.Timings["ready/"+name] = time.Since(n.booted)
					l.progress("%s: Ready, %.1fs after boot", name, time.Since(n.booted).Seconds())
					delete(pending, name)
				}
			}
		}
		if len(pending) == 0 {
			break
		}
		for _, n := range pending {
			select {
			case exit := <-n.agentExit:
				return l.nodeFailure(n, "boot", exit)
			default:
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

// readyNodes are the nodes whose Ready condition is True.
func (l *Lab) readyNodes(ctx context.Context) (map[string]bool, error) {
	out, err := l.Kubectl(ctx, "get", "nodes", "-o", "json")
	if err != nil {
		return nil, err
	}
	var list struct {
		Items []struct {
			Metadata struct{ Name string }
			Status   struct {
				Conditions []struct{ Type, Status string }
			}
		}
	}
	if err := json.Unmarshal([]byte(out), &list); err != nil {
		return nil, err
	}
	ready := map[string]bool{}
	for _, it := range list.Items {
		for _, c := range it.Status.Conditions {
			if c.Type == "Ready" && c.Status == "True" {
				ready[it.Metadata.Name] = true
			}
		}
	}
	return ready, nil
}
