package lab

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/test/scenario"
)

// labCluster is a lab as scenario.Cluster, on the cloud the lab stands in for: platform says how that
// cloud makes an outsider and how its join service refuses one.
type labCluster struct {
	l        *Lab
	cp       *Node // the control-plane node whose join service the machines ask
	platform labPlatform
}

// labPlatform is what differs between the clouds a lab stands in for.
type labPlatform interface {
	// outsider makes m a machine of kind (not scenario.Genuine) on this cloud.
	outsider(m *Machine, kind scenario.Kind) error
	// refusal are the texts of the join service's log line that refuses n, a machine of kind.
	refusal(n *Node, kind scenario.Kind) []string
}

type labNode struct {
	n    *Node
	kind scenario.Kind
}

func (n labNode) Name() string      { return n.n.Name }
func (n labNode) Booted() time.Time { return n.n.booted }

func (c *labCluster) Boot(ctx context.Context, name string, kind scenario.Kind) (scenario.Node, error) {
	m := c.l.machine(NodeSpec{name, metadata.RoleWorker})
	if kind != scenario.Genuine {
		if err := c.platform.outsider(&m, kind); err != nil {
			return nil, err
		}
	}
	n, err := c.l.AddNode(ctx, m)
	if err != nil {
		return nil, err
	}
	return labNode{n, kind}, nil
}

func (c *labCluster) WaitJoined(ctx context.Context, n scenario.Node) error {
	ctx, cancel := context.WithTimeout(ctx, 4*time.Minute)
	defer cancel()
	return c.l.WaitReady(ctx, []*Node{n.(labNode).n})
}

func (c *labCluster) WaitRefused(ctx context.Context, n scenario.Node) (string, error) {
	ln := n.(labNode)
	texts := c.platform.refusal(ln.n, ln.kind)
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	for {
		log, err := c.log()
		if err != nil {
			return "", err
		}
		if lines := grepLines(log, texts); strings.Count(lines, "\n") >= 2 {
			return tail(lines, 1), nil
		}
		if joined, err := c.Ticketed(n); err != nil || joined {
			return "", errors.Join(err, errors.New("it was given a join ticket"))
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("fewer than two lines of %s's agent log have all of %q: %w; it reads:\n%s",
				c.cp.Name, texts, ctx.Err(), tail(log, 40))
		case <-time.After(time.Second):
		}
	}
}

func (c *labCluster) log() (string, error) {
	data, err := os.ReadFile(c.cp.path("logs/agent.log"))
	return string(data), err
}

func (c *labCluster) Ticketed(n scenario.Node) (bool, error) {
	ln := n.(labNode)
	own, err := os.ReadFile(ln.n.path("logs/agent.log"))
	if err != nil {
		return false, err
	}
	log, err := c.log()
	if err != nil {
		return false, err
	}
	issued := grepLines(log, []string{`"msg":"join ticket issued"`, `"peer_node":"` + ln.n.Name + `"`})
	return issued != "" || strings.Contains(string(own), `"msg":"join ticket received"`), nil
}

func (c *labCluster) Members(ctx context.Context) ([]string, error) {
	out, err := c.l.Kubectl(ctx, "get", "nodes", "-o", "jsonpath={.items[*].metadata.name}")
	if err != nil {
		return nil, err
	}
	return slices.Sorted(slices.Values(strings.Fields(out))), nil
}

// StayOut: a good node is Ready here within 10 to 20 s of its boot with several joining at once.
func (c *labCluster) StayOut() time.Duration { return 30 * time.Second }

// cloudOutsiders makes outsiders the way both clouds do: a foreign TPM is a machine whose TPM's key is not
// the one the cloud reports for its instance, and a machine with no role is an instance of noRoleGroup.
type cloudOutsiders struct {
	noRoleGroup string
}

func (o cloudOutsiders) outsider(m *Machine, kind scenario.Kind) error {
	switch kind {
	case scenario.ForeignTPM:
		other, err := rsa.GenerateKey(rand.Reader, 2048)
		if err != nil {
			return err
		}
		m.ReportedEK = &other.PublicKey
	case scenario.NoRole:
		m.Group = o.noRoleGroup
	default:
		return fmt.Errorf("no %v machine in this lab", kind)
	}
	return nil
}
