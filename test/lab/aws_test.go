package lab

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/cloud/aws/ec2instances/ec2test"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/test/imdstest"
)

// TestAWSLab runs the agents as on EC2 (AWSConfig): every node reads itself from its own IMDS (AWS's
// ec2-metadata-mock inside its network namespace), has a TPM without EK certificate, and is an instance of
// the lab's EC2 endpoint. The control-plane node is initialized as berth_cluster's aws block does it (its
// TPM trusted by the EK EC2 reports for its instance); its join service looks nodes up through EC2 with
// the instance profile's credentials from its IMDS. A worker of the workers' autoscaling group joins and
// becomes Ready; a node whose TPM is not the one EC2 reports for its instance, and an instance of an
// autoscaling group that no role is given to, are refused, each for that reason, and stay out.
func TestAWSLab(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	var l *Lab
	labTest(t, func(c Config) (err error) {
		c.AWS = &AWSConfig{IMDSMock: imdstest.Binary(t)}
		c.Nodes = []NodeSpec{{"cp-0", metadata.RoleControlPlane}}
		l, err = Up(ctx, c)
		if l != nil {
			t.Cleanup(l.Close)
		}
		return err
	})
	cp := l.Node("cp-0")

	// The three others start together: the refusals happen while the worker joins.
	other, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	badEK := l.machine(NodeSpec{"worker-ek", metadata.RoleWorker})
	badEK.ReportedEK = &other.PublicKey
	ek, err := l.AddNode(ctx, badEK)
	if err != nil {
		t.Fatal(err)
	}
	badGroup := l.machine(NodeSpec{"batch-0", metadata.RoleWorker})
	badGroup.Group = "berth-batch"
	batch, err := l.AddNode(ctx, badGroup)
	if err != nil {
		t.Fatal(err)
	}
	w, err := l.AddNode(ctx, l.machine(NodeSpec{"worker-0", metadata.RoleWorker}))
	if err != nil {
		t.Fatal(err)
	}
	ready, cancelReady := context.WithTimeout(ctx, 4*time.Minute)
	err = l.WaitReady(ready, []*Node{w})
	cancelReady()
	if err != nil {
		t.Fatal(err)
	}

	// The join service found its nodes in EC2, in the region and VPC its IMDS gave, with the groups of
	// its agent.yaml, and asked with its instance profile's credentials.
	cpLog := logFrom(t, cp, 0)
	if grepLines(cpLog, []string{`"msg":"nodes are looked up in EC2"`, `"region":"` + AWSRegion + `"`, `"vpc":"` + AWSVPC + `"`}) == "" {
		t.Errorf("cp-0's join service does not say it looks nodes up in EC2 in %s, %s; its log reads:\n%s", AWSRegion, AWSVPC, tail(cpLog, 40))
	}
	if grepLines(cpLog, []string{`"msg":"join ticket issued"`, `"peer_node":"worker-0"`}) == "" {
		t.Error("cp-0's join service did not issue worker-0's ticket")
	}
	if n := l.EC2.Calls(ec2test.DescribeInstances); n == 0 {
		t.Error("nobody called DescribeInstances")
	}
	var asked []string
	for _, r := range l.EC2.Requests(ec2test.GetInstanceTpmEkPub) {
		asked = append(asked, r.Get("InstanceId"))
	}
	for _, n := range []*Node{cp, w, ek} {
		if !slices.Contains(asked, n.InstanceID) {
			t.Errorf("EC2 was not asked for the EK of %s's instance %s (asked for %v)", n.Name, n.InstanceID, asked)
		}
	}
	if slices.Contains(asked, batch.InstanceID) {
		t.Errorf("EC2 was asked for the EK of %s, whose group has no role: it should have been refused before", batch.Name)
	}
	for _, key := range []string{operatorKeyID, instanceKeyID(cp.InstanceID)} {
		if !slices.Contains(l.EC2.AccessKeyIDs(), key) {
			t.Errorf("no EC2 call was signed with %s (callers: %v): the init signs with the operator's key, the join service with cp-0's instance profile from its IMDS", key, l.EC2.AccessKeyIDs())
		}
	}

	// Each bad node is refused, naming why, and again when it tries again.
	refusals := map[*Node][]string{
		ek: {`"msg":"attestation refused"`, `"peer_node":"worker-ek"`,
			"is not the one EC2 reports for instance " + ek.InstanceID},
		// Admission refuses it before its TLS handshake, and the EC2 lookup says why.
		batch: {`"msg":"EC2 instance refused"`, `"address":"` + batch.Addr.String() + `"`,
			fmt.Sprintf(`instance %s is in autoscaling group \"berth-batch\", which has no role here`, batch.InstanceID)},
	}
	checkStayOut(ctx, t, l, cp, refusals, []string{"cp-0", "worker-0"})
}

// checkStayOut checks that cp's join service refuses each node of refusals with log lines holding all of
// its texts, twice (the node tried again), that the nodes stay out of the cluster, whose nodes are members,
// and that none of them got a ticket.
func checkStayOut(ctx context.Context, t *testing.T, l *Lab, cp *Node, refusals map[*Node][]string, members []string) {
	t.Helper()
	for n, texts := range refusals {
		waitLogCount(ctx, t, cp, 2, texts...)
		t.Logf("%s refused: %s", n.Name, tail(grepLines(logFrom(t, cp, 0), texts), 1))
	}
	// They stay out: a good node is Ready here within seconds of its boot, and the bad ones keep trying for
	// a multiple of that.
	for n := range refusals {
		if d := time.Until(n.booted.Add(stayOut)); d > 0 {
			time.Sleep(d)
		}
	}
	nodes, err := l.Kubectl(ctx, "get", "nodes", "-o", "jsonpath={.items[*].metadata.name}")
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Fields(nodes); !slices.Equal(got, members) {
		t.Errorf("the cluster's nodes are %v, want %v only", got, members)
	}
	for n := range refusals {
		notInLog(t, n, 0, `"msg":"join ticket received"`)
		if grepLines(logFrom(t, cp, 0), []string{`"msg":"join ticket issued"`, `"peer_node":"` + n.Name + `"`}) != "" {
			t.Errorf("%s issued a join ticket to %s", cp.Name, n.Name)
		}
	}
	for name, d := range l.Timings {
		t.Logf("%s: %.1fs", name, d.Seconds())
	}
}

// stayOut is how long after its boot a refused node is checked not to have joined: several times what a
// node takes to join in the lab (10 to 20 s with several joining at once, under 10 s alone).
const stayOut = 30 * time.Second

// grepLines are the lines of log that hold every text.
func grepLines(log string, texts []string) string {
	var b strings.Builder
	for line := range strings.Lines(log) {
		if allIn(line, texts) {
			b.WriteString(line)
		}
	}
	return b.String()
}

// waitLogCount waits until count lines of the node's agent log hold every text.
func waitLogCount(ctx context.Context, t *testing.T, n *Node, count int, texts ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	for {
		if strings.Count(grepLines(logFrom(t, n, 0), texts), "\n") >= count {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%s: fewer than %d lines of its agent's log have all of %q; it reads:\n%s", n.Name, count, texts, tail(logFrom(t, n, 0), 40))
		case <-time.After(time.Second):
		}
	}
}
