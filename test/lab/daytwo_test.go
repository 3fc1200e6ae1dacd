package lab

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/x509"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/policy"
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
	mark := reboot(ctx, t, l, cp)
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
		c.Nodes = []NodeSpec{{"cp-0", metadata.RoleControlPlane}, {"worker-0", metadata.RoleWorker}}
		if l, err = Up(ctx, c); err != nil {
			return err
		}
		return l.Grow(ctx, NodeSpec{"cp-1", metadata.RoleControlPlane}, NodeSpec{"cp-2", metadata.RoleControlPlane})
	})
	before := snapshot(ctx, t, l)
	cp := l.Node("cp-0")
	rebootWith := func(localUnlock bool) int64 {
		t.Helper()
		if err := cp.SetAgentOption("localUnlock", localUnlock); err != nil {
			t.Fatal(err)
		}
		return reboot(ctx, t, l, cp)
	}
	mark := rebootWith(false)
	wantInLog(t, cp, mark, `"msg":"rejoin ticket received"`)
	notInLog(t, cp, mark, `"msg":"state disk unlocked from the TPM"`)
	if keys, err := cp.Disk().Tokens(ctx, "berth-sealed-key"); err != nil || len(keys) != 0 {
		t.Errorf("cp-0 with local unlock off keeps %d sealed keys (%v), want none", len(keys), err)
	}
	mark = rebootWith(true)
	wantInLog(t, cp, mark, `"msg":"rejoin ticket received"`)
	wantInLog(t, cp, mark, `"msg":"disk key sealed to the join policy"`)
	coldStart(ctx, t, l, before)
}

// reboot reboots n, waits until it is Ready again, and returns where its agent's log of the new boot begins.
func reboot(ctx context.Context, t *testing.T, l *Lab, n *Node) int64 {
	t.Helper()
	mark := logMark(t, n)
	since := time.Now()
	if err := n.Reboot(ctx); err != nil {
		t.Fatal(err)
	}
	if err := l.WaitRestarted(ctx, n, since); err != nil {
		t.Fatal(err)
	}
	return mark
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

// TestImageRoll rolls the cluster from image A to image B the way an operator does: the policy gains B, a
// control-plane node and a worker reboot into B and come back (the control-plane node from its TPM, since it
// resealed to the new policy while it ran), then the policy drops A. A worker that boots A again can neither
// unseal its key (the refusal names PCR 11, expected and got) nor get a rejoin ticket (the join service's
// refusal names the same PCR). It runs at the release of the Kubernetes binaries it is given, which its nodes
// and API server report.
func TestImageRoll(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	var l *Lab
	labTest(t, func(c Config) (err error) {
		c.Nodes = []NodeSpec{{"cp-0", metadata.RoleControlPlane}, {"worker-0", metadata.RoleWorker}}
		l, err = Up(ctx, c)
		return err
	})
	checkRelease(ctx, t, l)
	cp, w := l.Node("cp-0"), l.Node("worker-0")
	// The worker seals too (an edge node), and asks for the policy often enough for a test.
	if err := w.SetAgentOption("localUnlock", true); err != nil {
		t.Fatal(err)
	}
	if err := w.SetAgentOption("localUnlockRefresh", "2s"); err != nil {
		t.Fatal(err)
	}
	a, b := ImageNames[0], ImageNames[1]
	cpMark := logMark(t, cp)
	setPolicy(ctx, t, l, a, b)
	waitLog(ctx, t, cp, cpMark, `"msg":"disk key sealed to the join policy"`, `"images":["`+a+`","`+b+`"]`)

	rebootInto := func(n *Node, image string) int64 {
		t.Helper()
		n.Image = image
		return reboot(ctx, t, l, n)
	}
	mark := rebootInto(cp, b)
	wantInLog(t, cp, mark, `"msg":"state disk unlocked from the TPM"`)
	wantInLog(t, cp, mark, `"image":"`+b+`"`)
	mark = rebootInto(w, b)
	wantInLog(t, w, mark, `"msg":"rejoin ticket received"`)
	waitLog(ctx, t, w, mark, `"msg":"disk key sealed to the join policy"`, `"images":["`+a+`","`+b+`"]`)

	cpMark, wMark := logMark(t, cp), logMark(t, w)
	setPolicy(ctx, t, l, b)
	waitLog(ctx, t, cp, cpMark, `"msg":"disk key sealed to the join policy"`, `"images":["`+b+`"]`)
	waitLog(ctx, t, w, wMark, `"msg":"disk key sealed to the join policy"`, `"images":["`+b+`"]`)

	// worker-0 boots A again: refused locally and by the join service, both naming PCR 11.
	w.Image = a
	mark = logMark(t, w)
	cpMark = logMark(t, cp)
	if err := w.Reboot(ctx); err != nil {
		t.Fatal(err)
	}
	expected, got := hex.EncodeToString(PredictedPCRs(b)[imagePCR]), hex.EncodeToString(PredictedPCRs(a)[imagePCR])
	waitLog(ctx, t, w, mark, `"msg":"local unlock refused; asking for a rejoin ticket"`,
		fmt.Sprintf("differs at PCR %d: expected %s, got %s", imagePCR, expected, got))
	waitLog(ctx, t, cp, cpMark, `"msg":"measurements refused"`, `"peer_node":"worker-0"`,
		fmt.Sprintf("PCR %d: expected %s, got %s", imagePCR, expected, got))
	notInLog(t, w, mark, `"msg":"rejoin ticket received"`)
}

// checkRelease checks that the API server and every node's kubelet report the lab's release.
func checkRelease(ctx context.Context, t *testing.T, l *Lab) {
	t.Helper()
	out, err := l.Kubectl(ctx, "get", "--raw", "/version")
	if err != nil {
		t.Fatal(err)
	}
	var server struct{ GitVersion string }
	if err := json.Unmarshal([]byte(out), &server); err != nil {
		t.Fatalf("the API server's /version: %v\n%s", err, out)
	}
	if server.GitVersion != l.KubernetesVersion() {
		t.Errorf("the API server reports %s, the lab runs %s", server.GitVersion, l.KubernetesVersion())
	}
	out, err = l.Kubectl(ctx, "get", "nodes", "-o", `jsonpath={range .items[*]}{.metadata.name} {.status.nodeInfo.kubeletVersion}{"\n"}{end}`)
	if err != nil {
		t.Fatal(err)
	}
	nodes := strings.Split(out, "\n")
	for _, node := range nodes {
		if name, version, _ := strings.Cut(node, " "); version != l.KubernetesVersion() {
			t.Errorf("%s's kubelet reports %s, the lab runs %s", name, version, l.KubernetesVersion())
		}
	}
	t.Logf("the API server and the kubelets of %d nodes report %s", len(nodes), l.KubernetesVersion())
}

// setPolicy writes the join policy ConfigMap, as berth_join_policy does, allowing images for both roles.
func setPolicy(ctx context.Context, t *testing.T, l *Lab, images ...string) {
	t.Helper()
	p := &policy.Policy{}
	for _, name := range images {
		p.Images = append(p.Images, LabImage(name))
	}
	if err := l.SetPolicy(ctx, p); err != nil {
		t.Fatal(err)
	}
}

// waitLog waits until one line the node's agent logged after mark holds every text.
func waitLog(ctx context.Context, t *testing.T, n *Node, mark int64, texts ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	for {
		for line := range strings.Lines(logFrom(t, n, mark)) {
			if allIn(line, texts) {
				return
			}
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%s: no line of its agent's log has all of %q; it reads:\n%s", n.Name, texts, tail(logFrom(t, n, mark), 40))
		case <-time.After(time.Second):
		}
	}
}

func allIn(line string, texts []string) bool {
	for _, s := range texts {
		if !strings.Contains(line, s) {
			return false
		}
	}
	return true
}

// TestRecovery clears the TPM of a cluster's only control-plane node while it is off: its sealed key is
// useless (the storage seed changed) and no other node can give it a rejoin ticket. berth-agent recover,
// run by the operator with the root key, brings it back. Before that, the node booted from an image outside
// the policy is refused by the operator's tool, naming PCR 11, expected and got, with nothing sent to the
// node's key; and back on its image, a wrong root key is refused by the node before it quotes (the proof of
// its disk key is wrong). Recovered,
// the node seals its key in its new storage hierarchy, and its next reboot needs nobody.
func TestRecovery(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	var l *Lab
	c := labTest(t, func(c Config) (err error) {
		c.Nodes = []NodeSpec{{"cp-0", metadata.RoleControlPlane}}
		l, err = Up(ctx, c)
		return err
	})
	cp := l.Node("cp-0")
	a, b := ImageNames[0], ImageNames[1]
	cp.PowerOff()
	if err := cp.ClearTPM(); err != nil {
		t.Fatal(err)
	}
	cp.Image = b
	mark := logMark(t, cp)
	if err := cp.powerOn(ctx); err != nil {
		t.Fatal(err)
	}
	waitLog(ctx, t, cp, mark, `"msg":"local unlock refused; asking for a rejoin ticket"`)
	waitLog(ctx, t, cp, mark, `"msg":"recovery server listening`)

	dir := t.TempDir()
	root, err := l.RootKey()
	if err != nil {
		t.Fatal(err)
	}
	wrong := base64.StdEncoding.EncodeToString([]byte(rand.Text() + rand.Text())[:32])
	write := func(name, content string) string {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	policyFile := func(images ...string) string {
		p := &policy.Policy{}
		for _, name := range images {
			p.Images = append(p.Images, policy.Image{Name: name, PCRs: PredictedPCRs(name), Roles: []metadata.Role{metadata.RoleControlPlane}})
		}
		doc, err := p.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		return write("policy-"+strings.Join(images, "-")+".yaml", string(doc))
	}
	recoverNode := func(rootKey, policyPath string) (string, error) {
		out, err := exec.CommandContext(ctx, c.AgentBinary, "recover", "--node", net.JoinHostPort(cp.Addr.String(), fmt.Sprint(initPort)),
			"--root-key-file", write("root-key", rootKey), "--policy", policyPath, "--ek-ca-bundle", l.EKCAPath(),
			"--expect-name", "cp-0").CombinedOutput()
		return string(out), err
	}

	out, err := recoverNode(root, policyFile(a))
	expected, got := hex.EncodeToString(PredictedPCRs(a)[imagePCR]), hex.EncodeToString(PredictedPCRs(b)[imagePCR])
	if err == nil || !strings.Contains(out, fmt.Sprintf("PCR %d: expected %s, got %s", imagePCR, expected, got)) || !strings.Contains(out, "nothing was sent") {
		t.Fatalf("recovery of a node booted from an image outside the policy: %v\n%s\nwant a refusal naming PCR %d", err, out, imagePCR)
	}
	notInLog(t, cp, mark, "the key does not open")

	// Back on its image, the node still cannot unseal (its TPM was cleared).
	cp.Image = a
	mark = logMark(t, cp)
	since := time.Now()
	if err := cp.Reboot(ctx); err != nil {
		t.Fatal(err)
	}
	waitLog(ctx, t, cp, mark, `"msg":"local unlock refused; asking for a rejoin ticket"`, "another TPM, or in this one before it was cleared")
	waitLog(ctx, t, cp, mark, `"msg":"recovery server listening`)
	out, err = recoverNode(wrong, policyFile(a))
	if err == nil || !strings.Contains(out, "the proof is not of this node's disk key") {
		t.Fatalf("recovery with a wrong root key: %v\n%s\nwant the node's refusal of the proof", err, out)
	}
	wantInLog(t, cp, mark, `"msg":"recovery refused before any TPM command"`)
	notInLog(t, cp, mark, "state disk recovered")

	out, err = recoverNode(root, policyFile(a))
	if err != nil {
		t.Fatalf("recovery: %v\n%s", err, out)
	}
	t.Logf("berth-agent recover:\n%s", out)
	if err := l.WaitRestarted(ctx, cp, since); err != nil {
		t.Fatal(err)
	}
	wantInLog(t, cp, mark, `"msg":"state disk recovered by the operator"`)
	waitLog(ctx, t, cp, mark, `"msg":"disk key sealed to the join policy"`)
	checkDerivedKeyAlone(ctx, t, l, cp)

	mark = reboot(ctx, t, l, cp)
	wantInLog(t, cp, mark, `"msg":"state disk unlocked from the TPM"`)
}

// TestCertificateRenewal runs a cluster whose control-plane certificates last four minutes, and whose
// control-plane node renews them three minutes before their end: a minute after its init, once the cluster
// is up. A renewal restarts the node's API server and waits until the control plane is ready again, which
// takes this machine about two minutes. Past the first certificates' end, the cluster must still answer,
// roll out workloads, and admit a new node.
func TestCertificateRenewal(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	var l *Lab
	labTest(t, func(c Config) (err error) {
		c.Nodes = []NodeSpec{{"cp-0", metadata.RoleControlPlane}, {"worker-0", metadata.RoleWorker}}
		c.CertificateValidity, c.CertificateRenewBefore = 4*time.Minute, 3*time.Minute
		l, err = Up(ctx, c)
		return err
	})
	checkCertificateRenewal(ctx, t, l, controlPlaneCertificates(t, l))
}

// controlPlaneCertificates are the API server certificates of the lab's control-plane nodes, by node.
func controlPlaneCertificates(t *testing.T, l *Lab) map[string]*x509.Certificate {
	t.Helper()
	certs := map[string]*x509.Certificate{}
	for _, n := range l.Nodes {
		if n.Role != metadata.RoleControlPlane {
			continue
		}
		data, err := os.ReadFile(n.path("fs/etc/kubernetes/pki/apiserver.crt"))
		if err != nil {
			t.Fatal(err)
		}
		block, _ := pem.Decode(data)
		if block == nil {
			t.Fatalf("%s: apiserver.crt holds no PEM", n.Name)
		}
		if certs[n.Name], err = x509.ParseCertificate(block.Bytes); err != nil {
			t.Fatalf("%s: apiserver.crt: %v", n.Name, err)
		}
	}
	return certs
}

// checkCertificateRenewal waits until the control-plane nodes' first certificates have ended and checks that
// each node renewed its own before that, one node at a time; that every API server answers with its new
// certificates; that the controllers (with their renewed kubeconfigs) roll out a Deployment; that the join
// services, whose admin credentials were renewed under them, still let a new node join; and that the new
// node reaches the Deployment's Service by name.
func checkCertificateRenewal(ctx context.Context, t *testing.T, l *Lab, first map[string]*x509.Certificate) {
	t.Helper()
	var end time.Time
	for _, c := range first {
		if c.NotAfter.After(end) {
			end = c.NotAfter
		}
	}
	if wait := time.Until(end.Add(15 * time.Second)); wait > 0 {
		t.Logf("waiting %v for the first control-plane certificates to end", wait.Round(time.Second))
		select {
		case <-ctx.Done():
			t.Fatal(ctx.Err())
		case <-time.After(wait):
		}
	}
	type span struct {
		node       string
		start, end time.Time
	}
	var spans []span
	now := controlPlaneCertificates(t, l)
	for name, c := range first {
		if !now[name].NotAfter.After(c.NotAfter) {
			t.Errorf("%s's API server certificate still ends at %v: not renewed", name, c.NotAfter)
		}
		sp := span{node: name}
		for _, e := range agentLog(t, l.Node(name)) {
			switch e.Msg {
			case "renewing the control plane's certificates":
				sp.start = e.Time
			case "control plane back with renewed certificates":
				sp.end = e.Time
			}
		}
		if sp.start.IsZero() || sp.end.IsZero() || !sp.end.Before(c.NotAfter) {
			t.Errorf("%s: renewal from %v to %v, want one that ended before its certificates' end at %v", name, sp.start, sp.end, c.NotAfter)
		}
		spans = append(spans, sp)
		t.Logf("%s renewed its certificates in %v, %v before the first ones ended", name, sp.end.Sub(sp.start).Round(time.Second), c.NotAfter.Sub(sp.end).Round(time.Second))
	}
	for i, a := range spans {
		for _, b := range spans[i+1:] {
			if a.start.Before(b.end) && b.start.Before(a.end) {
				t.Errorf("%s and %s renewed at the same time: %+v, %+v", a.node, b.node, a, b)
			}
		}
	}
	for name := range first {
		var readyz string
		var err error
		for deadline := time.Now().Add(time.Minute); readyz != "ok"; time.Sleep(time.Second) {
			readyz, err = l.Kubectl(ctx, "--server", "https://"+l.Node(name).Addr.String()+":6443", "get", "--raw", "/readyz")
			if time.Now().After(deadline) {
				t.Fatalf("%s's API server after its first certificates ended: /readyz %q, %v", name, readyz, err)
			}
		}
	}
	if err := l.WaitAddons(ctx); err != nil {
		t.Fatal(err)
	}
	if err := l.ServeProbe(ctx, "renewed", []string{"cp-0", "worker-0"}); err != nil {
		t.Fatalf("a Deployment after the first certificates ended: %v", err)
	}
	if _, err := l.GrowTimed(ctx, NodeSpec{"worker-1", metadata.RoleWorker}); err != nil {
		t.Fatalf("a join after the join service's first admin credentials ended: %v", err)
	}
	checkServiceReached(ctx, t, l, "renewed", "fetch-after-renewal", l.Node("worker-1"))
}

// agentEntry is one line of a node's agent log.
type agentEntry struct {
	Time time.Time `json:"time"`
	Msg  string    `json:"msg"`
}

func agentLog(t *testing.T, n *Node) []agentEntry {
	t.Helper()
	f, err := os.Open(n.path("logs/agent.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var entries []agentEntry
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var e agentEntry
		if json.Unmarshal(sc.Bytes(), &e) == nil {
			entries = append(entries, e)
		}
	}
	return entries
}
