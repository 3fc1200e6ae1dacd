package joinlab

import (
	"context"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/berthlabs/berth/internal/clusterinfo"
	"github.com/berthlabs/berth/internal/diskrecord"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
	"github.com/berthlabs/berth/test/clustertest"
)

// TestJoinWaitsForControlPlaneVersion: the join service learns a node's Kubernetes release from the policy
// image its quote matched. A worker of a release newer than one of the API servers is held back, and keeps
// its disk unclaimed, until that API server runs the release too; then the same join goes through. A
// control-plane node of a release older than the control plane's is refused, saying why.
func TestJoinWaitsForControlPlaneVersion(t *testing.T) {
	lab := New(t)
	pcrs := clustertest.ZeroPolicy("x", metadata.RoleWorker).Images[0].PCRs
	lab.Policy.Set(&policy.Policy{Images: []policy.Image{
		{Name: "old-control-plane", Roles: []metadata.Role{metadata.RoleControlPlane}, PCRs: pcrs, KubernetesVersion: "v1.35.4"},
		{Name: "new", Roles: []metadata.Role{metadata.RoleWorker}, PCRs: pcrs, KubernetesVersion: "v1.36.3"},
	}})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pods := lab.Kube.CoreV1().Pods(metav1.NamespaceSystem)
	apiServer := func(node, release string) *corev1.Pod {
		return &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: "kube-apiserver-" + node, Namespace: metav1.NamespaceSystem,
				Labels: map[string]string{"component": "kube-apiserver", "tier": "control-plane"}},
			Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "kube-apiserver", Image: "registry.k8s.io/kube-apiserver:" + release}}},
		}
	}
	// Halfway through an upgrade: one API server at the new release, one still at the old.
	for _, p := range []*corev1.Pod{apiServer("cp-0", "v1.35.4"), apiServer("cp-1", "v1.36.3")} {
		if _, err := pods.Create(ctx, p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	worker := lab.AddNode("worker-1", metadata.RoleWorker)
	prepared, err := worker.Disk.Prepare(ctx)
	if err != nil {
		t.Fatal(err)
	}
	kubeadm := &Kubeadm{}
	type result struct {
		state *nodestate.State
		err   error
	}
	joined := make(chan result, 1)
	go func() {
		st, err := lab.JoinClient(worker, kubeadm, &nodestate.Lock{}).Join(ctx, prepared)
		joined <- result{st, err}
	}()
	const why = `image \"new\" carries Kubernetes v1.36.3 and the control plane runs v1.35.4: waiting for the control plane to reach v1.36`
	waitFor(t, ctx, "the service to hold the worker back", func() bool { return strings.Count(lab.Logs.String(), why) >= 3 })
	select {
	case r := <-joined:
		t.Fatalf("the worker joined while an API server ran v1.35.4: %+v, %v", r.state, r.err)
	default:
	}
	if logs := lab.Logs.String(); !strings.Contains(logs, "held back") || !strings.Contains(logs, "agent=worker-1") {
		t.Error(lab.Logs.Logf("neither the service nor the agent logs the wait"))
	}
	// The service asks for a second between tries (the lab's HeldBackRetry), more than the lab's clients'
	// own backoff allows: each retry after a hold-back waits from 1 s to 1.5 s.
	waits := retryWaits(lab.Logs.String(), "worker-1")
	if len(waits) < 2 {
		t.Error(lab.Logs.Logf("the worker's join client logged %d retries, want one after each hold-back", len(waits)))
	}
	for _, wait := range waits {
		if wait < time.Second || wait >= 1500*time.Millisecond {
			t.Error(lab.Logs.Logf("a retry after a hold-back waited %v, not the 1 s to 1.5 s the service asked for", wait))
		}
	}
	cms, err := lab.Kube.CoreV1().ConfigMaps(metav1.NamespaceSystem).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, cm := range cms.Items {
		if strings.HasPrefix(cm.Name, diskrecord.Prefix) {
			t.Errorf("a held-back node's disk was claimed: %s", cm.Name)
		}
	}
	if len(kubeadm.Joins) != 0 {
		t.Errorf("kubeadm join ran %d times for a held-back node", len(kubeadm.Joins))
	}

	if _, err := pods.Update(ctx, apiServer("cp-0", "v1.36.3"), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	r := <-joined
	if r.err != nil {
		t.Fatal(lab.Logs.Logf("the join once the control plane ran v1.36.3: %v", r.err))
	}
	if r.state.NodeName != "worker-1" || len(kubeadm.Joins) != 1 {
		t.Errorf("after the wait: node state %+v, %d kubeadm joins", r.state, len(kubeadm.Joins))
	}
	if !opensWith(t, worker.Volume.Path(), lab.DiskKey(prepared.UUID)) {
		t.Error("the state disk does not open with its derived key")
	}

	refusedJoin(ctx, t, lab, lab.AddNode("cp-2", metadata.RoleControlPlane), kubeadm,
		"a control-plane node of v1.35.4 joined a control plane at v1.36.3",
		`control-plane image \"old-control-plane\" carries Kubernetes v1.35.4 and the control plane runs v1.36.3`)

	// A control-plane image of the next minor waits like a worker until the provider instructs the upgrade
	// to its release; then it joins ahead of the API servers, to lead the upgrade.
	lab.Policy.Set(&policy.Policy{Images: []policy.Image{
		{Name: "next-control-plane", Roles: []metadata.Role{metadata.RoleControlPlane}, PCRs: pcrs, KubernetesVersion: "v1.37.0"},
	}})
	leader := lab.AddNode("cp-3", metadata.RoleControlPlane)
	refusedJoin(ctx, t, lab, leader, kubeadm, "a control-plane node of v1.37.0 joined with no upgrade instructed",
		`image \"next-control-plane\" carries Kubernetes v1.37.0 and the control plane runs v1.36.3: waiting for the control plane to reach v1.37`)
	if err := clusterinfo.Publish(ctx, lab.Kube, clusterinfo.Info{ID: strings.Repeat("5e", 16), Name: "joinlab"}); err != nil {
		t.Fatal(err)
	}
	if _, err := clusterinfo.InstructUpgrade(ctx, lab.Kube, "v1.37.0", time.Now()); err != nil {
		t.Fatal(err)
	}
	prepared, err = leader.Disk.Prepare(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st, err := lab.JoinClient(leader, kubeadm, &nodestate.Lock{}).Join(ctx, prepared); err != nil || st.NodeName != "cp-3" {
		t.Fatal(lab.Logs.Logf("the join of the upgrade's control-plane node: %+v, %v", st, err))
	}
	if !strings.Contains(lab.Logs.String(), "control-plane node of the instructed upgrade's release admitted ahead of the API servers") {
		t.Error(lab.Logs.Logf("the service does not log why it admitted a node ahead of the API servers"))
	}
}

// retryWaits are the waits agent's join client logged before each retry of a join ticket.
func retryWaits(logs, agent string) []time.Duration {
	var waits []time.Duration
	for line := range strings.Lines(logs) {
		if !strings.Contains(line, `msg="retrying join ticket"`) || !strings.Contains(line, "agent="+agent+" ") {
			continue
		}
		_, rest, _ := strings.Cut(line, "retry_in=")
		if fields := strings.Fields(rest); len(fields) > 0 {
			if d, err := time.ParseDuration(fields[0]); err == nil {
				waits = append(waits, d)
			}
		}
	}
	return waits
}

// waitFor polls cond until it holds, failing the test when ctx ends first.
func waitFor(t *testing.T, ctx context.Context, what string, cond func() bool) {
	t.Helper()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("waiting for %s: %v", what, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}
