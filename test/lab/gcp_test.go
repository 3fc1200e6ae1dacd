package lab

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/cloud/gcp/computeinstances/computetest"
	"github.com/berthlabs/berth/internal/metadata"
)

// TestGCPLab runs the agents as on Compute Engine (GCPConfig): every node reads itself from its own GCE
// metadata server inside its network namespace, has a vTPM whose EK certificate (from a CA of Google's
// shape) names its instance, and is an instance of the lab's Compute endpoint in its role's managed
// instance group. The control-plane node is initialized as berth_cluster's gcp block does it (its TPM
// trusted by that certificate alone); its join service looks nodes up through the Compute API with the
// token of its metadata server's service account. A worker of the workers' group joins and becomes Ready; a
// node whose vTPM is not the one Compute Engine reports for its instance, and an instance of a group that no
// role is given to, are refused, each for that reason, and stay out.
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
	badGroup.Group = "europe-west1/berth-batch"
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

	// The join service found its nodes through the Compute API, in the project and network its metadata
	// server gave, with the groups of its agent.yaml, as the service account its metadata server vouches
	// for (the endpoint refuses any other token).
	cpLog := logFrom(t, cp, 0)
	if grepLines(cpLog, []string{`"msg":"nodes are looked up in Compute Engine"`, `"project":"` + GCPProject + `"`, `"network":"` + GCPNetwork + `"`}) == "" {
		t.Errorf("cp-0's join service does not say it looks nodes up in Compute Engine in %s, %s; its log reads:\n%s", GCPProject, GCPNetwork, tail(cpLog, 40))
	}
	if grepLines(cpLog, []string{`"msg":"join ticket issued"`, `"peer_node":"worker-0"`}) == "" {
		t.Error("cp-0's join service did not issue worker-0's ticket")
	}
	for _, method := range []string{computetest.AggregatedList, computetest.RegionListManagedInstances, computetest.GetShieldedInstanceIdentity} {
		if l.Compute.Calls(method) == 0 {
			t.Errorf("nobody called %s", method)
		}
	}

	// Each bad node is refused, naming why, and again when it tries again.
	refusals := map[*Node][]string{
		ek: {`"msg":"attestation refused"`, `"peer_node":"worker-ek"`,
			"is not the one Compute Engine reports for instance " + ek.InstanceID},
		// Admission refuses it before its TLS handshake, and the Compute lookup says why.
		batch: {`"msg":"Compute Engine instance refused"`, `"address":"` + batch.Addr.String() + `"`,
			"instance batch-0 (" + GCPZone + ") is in none of the managed instance groups that have a role here"},
	}
	checkStayOut(ctx, t, l, cp, refusals, []string{"cp-0", "worker-0"})
}
