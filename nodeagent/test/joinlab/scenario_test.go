package joinlab

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/nodeagent/internal/joinservice"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
	"github.com/berthlabs/berth/test/clustertest"
	"github.com/berthlabs/berth/test/scenario"
	"github.com/berthlabs/berth/test/swtpm/swtpmtest"
)

// TestScenarios plays the shared scenarios on the lab's platform, in process: the records are the lab's
// metadata service, the TPMs' trust the lab's EK CA.
func TestScenarios(t *testing.T) {
	t.Run("OutsidersStayOut", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		c := newScenarioCluster(t, ctx)
		scenario.OutsidersStayOut(ctx, t, c)
	})
}

// scenarioCluster is the join lab as scenario.Cluster: each machine runs the agent's join client in a
// goroutine until it joins or the test ends.
type scenarioCluster struct {
	lab     *Lab
	logs    *clustertest.SafeBuffer // the join service's log, debug lines included (admission's refusals)
	foreign *swtpmtest.CA
	ctx     context.Context
	wg      sync.WaitGroup
}

type scenarioNode struct {
	*Node
	kind   scenario.Kind
	booted time.Time
	done   chan struct{}
	err    error // set before done closes
}

func (n *scenarioNode) Name() string      { return n.Node.Name }
func (n *scenarioNode) Booted() time.Time { return n.booted }

func newScenarioCluster(t *testing.T, ctx context.Context) *scenarioCluster {
	logs := &clustertest.SafeBuffer{}
	debug := func(c *joinservice.Config) {
		c.Logger = slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	ctx, cancel := context.WithCancel(ctx)
	c := &scenarioCluster{lab: New(t, debug), logs: logs, foreign: swtpmtest.NewCA(t), ctx: ctx}
	// The outsiders retry until the test ends; the cleanup stops them before goleak looks.
	t.Cleanup(func() { cancel(); c.wg.Wait() })
	return c
}

// Boot makes the machine and starts its join. A foreign TPM's EK is certified by another CA; a machine
// with no role is missing from the records the join service reads, but its own metadata view lists it
// with the lab's join service.
func (c *scenarioCluster) Boot(ctx context.Context, name string, kind scenario.Kind) (scenario.Node, error) {
	var n *Node
	var view *metadata.Client
	switch kind {
	case scenario.Genuine:
		n = c.lab.AddNode(name, metadata.RoleWorker)
	case scenario.ForeignTPM:
		n = c.lab.addForeignNode(c.lab.t, c.foreign, name)
	case scenario.NoRole:
		n = c.lab.AddUnlistedNode(name)
		view = metadataPointingTo(c.lab, n, c.lab.JoinAddr)
	default:
		return nil, fmt.Errorf("no machine of kind %v here", kind)
	}
	if view == nil {
		view = c.lab.Metadata(n)
	}
	prepared, err := n.Disk.Prepare(ctx)
	if err != nil {
		return nil, err
	}
	sn := &scenarioNode{Node: n, kind: kind, booted: time.Now(), done: make(chan struct{})}
	client := c.lab.joinClientWith(n, view, &Kubeadm{}, &nodestate.Lock{})
	c.wg.Go(func() {
		defer close(sn.done)
		_, sn.err = client.Join(c.ctx, prepared)
	})
	return sn, nil
}

func (c *scenarioCluster) WaitJoined(ctx context.Context, n scenario.Node) error {
	sn := n.(*scenarioNode)
	select {
	case <-sn.done:
		return sn.err
	case <-ctx.Done():
		return fmt.Errorf("no ticket: %w\n%s", ctx.Err(), c.logs)
	}
}

// refusal are the texts of the join service's log line that refuses n.
func (c *scenarioCluster) refusal(n *scenarioNode) []string {
	if n.kind == scenario.NoRole {
		return []string{`msg="connection refused"`, "peer=" + n.Addr.String() + " ", "not admitted"}
	}
	return []string{`msg="attestation refused"`, "peer_node=" + n.Name() + " "}
}

func (c *scenarioCluster) WaitRefused(ctx context.Context, n scenario.Node) (string, error) {
	sn := n.(*scenarioNode)
	texts := c.refusal(sn)
	for {
		if lines := c.logLines(texts); len(lines) >= 2 {
			return lines[0], nil
		}
		if joined, _ := c.Ticketed(sn); joined {
			return "", errors.New("it was given a join ticket")
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("fewer than two lines of the join service's log have all of %q: %w\n%s", texts, ctx.Err(), c.logs)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// logLines are the join service's log lines that hold every text.
func (c *scenarioCluster) logLines(texts []string) []string {
	var lines []string
	for line := range strings.Lines(c.logs.String()) {
		if allOf(line, texts) {
			lines = append(lines, strings.TrimSpace(line))
		}
	}
	return lines
}

func allOf(line string, texts []string) bool {
	for _, text := range texts {
		if !strings.Contains(line, text) {
			return false
		}
	}
	return true
}

func (c *scenarioCluster) Ticketed(n scenario.Node) (bool, error) {
	sn := n.(*scenarioNode)
	select {
	case <-sn.done:
		if sn.err == nil {
			return true, nil
		}
	default:
	}
	return len(c.logLines([]string{`msg="join ticket issued"`, "peer_node=" + sn.Name() + " "})) > 0, nil
}

// Members are the nodes the join service recorded a disk for: in process there is no Kubernetes, and the
// record is what a join leaves in the cluster.
func (c *scenarioCluster) Members(ctx context.Context) ([]string, error) {
	disks, err := c.lab.Kube.CoreV1().ConfigMaps(joinservice.Namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	var names []string
	for _, d := range disks.Items {
		if name := d.Annotations["berth.dev/instance-name"]; name != "" && !slices.Contains(names, name) {
			names = append(names, name)
		}
	}
	slices.Sort(names)
	return names, nil
}

// StayOut: a join in process takes well under a second.
func (c *scenarioCluster) StayOut() time.Duration { return 3 * time.Second }
