// Package scenario holds what a Berth cluster must do, written once and played by every harness that can
// play it: the in-process join lab (nodeagent/test/joinlab: one join service, and agents' join clients on
// loopback with real TPMs and LUKS2 disks) on the lab's platform, and the real-cluster lab (test/lab:
// Kubernetes nodes in network namespaces) on each cloud it stands in for. A harness implements Cluster;
// a scenario is a function of a testing.TB and a Cluster, and what only one platform shows (which cloud
// API was asked what) stays in that platform's test, after the scenario.
package scenario

import (
	"context"
	"slices"
	"testing"
	"time"
)

// Kind is what a machine is to the platform its cluster runs on.
type Kind int

const (
	// Genuine is a machine the platform records with a role, with a TPM the platform vouches for.
	Genuine Kind = iota
	// ForeignTPM is a machine the platform records with a role, whose TPM the platform does not vouch for:
	// an endorsement key certified by another CA, or not the one the cloud reports for the instance.
	ForeignTPM
	// NoRole is a machine with a genuine TPM that the platform gives no role: no instance record, or an
	// instance of a group that no role is configured for.
	NoRole
)

func (k Kind) String() string {
	switch k {
	case Genuine:
		return "genuine"
	case ForeignTPM:
		return "foreign TPM"
	case NoRole:
		return "no role"
	}
	return "unknown kind"
}

// Cluster is a running cluster with a join service, as a scenario sees it.
type Cluster interface {
	// Boot makes a new worker machine of kind and starts its agent; it returns without waiting for a join.
	Boot(ctx context.Context, name string, kind Kind) (Node, error)
	// WaitJoined waits until n has joined: it received its ticket and, where the harness runs
	// Kubernetes, its Node is Ready.
	WaitJoined(ctx context.Context, n Node) error
	// WaitRefused waits until the join service has refused n at least twice (n tried again), each time
	// saying in its log why, for the reason n's kind gives, and returns one of those lines.
	WaitRefused(ctx context.Context, n Node) (string, error)
	// Ticketed tells whether the join service issued n a ticket or n received one.
	Ticketed(n Node) (bool, error)
	// Members names the cluster's nodes, sorted.
	Members(ctx context.Context) ([]string, error)
	// StayOut is how long after its boot a refused machine is watched: several times what a genuine
	// join takes in this harness.
	StayOut() time.Duration
}

// Node is one machine that Cluster.Boot started.
type Node interface {
	Name() string
	Booted() time.Time
}

// OutsidersStayOut boots a genuine worker together with a machine whose TPM the platform does not vouch
// for and one that the platform gives no role.
// The genuine worker joins; each outsider is refused, for its reason, again when it retries, never gets a
// ticket and never becomes a member. It returns the three machines, genuine first, for the checks that
// only the calling platform can make.
func OutsidersStayOut(ctx context.Context, t testing.TB, c Cluster) (genuine, foreign, noRole Node) {
	t.Helper()
	before, err := c.Members(ctx)
	if err != nil {
		t.Fatalf("members before: %v", err)
	}
	// The outsiders boot first, so that their refusals happen while the genuine worker joins.
	boot := func(name string, kind Kind) Node {
		t.Helper()
		n, err := c.Boot(ctx, name, kind)
		if err != nil {
			t.Fatalf("booting the %s machine %s: %v", kind, name, err)
		}
		return n
	}
	// Node names fit the lab's limit of 12 characters (its interface names carry them).
	foreign = boot("foreign-tpm", ForeignTPM)
	noRole = boot("no-role", NoRole)
	genuine = boot("genuine", Genuine)
	if err := c.WaitJoined(ctx, genuine); err != nil {
		t.Fatalf("%s (genuine) did not join: %v", genuine.Name(), err)
	}
	for _, n := range []Node{foreign, noRole} {
		line, err := c.WaitRefused(ctx, n)
		if err != nil {
			t.Fatalf("%s: %v", n.Name(), err)
		}
		t.Logf("%s refused: %s", n.Name(), line)
	}
	// They stay out: a genuine machine joins well within StayOut of its boot, and the outsiders keep
	// trying for all of it.
	for _, n := range []Node{foreign, noRole} {
		if d := time.Until(n.Booted().Add(c.StayOut())); d > 0 {
			select {
			case <-time.After(d):
			case <-ctx.Done():
				t.Fatal(ctx.Err())
			}
		}
	}
	after, err := c.Members(ctx)
	if err != nil {
		t.Fatalf("members after: %v", err)
	}
	if want := slices.Sorted(slices.Values(append(before, genuine.Name()))); !slices.Equal(after, want) {
		t.Errorf("the cluster's members are %v, want %v", after, want)
	}
	for _, n := range []Node{foreign, noRole} {
		if got, err := c.Ticketed(n); err != nil || got {
			t.Errorf("%s was given a join ticket (%v, %v)", n.Name(), got, err)
		}
	}
	return genuine, foreign, noRole
}
