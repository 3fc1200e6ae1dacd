package lab

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/cloud/aws/ec2instances/ec2test"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/test/imdstest"
	"github.com/berthlabs/berth/test/scenario"
)

// TestAWSLab runs the agents as on EC2 (AWSConfig): every node reads itself from its own IMDS (AWS's
// ec2-metadata-mock inside its network namespace), has a TPM without EK certificate, and is an instance of
// the lab's EC2 endpoint. The control-plane node is initialized as berth_cluster's aws block does it (its
// TPM trusted by the EK EC2 reports for its instance); its join service looks nodes up through EC2 with
// the instance profile's credentials from its IMDS. Then it plays scenario.OutsidersStayOut: a worker of the
// workers' autoscaling group joins and becomes Ready; a node whose TPM is not the one EC2 reports for its
// instance, and an instance of an autoscaling group that no role is given to, are refused, each for that
// reason, and stay out.
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
	c := &labCluster{l: l, cp: cp, platform: awsPlatform{cloudOutsiders{noRoleGroup: "berth-batch"}}}
	w, ek, batch := scenario.OutsidersStayOut(ctx, t, c)

	// The join service found its nodes in EC2, in the region and VPC its IMDS gave, with the groups of
	// its agent.yaml, and asked with its instance profile's credentials.
	cpLog := logFrom(t, cp, 0)
	if grepLines(cpLog, []string{`"msg":"nodes are looked up in EC2"`, `"region":"` + AWSRegion + `"`, `"vpc":"` + AWSVPC + `"`}) == "" {
		t.Errorf("cp-0's join service does not say it looks nodes up in EC2 in %s, %s; its log reads:\n%s", AWSRegion, AWSVPC, tail(cpLog, 40))
	}
	if n := l.EC2.Calls(ec2test.DescribeInstances); n == 0 {
		t.Error("nobody called DescribeInstances")
	}
	var asked []string
	for _, r := range l.EC2.Requests(ec2test.GetInstanceTpmEkPub) {
		asked = append(asked, r.Get("InstanceId"))
	}
	for _, n := range []*Node{cp, w.(labNode).n, ek.(labNode).n} {
		if !slices.Contains(asked, n.InstanceID) {
			t.Errorf("EC2 was not asked for the EK of %s's instance %s (asked for %v)", n.Name, n.InstanceID, asked)
		}
	}
	if id := batch.(labNode).n.InstanceID; slices.Contains(asked, id) {
		t.Errorf("EC2 was asked for the EK of %s, whose group has no role: it should have been refused before", batch.Name())
	}
	for _, key := range []string{operatorKeyID, instanceKeyID(cp.InstanceID)} {
		if !slices.Contains(l.EC2.AccessKeyIDs(), key) {
			t.Errorf("no EC2 call was signed with %s (callers: %v): the init signs with the operator's key, the join service with cp-0's instance profile from its IMDS", key, l.EC2.AccessKeyIDs())
		}
	}
	for name, d := range l.Timings {
		t.Logf("%s: %.1fs", name, d.Seconds())
	}
}

// awsPlatform is EC2 to the scenarios: the join service refuses a foreign TPM at attestation, naming the
// instance EC2 reports another key for, and an instance of a group with no role at admission, before its
// TLS handshake, naming the group.
type awsPlatform struct{ cloudOutsiders }

func (p awsPlatform) refusal(n *Node, kind scenario.Kind) []string {
	if kind == scenario.ForeignTPM {
		return []string{`"msg":"attestation refused"`, `"peer_node":"` + n.Name + `"`,
			"is not the one EC2 reports for instance " + n.InstanceID}
	}
	return []string{`"msg":"EC2 instance refused"`, `"address":"` + n.Addr.String() + `"`,
		fmt.Sprintf(`instance %s is in autoscaling group \"%s\", which has no role here`, n.InstanceID, p.noRoleGroup)}
}

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
