package lab

import (
	"context"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/cloud/gcp/computeinstances/computetest"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/test/scenario"
)

// TestGCPLab runs the agents as on Compute Engine (GCPConfig): every node reads itself from its own GCE
// metadata server inside its network namespace, has a vTPM whose EK certificate (from a CA of Google's
// shape) names its instance, and is an instance of the lab's Compute endpoint in its role's managed
// instance group. The control-plane node is initialized as berth_cluster's gcp block does it (its TPM
// trusted by that certificate alone); its join service looks nodes up through the Compute API with the
// token of its metadata server's service account. Then it plays scenario.OutsidersStayOut: a worker of the
// workers' group joins and becomes Ready; a node whose vTPM is not the one Compute Engine reports for its
// instance, and an instance of a group that no role is given to, are refused, each for that reason, and
// stay out.
func TestGCPLab(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	var l *Lab
	labTest(t, func(c Config) (err error) {
		c.GCP = &GCPConfig{}
		c.Nodes = []NodeSpec{{"cp-0", metadata.RoleControlPlane}}
		l, err = Up(ctx, c)
		if l != nil {
			t.Cleanup(l.Close)
		}
		return err
	})
	cp := l.Node("cp-0")
	if n := l.Compute.Calls(computetest.GetShieldedInstanceIdentity); n != 0 {
		t.Errorf("the init asked the Compute API for %d identities: berth_cluster's gcp trust needs none", n)
	}

	c := &labCluster{l: l, cp: cp, platform: gcpPlatform{cloudOutsiders{noRoleGroup: "europe-west1/berth-batch"}}}
	scenario.OutsidersStayOut(ctx, t, c)

	// The join service found its nodes through the Compute API, in the project and network its metadata
	// server gave, with the groups of its agent.yaml, as the service account its metadata server vouches
	// for (the endpoint refuses any other token).
	cpLog := logFrom(t, cp, 0)
	if grepLines(cpLog, []string{`"msg":"nodes are looked up in Compute Engine"`, `"project":"` + GCPProject + `"`, `"network":"` + GCPNetwork + `"`}) == "" {
		t.Errorf("cp-0's join service does not say it looks nodes up in Compute Engine in %s, %s; its log reads:\n%s", GCPProject, GCPNetwork, tail(cpLog, 40))
	}
	for _, method := range []string{computetest.AggregatedList, computetest.RegionListManagedInstances, computetest.GetShieldedInstanceIdentity} {
		if l.Compute.Calls(method) == 0 {
			t.Errorf("nobody called %s", method)
		}
	}

	for name, d := range l.Timings {
		t.Logf("%s: %.1fs", name, d.Seconds())
	}
}

// gcpPlatform is Compute Engine to the scenarios: the join service refuses a foreign vTPM at attestation,
// naming the instance Compute Engine reports another key for, and an instance of a group with no role at
// admission, before its TLS handshake.
type gcpPlatform struct{ cloudOutsiders }

func (gcpPlatform) refusal(n *Node, kind scenario.Kind) []string {
	if kind == scenario.ForeignTPM {
		return []string{`"msg":"attestation refused"`, `"peer_node":"` + n.Name + `"`,
			"is not the one Compute Engine reports for instance " + n.InstanceID}
	}
	return []string{`"msg":"Compute Engine instance refused"`, `"address":"` + n.Addr.String() + `"`,
		"instance " + n.Name + " (" + GCPZone + ") is in none of the managed instance groups that have a role here"}
}
