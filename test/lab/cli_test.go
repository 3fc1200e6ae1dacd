package lab

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/initclient"
	"github.com/berthlabs/berth/internal/initsecret"
	"github.com/berthlabs/berth/internal/manifest"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/repotest"
)

// TestLabCLI drives the lab the way Terraform's lab example does, one berth-lab process per step: a host,
// then a control-plane node and a worker brought up by two processes at once with their user-data JSON,
// then the worker removed (twice: removing is idempotent) and the lab taken down. On the way it shows that
// the control-plane node quotes the PCR 11 the manifest predicts for its image, by attesting it against
// the other image's prediction.
func TestLabCLI(t *testing.T) {
	repotest.NeedsRoot(t, "the lab makes network and mount namespaces and cgroups")
	kubeBin, agent, labBin := buildTools(t)
	dir := filepath.Join(t.TempDir(), "lab")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	berthLab := func(args ...string) (string, error) {
		out, err := exec.CommandContext(ctx, labBin, args...).CombinedOutput()
		return string(out), err
	}
	t.Cleanup(func() {
		if err := Down(context.Background(), dir); err != nil {
			t.Errorf("lab down: %v", err)
		}
		if left := Leftovers(dir); len(left) > 0 {
			t.Errorf("the lab left behind: %v", left)
		}
	})

	out, err := berthLab("host", "--dir", dir, "--kube-bin", kubeBin, "--agent", agent)
	if err != nil {
		t.Fatalf("berth-lab host: %v\n%s", err, out)
	}
	manifestPath := filepath.Join(dir, manifestFile)
	if !strings.Contains(out, "manifest: "+manifestPath+"\n") || !strings.Contains(out, "ek-ca: "+filepath.Join(dir, ekCAFile)+"\n") {
		t.Errorf("berth-lab host does not print the manifest and EK CA paths:\n%s", out)
	}
	data, err := os.ReadFile(manifestPath)
	if err != nil {
		t.Fatal(err)
	}
	m, err := manifest.Parse(data)
	if err != nil {
		t.Fatalf("%s: %v", manifestPath, err)
	}
	release, _, err := kubeadmImages(ctx, kubeBin)
	if err != nil {
		t.Fatal(err)
	}
	checkManifest(t, m, release)

	secret, err := initsecret.NewSecret()
	if err != nil {
		t.Fatal(err)
	}
	hash, err := initsecret.Hash([]byte(secret))
	if err != nil {
		t.Fatal(err)
	}
	joinCA, err := pki.NewCA("berth-join-ca", time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	workerData := metadata.UserData{ClusterName: "berthlab", JoinPort: joinPort, JoinCAPin: pki.SPKIPin(joinCA.Cert)}
	cpData := workerData
	cpData.InitSecretHash = hash
	machines := []Machine{
		{Name: "cp-0", Role: metadata.RoleControlPlane, Addr: mustAddr("10.250.0.10"), Image: "berthlab-a", UserData: cpData},
		{Name: "worker-0", Role: metadata.RoleWorker, Addr: mustAddr("10.250.0.20"), Image: "berthlab-b", UserData: workerData},
	}
	outs, errs := make([]string, len(machines)), make([]error, len(machines))
	var wg sync.WaitGroup
	for i, m := range machines {
		ud, err := json.Marshal(m.UserData)
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() {
			outs[i], errs[i] = berthLab("node", "up", "--dir", dir, "--name", m.Name, "--role", string(m.Role),
				"--addr", m.Addr.String(), "--image", m.Image, "--user-data", string(ud))
		})
	}
	wg.Wait()
	for i, m := range machines {
		if errs[i] != nil {
			t.Fatalf("berth-lab node up %s: %v\n%s", m.Name, errs[i], outs[i])
		}
		if !strings.Contains(outs[i], m.Name+": berth-agent boot") {
			t.Errorf("berth-lab node up %s does not report the agent's boot:\n%s", m.Name, outs[i])
		}
	}

	doc, err := readDocument(filepath.Join(dir, documentFile))
	if err != nil {
		t.Fatal(err)
	}
	if len(doc.Instances) != 2 {
		t.Fatalf("metadata.json lists %d instances after two node ups, want 2: %+v", len(doc.Instances), doc.Instances)
	}
	for _, m := range machines {
		i := instanceIndex(doc, m.Name)
		if i < 0 {
			t.Errorf("metadata.json does not list %s", m.Name)
			continue
		}
		if inst := doc.Instances[i]; inst.Role != m.Role || inst.ImageID != m.Image || inst.Addresses[0] != m.Addr {
			t.Errorf("metadata.json has %+v for %+v", inst, m)
		}
	}
	if !reflect.DeepEqual(doc.UserData, cpData) {
		t.Errorf("the lab's user-data is %+v, want the control plane's (the worker's lacks only the init secret hash)", doc.UserData)
	}
	hosts, err := os.ReadFile(filepath.Join(dir, "hosts"))
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range machines {
		if !strings.Contains(string(hosts), m.Addr.String()+" "+m.Name+"\n") {
			t.Errorf("the nodes' /etc/hosts lacks %s:\n%s", m.Name, hosts)
		}
	}

	// cp-0 runs image berthlab-a: attested against berthlab-b's prediction it fails on PCR 11, and what it
	// quotes there is berthlab-a's prediction. The client proves the init secret before the node quotes, but
	// the secret itself is never sent to a node that fails.
	l, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	roots, inters, err := l.ekCA.Pools()
	if err != nil {
		t.Fatal(err)
	}
	wrongImage := func(expected, running string) {
		t.Helper()
		_, err = initclient.Init(ctx, initclient.Config{
			Endpoint:     net.JoinHostPort("10.250.0.10", fmt.Sprint(initPort)),
			Verifier:     attest.NewVerifier(attest.NewCertChain(roots, inters, nil)),
			ExpectedPCRs: PredictedPCRs(expected),
			Request:      &berthv1.InitRequest{InitSecret: []byte(secret)},
			Timeout:      3 * time.Minute,
		})
		var me *initclient.MeasurementError
		if !errors.As(err, &me) {
			t.Fatalf("init against the wrong image's prediction: %v, want a MeasurementError\n%s", err, tailFile(filepath.Join(dir, "nodes/cp-0/logs/agent.log"), 25))
		}
		if want := PredictedPCRs(running)[imagePCR]; me.PCR != imagePCR || !bytes.Equal(me.Got, want) {
			t.Errorf("measurement error on PCR %d with %x; want PCR %d holding %s's predicted %x", me.PCR, me.Got, imagePCR, running, want)
		}
	}
	wrongImage("berthlab-b", "berthlab-a")
	// Reimaged with berthlab-b, cp-0 quotes berthlab-b's measurement, and the metadata says so.
	if out, err := berthLab("node", "reimage", "--dir", dir, "--name", "cp-0", "--image", "berthlab-b"); err != nil || !strings.Contains(out, "cp-0: reimaged with berthlab-b") {
		t.Fatalf("berth-lab node reimage: %v\n%s", err, out)
	}
	wrongImage("berthlab-a", "berthlab-b")
	if doc, err = readDocument(filepath.Join(dir, documentFile)); err != nil {
		t.Fatal(err)
	}
	if i := instanceIndex(doc, "cp-0"); i < 0 || doc.Instances[i].ImageID != "berthlab-b" {
		t.Errorf("metadata.json after the reimage: %+v", doc.Instances)
	}

	for range 2 {
		if out, err := berthLab("node", "down", "--dir", dir, "--name", "worker-0"); err != nil {
			t.Fatalf("berth-lab node down worker-0: %v\n%s", err, out)
		}
	}
	if left := nodeLeftovers(dir, "worker-0"); len(left) > 0 {
		t.Errorf("node down left of worker-0: %v", left)
	}
	if left := nodeLeftovers(dir, "cp-0"); len(left) != 4 {
		t.Errorf("node down of worker-0 touched cp-0: it has %v", left)
	}
	if doc, err = readDocument(filepath.Join(dir, documentFile)); err != nil || len(doc.Instances) != 1 || doc.Instances[0].Name != "cp-0" {
		t.Errorf("metadata.json after node down: %+v, %v", doc, err)
	}
	if hosts, err := os.ReadFile(filepath.Join(dir, "hosts")); err != nil || strings.Contains(string(hosts), "worker-0") {
		t.Errorf("the nodes' /etc/hosts after node down: %v\n%s", err, hosts)
	}

	if out, err := berthLab("down", "--dir", dir); err != nil || !strings.Contains(out, "nothing left: true") {
		t.Fatalf("berth-lab down: %v\n%s", err, out)
	}
	if left := Leftovers(dir); len(left) > 0 {
		t.Errorf("berth-lab down left: %v", left)
	}
}

func mustAddr(s string) netip.Addr { return netip.MustParseAddr(s) }

func instanceIndex(doc *metadata.Document, name string) int {
	for i, inst := range doc.Instances {
		if inst.Name == name {
			return i
		}
	}
	return -1
}

// nodeLeftovers lists what of a node is on the host: its network namespace, veth, cgroups and directory.
func nodeLeftovers(dir, name string) []string {
	var out []string
	if _, err := os.Stat("/run/netns/" + netnsPrefix + name); err == nil {
		out = append(out, "netns")
	}
	if _, err := run(context.Background(), "ip", "link", "show", vethPrefix+name); err == nil {
		out = append(out, "veth")
	}
	if ctrls, err := cgroupControllers(); err == nil {
		for _, c := range ctrls {
			if _, err := os.Stat(filepath.Join(cgroupRoot, c, cgroupParent, name)); err == nil {
				out = append(out, "cgroup")
				break
			}
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "nodes", name)); err == nil {
		out = append(out, "directory")
	}
	return out
}
