package joinlab

import (
	"context"
	"crypto"
	"crypto/tls"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/nodeagent/internal/joinclient"
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

	refusedJoin(ctx, t, lab, cp, kubeadm, "a control-plane node joined through a join service for an external control plane",
		`this join service joins workers to an external control plane; the instance record says \"control-plane\"`)
}

// TestRenewKubeletCertificate: a node joined without kubeadm has no CSR signer in its cluster to rotate its
// kubelet's client certificate through; the join service renews it after the same checks as a rejoin and a
// join. The node's file then holds a new certificate for a new key, checked as the join's was; a CSR for
// another node's name, a TPM that does not own the disk and a kubeadm cluster's join service are refused.
func TestRenewKubeletCertificate(t *testing.T) {
	lab := New(t, WithoutKubeadm(&berthv1.KubeletSettings{ClusterDns: []string{"10.96.0.10"}, ClusterDomain: "cluster.local"}))
	worker := lab.AddNode("metal-1", metadata.RoleWorker)
	other := lab.AddNode("metal-2", metadata.RoleWorker)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	prepared, err := worker.Disk.Prepare(ctx)
	if err != nil {
		t.Fatal(err)
	}
	jc := lab.JoinClient(worker, &Kubeadm{}, &nodestate.Lock{})
	state, err := jc.Join(ctx, prepared)
	if err != nil {
		t.Fatal(lab.Logs.Logf("join: %v", err))
	}
	if !state.KubeletRenewal {
		t.Error("a node joined without kubeadm is not marked for kubelet certificate renewal")
	}
	before := readKubeletCert(t, worker)

	renewed, err := jc.RenewKubeletCertificate(ctx, prepared.UUID)
	if err != nil {
		t.Fatal(lab.Logs.Logf("renewal: %v", err))
	}
	after := readKubeletCert(t, worker)
	if after.SerialNumber.Cmp(renewed.SerialNumber) != 0 || after.SerialNumber.Cmp(before.SerialNumber) == 0 {
		t.Errorf("the kubelet's file holds serial %s; renewed %s, joined with %s", after.SerialNumber, renewed.SerialNumber, before.SerialNumber)
	}
	if after.PublicKey.(interface{ Equal(crypto.PublicKey) bool }).Equal(before.PublicKey) {
		t.Error("the renewed certificate is for the old key")
	}
	checkKubeletCert(t, lab, worker)
	if _, err := tls.LoadX509KeyPair(joinclient.KubeletCertPath(worker.Paths), joinclient.KubeletCertPath(worker.Paths)); err != nil {
		t.Errorf("the kubelet's file does not hold a matching certificate and key: %v", err)
	}

	for _, a := range []struct {
		name string
		attack
		want string
	}{
		{"CSR for another node", attack{node: worker, renew: true, disk: prepared.UUID, csr: honestCSR(t, other)}, "kubelet CSR refused"},
		{"TPM that does not own the disk", attack{node: other, renew: true, disk: prepared.UUID}, "renewal refused"},
		{"disk that never joined", attack{node: worker, renew: true}, "renewal refused"},
	} {
		msg, err := a.run(t, lab)
		if err == nil || !strings.Contains(err.Error(), a.want) {
			t.Errorf("%s: answer %v, %v; want a refusal with %q", a.name, msg, err, a.want)
		}
	}
}

// TestRenewalRefusedByKubeadmCluster: kubelets of a cluster kubeadm made rotate through the API server; its
// join service renews nothing.
func TestRenewalRefusedByKubeadmCluster(t *testing.T) {
	lab := New(t)
	worker := lab.AddNode("worker-1", metadata.RoleWorker)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	prepared, err := worker.Disk.Prepare(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lab.JoinClient(worker, &Kubeadm{}, &nodestate.Lock{}).Join(ctx, prepared); err != nil {
		t.Fatal(lab.Logs.Logf("join: %v", err))
	}
	_, err = (attack{node: worker, renew: true, disk: prepared.UUID}).run(t, lab)
	if err == nil || !strings.Contains(err.Error(), "rotate their certificates through the API server") {
		t.Errorf("renewal from a kubeadm cluster's join service: %v, want it refused", err)
	}
}
