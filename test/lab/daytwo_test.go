package lab

import (
	"context"
	"crypto/rand"
	"math/big"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/metadata"
)

// TestLoneControlPlaneReboot brings up one control-plane node and two workers, reboots the control-plane
// node alone and then cuts every node's power at once and switches them on in a random order. The only
// control-plane node has no join service to ask for a rejoin ticket either time: it unlocks its disk from
// its TPM, where its key is sealed to the join policy, and the workers get their rejoin tickets from it once
// it serves again. Nothing joins anew, and a pod's file on a worker's disk outlives it all.
func TestLoneControlPlaneReboot(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	var l *Lab
	labTest(t, func(c Config) (err error) {
		c.Nodes = DefaultNodes
		l, err = Up(ctx, c)
		return err
	})
	before := snapshot(ctx, t, l)
	cp := l.Node("cp-0")
	mark := logMark(t, cp)
	since := time.Now()
	if err := cp.Reboot(ctx); err != nil {
		t.Fatal(err)
	}
	if err := l.WaitRestarted(ctx, cp, since); err != nil {
		t.Fatal(err)
	}
	wantInLog(t, cp, mark, `"msg":"state disk unlocked from the TPM"`)
	coldStart(ctx, t, l, before)
}

// TestClusterColdStart brings up three control-plane nodes and a worker. First the node that ran kubeadm
// init reboots with its local unlock turned off: it must get its rejoin ticket from the other two, which it
// can only if the init recorded its disk's owner as every join does; rebooted with local unlock on again, it
// seals its key to the policy that ticket carried. Then every node loses power at once and comes back in a
// random order, the control-plane nodes each from their own TPM.
func TestClusterColdStart(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Minute)
	defer cancel()
	var l *Lab
	labTest(t, func(c Config) (err error) {
		c.Nodes = []NodeSpec{{"cp-0", metadata.RoleControlPlane}, {"cp-1", metadata.RoleControlPlane},
			{"cp-2", metadata.RoleControlPlane}, {"worker-0", metadata.RoleWorker}}
		l, err = Up(ctx, c)
		return err
	})
	before := snapshot(ctx, t, l)
	cp := l.Node("cp-0")
	reboot := func(localUnlock bool) int64 {
		t.Helper()
		if err := cp.SetAgentOption("localUnlock", localUnlock); err != nil {
			t.Fatal(err)
		}
		mark := logMark(t, cp)
		since := time.Now()
		if err := cp.Reboot(ctx); err != nil {
			t.Fatal(err)
		}
		if err := l.WaitRestarted(ctx, cp, since); err != nil {
			t.Fatal(err)
		}
		return mark
	}
	mark := reboot(false)
	wantInLog(t, cp, mark, `"msg":"rejoin ticket received"`)
	notInLog(t, cp, mark, `"msg":"state disk unlocked from the TPM"`)
	if keys, err := cp.Disk().Tokens(ctx, "berth-sealed-key"); err != nil || len(keys) != 0 {
		t.Errorf("cp-0 with local unlock off keeps %d sealed keys (%v), want none", len(keys), err)
	}
	mark = reboot(true)
	wantInLog(t, cp, mark, `"msg":"rejoin ticket received"`)
	wantInLog(t, cp, mark, `"msg":"disk key sealed to the join policy"`)
	coldStart(ctx, t, l, before)
}

// clusterSnapshot is what a power cycle must not change.
type clusterSnapshot struct {
	// nodeUIDs are the Node objects' UIDs: a node that joined anew would be a new object.
	nodeUIDs string
	// serials are the kubelets' client certificate serials.
	serials map[string]string
	// file is a file a pod wrote on a worker's disk, and its content.
	file, content string
}

func snapshot(ctx context.Context, t *testing.T, l *Lab) clusterSnapshot {
	t.Helper()
	s := clusterSnapshot{serials: map[string]string{}}
	var err error
	if s.nodeUIDs, err = l.Kubectl(ctx, "get", "nodes", "-o", "jsonpath={range .items[*]}{.metadata.name}={.metadata.uid} {end}"); err != nil {
		t.Fatal(err)
	}
	for _, n := range l.Nodes {
		s.serials[n.Name] = kubeletSerial(t, n)
	}
	s.content = "written before the power cut " + rand.Text()
	if s.file, err = l.RunWriterPod(ctx, "writer", l.Node("worker-0"), s.content); err != nil {
		t.Fatal(err)
	}
	return s
}

// coldStart cuts every node's power, switches them on in a random order and checks that the cluster came
// back by itself: every node Ready, the control-plane nodes unlocked from their TPMs and the workers by
// rejoin tickets, no new join (the same Node objects and kubelet certificates, kubeadm run once per node
// over all its boots), each disk opening with its derived key alone, and the pod's file intact.
func coldStart(ctx context.Context, t *testing.T, l *Lab, before clusterSnapshot) {
	t.Helper()
	order := slices.Clone(l.Nodes)
	for i := len(order) - 1; i > 0; i-- {
		j, err := rand.Int(rand.Reader, big.NewInt(int64(i+1)))
		if err != nil {
			t.Fatal(err)
		}
		order[i], order[j.Int64()] = order[j.Int64()], order[i]
	}
	marks := map[string]int64{}
	for _, n := range l.Nodes {
		marks[n.Name] = logMark(t, n)
	}
	since := time.Now()
	if err := l.PowerCycle(ctx, order); err != nil {
		t.Fatal(err)
	}
	for _, n := range order {
		if err := l.WaitRestarted(ctx, n, since); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("every node Ready %.1fs after the power came back (order %s)", time.Since(since).Seconds(), nodeNames(order))

	after, err := l.Kubectl(ctx, "get", "nodes", "-o", "jsonpath={range .items[*]}{.metadata.name}={.metadata.uid} {end}")
	if err != nil {
		t.Fatal(err)
	}
	if after != before.nodeUIDs {
		t.Errorf("Node objects changed over the power cycle:\nbefore %s\nafter  %s", before.nodeUIDs, after)
	}
	for _, n := range l.Nodes {
		if n.Role == metadata.RoleControlPlane {
			wantInLog(t, n, marks[n.Name], `"msg":"state disk unlocked from the TPM"`)
		} else {
			wantInLog(t, n, marks[n.Name], `"msg":"rejoin ticket received"`)
		}
		log, err := os.ReadFile(n.path("logs/agent.log"))
		if err != nil {
			t.Fatal(err)
		}
		if runs := strings.Count(string(log), `"msg":"running kubeadm"`); runs != 1 {
			t.Errorf("%s: kubeadm ran %d times over all its boots, want once", n.Name, runs)
		}
		if serial := kubeletSerial(t, n); serial != before.serials[n.Name] {
			t.Errorf("%s: kubelet certificate serial %s, was %s before the power cycle", n.Name, serial, before.serials[n.Name])
		}
		checkDerivedKeyAlone(ctx, t, l, n)
	}
	if got, err := os.ReadFile(before.file); err != nil || string(got) != before.content {
		t.Errorf("the pod's file %s after the power cycle: %q, %v; want %q", before.file, got, err, before.content)
	}
}

// kubeletSerial is the serial of the kubelet's client certificate.
func kubeletSerial(t *testing.T, n *Node) string {
	t.Helper()
	cert, err := n.KubeletClientCert()
	if err != nil {
		t.Fatalf("%s: kubelet client certificate: %v", n.Name, err)
	}
	return cert.SerialNumber.Text(16)
}

// checkDerivedKeyAlone fails unless the node's state disk has one keyslot, opened by its derived key.
func checkDerivedKeyAlone(ctx context.Context, t *testing.T, l *Lab, n *Node) {
	t.Helper()
	key, err := l.DiskKey(ctx, n)
	if err != nil {
		t.Fatal(err)
	}
	disk := n.Disk()
	slot, err := disk.KeySlot(ctx, key)
	if err != nil {
		t.Errorf("%s: the derived key does not open the state disk: %v", n.Name, err)
		return
	}
	if slots, err := disk.Slots(ctx); err != nil || !slices.Equal(slots, []int{slot}) {
		t.Errorf("%s: keyslots %v (%v), want only the derived key's %d", n.Name, slots, err, slot)
	}
}

// logMark is the length of the node's agent log now: what a later boot writes comes after it.
func logMark(t *testing.T, n *Node) int64 {
	t.Helper()
	fi, err := os.Stat(n.path("logs/agent.log"))
	if err != nil {
		t.Fatal(err)
	}
	return fi.Size()
}

func logFrom(t *testing.T, n *Node, mark int64) string {
	t.Helper()
	data, err := os.ReadFile(n.path("logs/agent.log"))
	if err != nil {
		t.Fatal(err)
	}
	return string(data[min(mark, int64(len(data))):])
}

func wantInLog(t *testing.T, n *Node, mark int64, text string) {
	t.Helper()
	if log := logFrom(t, n, mark); !strings.Contains(log, text) {
		t.Errorf("%s: its agent's log of this boot lacks %s; it reads:\n%s", n.Name, text, tail(log, 40))
	}
}

func notInLog(t *testing.T, n *Node, mark int64, text string) {
	t.Helper()
	if log := logFrom(t, n, mark); strings.Contains(log, text) {
		t.Errorf("%s: its agent's log of this boot has %s", n.Name, text)
	}
}
