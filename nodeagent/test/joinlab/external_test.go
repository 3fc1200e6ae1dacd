package joinlab

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
)

// TestJoinWithoutKubeadm: a join service for an external control plane hands a worker a ticket with no
// bootstrap token; the node writes the kubelet's kubeconfig, CA, configuration and flags itself and never
// runs kubeadm. A node whose instance record says control-plane gets no ticket from such a service.
func TestJoinWithoutKubeadm(t *testing.T) {
	lab := New(t, WithoutKubeadm(&berthv1.KubeletSettings{ClusterDns: []string{"10.96.0.10"}, ClusterDomain: "cluster.local"}))
	worker := lab.AddNode("metal-1", metadata.RoleWorker)
	cp := lab.AddNode("cp-9", metadata.RoleControlPlane)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	prepared, err := worker.Disk.Prepare(ctx)
	if err != nil {
		t.Fatal(err)
	}
	kubeadm := &Kubeadm{}
	state, err := lab.JoinClient(worker, kubeadm, &nodestate.Lock{}).Join(ctx, prepared)
	if err != nil {
		t.Fatal(lab.Logs.Logf("join: %v", err))
	}
	if state.NodeName != "metal-1" || state.Via != nodestate.OwnerJoin {
		t.Errorf("node state %+v", state)
	}
	if len(kubeadm.Joins) != 0 || kubeadm.Resets != 0 {
		t.Errorf("kubeadm ran: %d joins, %d resets", len(kubeadm.Joins), kubeadm.Resets)
	}
	checkTokens(t, lab, 0)
	if !opensWith(t, worker.Volume.Path(), lab.DiskKey(prepared.UUID)) {
		t.Error("the state disk does not open with its derived key")
	}
	checkKubeletCert(t, lab, worker)
	for _, f := range []string{filepath.Join(worker.Paths.KubernetesDir, "kubelet.conf"), filepath.Join(worker.Paths.PKIDir(), "ca.crt")} {
		if _, err := os.Stat(f); err != nil {
			t.Errorf("%s: %v", f, err)
		}
	}
	config, err := os.ReadFile(filepath.Join(worker.Paths.KubeletDir, "config.yaml"))
	if err != nil || !strings.Contains(string(config), "clusterDomain: cluster.local") {
		t.Errorf("kubelet config.yaml (%v) lacks the ticket's cluster domain:\n%s", err, config)
	}
	if logs := lab.Logs.String(); !strings.Contains(logs, "method=JOIN_METHOD_KUBELET") || strings.Contains(logs, "token_expires") {
		t.Error(lab.Logs.Logf("the ticket was not logged as a kubelet-method ticket without a token"))
	}

	cpPrepared, err := cp.Disk.Prepare(ctx)
	if err != nil {
		t.Fatal(err)
	}
	cpCtx, cpCancel := context.WithTimeout(ctx, 3*time.Second)
	defer cpCancel()
	if _, err := lab.JoinClient(cp, kubeadm, &nodestate.Lock{}).Join(cpCtx, cpPrepared); err == nil {
		t.Fatal("a control-plane node joined through a join service for an external control plane")
	}
	if !strings.Contains(lab.Logs.String(), `this join service joins workers to an external control plane; the instance record says \"control-plane\"`) {
		t.Error(lab.Logs.Logf("the refusal does not say why"))
	}
	if !opensWith(t, cp.Volume.Path(), cpPrepared.InitialKey) {
		t.Error("the refused node's disk lost its initial key")
	}
}
