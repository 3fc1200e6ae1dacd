package lab

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/berthlabs/berth/internal/cloud/aws/ec2instances/ec2test"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/repotest"
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
//
// The lab runs the AWS cloud controller manager (built from its module) on cp-0, and every kubelet runs with
// --cloud-provider=external and its provider ID: the controller initializes each Node from EC2, puts the
// shutdown taint on a stopped worker's Node and keeps it, and deletes it once the instance is terminated.
func TestAWSLab(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	var l *Lab
	labTest(t, func(c Config) (err error) {
		c.AWS = &AWSConfig{IMDSMock: imdstest.Binary(t), CloudControllerManager: awsCCMBinary(t)}
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
	checkCloudControllerManager(ctx, t, l, cp, w.(labNode).n)
	for name, d := range l.Timings {
		t.Logf("%s: %.1fs", name, d.Seconds())
	}
}

// awsCCMBinary is the AWS cloud controller manager, as make or scripts/build-aws-ccm.sh built it.
func awsCCMBinary(t *testing.T) string {
	t.Helper()
	dir := repotest.BinDir(t, "BERTH_AWS_CCM_BIN", "build-aws-ccm.sh", "it needs go and the Go module proxy or cache")
	return filepath.Join(dir, "aws-cloud-controller-manager")
}

// The cloud controller manager's taints.
const (
	uninitializedTaint = "node.cloudprovider.kubernetes.io/uninitialized"
	shutdownTaint      = "node.cloudprovider.kubernetes.io/shutdown"
)

// checkCloudControllerManager: the Nodes of cp and w were initialized by the AWS cloud controller manager
// from their instances; once w's instance is stopped its Node is tainted and stays, and once it is
// terminated the controller deletes it.
func checkCloudControllerManager(ctx context.Context, t *testing.T, l *Lab, cp, w *Node) {
	t.Helper()
	ccmDiag := func() string { return "the cloud controller manager's log ends:\n" + tail(ccmLogOf(t, cp), 40) }
	for _, n := range []*Node{cp, w} {
		node := waitNode(ctx, t, l, n.Name, time.Minute, "initialized by the cloud controller manager", func(node *corev1.Node) bool {
			return !hasTaint(node, uninitializedTaint)
		}, ccmDiag)
		want := map[string]string{
			"spec.providerID":                  "aws:///" + AWSZone + "/" + n.InstanceID,
			"topology.kubernetes.io/zone":      AWSZone,
			"topology.kubernetes.io/region":    AWSRegion,
			"node.kubernetes.io/instance-type": "m7i.large",
			"topology.k8s.aws/zone-id":         ec2test.Zones[0].ID,
		}
		got := map[string]string{"spec.providerID": node.Spec.ProviderID}
		for k := range want {
			if v, ok := node.Labels[k]; ok {
				got[k] = v
			}
		}
		if !maps.Equal(got, want) {
			t.Errorf("Node %s: %v, want %v", n.Name, got, want)
		}
		if !slices.ContainsFunc(node.Status.Addresses, func(a corev1.NodeAddress) bool {
			return a.Type == corev1.NodeInternalIP && a.Address == n.Addr.String()
		}) {
			t.Errorf("Node %s: addresses %v, want the InternalIP %s from EC2", n.Name, node.Status.Addresses, n.Addr)
		}
	}

	start := time.Now()
	w.PowerOff()
	waitNode(ctx, t, l, w.Name, 3*time.Minute, "tainted "+shutdownTaint+" once its instance is stopped", func(node *corev1.Node) bool {
		return hasTaint(node, shutdownTaint)
	}, ccmDiag)
	t.Logf("%s: stopped, its Node tainted %s after %v", w.Name, shutdownTaint, time.Since(start).Round(time.Second))

	start = time.Now()
	if err := l.RemoveNode(ctx, w.Name); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(2 * time.Second) {
		out, err := l.Kubectl(ctx, "get", "node", w.Name, "--ignore-not-found", "-o", "name")
		if err != nil {
			t.Fatalf("kubectl get node %s: %v", w.Name, err)
		}
		if strings.TrimSpace(out) == "" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the Node of %s, whose instance was terminated %v ago, is still there; the controller manager's log:\n%s",
				w.Name, time.Since(start).Round(time.Second), ccmDiag())
		}
	}
	t.Logf("%s: terminated, its Node deleted after %v", w.Name, time.Since(start).Round(time.Second))
	if !strings.Contains(ccmLogOf(t, cp), "deleting node since it is no longer present in cloud provider: "+w.Name) {
		t.Errorf("the cloud controller manager did not log that it deleted %s's Node", w.Name)
	}
}

func ccmLogOf(t *testing.T, n *Node) string {
	t.Helper()
	data, err := os.ReadFile(n.path("logs/" + ccmLog + ".log"))
	if err != nil {
		t.Fatal(err)
	}
	return string(data)
}

// waitNode waits until the Node name satisfies ok, and returns it.
func waitNode(ctx context.Context, t *testing.T, l *Lab, name string, timeout time.Duration, what string, ok func(*corev1.Node) bool, diag func() string) *corev1.Node {
	t.Helper()
	for deadline := time.Now().Add(timeout); ; time.Sleep(2 * time.Second) {
		out, err := l.Kubectl(ctx, "get", "node", name, "-o", "json")
		if err != nil {
			t.Fatalf("kubectl get node %s: %v", name, err)
		}
		// A fresh Node each time: decoding into the last one would keep taints that are gone (an absent list).
		var node corev1.Node
		if err := json.Unmarshal([]byte(out), &node); err != nil {
			t.Fatalf("Node %s: %v", name, err)
		}
		if ok(&node) {
			return &node
		}
		if time.Now().After(deadline) {
			t.Fatalf("Node %s is not %s after %v: taints %v, labels %v\n%s", name, what, timeout, node.Spec.Taints, node.Labels, diag())
		}
	}
}

func hasTaint(node *corev1.Node, key string) bool {
	return slices.ContainsFunc(node.Spec.Taints, func(t corev1.Taint) bool { return t.Key == key })
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
