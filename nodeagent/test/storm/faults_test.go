package storm

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	bootstrapapi "k8s.io/cluster-bootstrap/token/api"

	"github.com/berthlabs/berth/internal/backoff"
	"github.com/berthlabs/berth/internal/keys"
	"github.com/berthlabs/berth/internal/luks"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/internal/repotest"
	"github.com/berthlabs/berth/nodeagent/internal/failpoint"
	"github.com/berthlabs/berth/nodeagent/internal/joinclient"
	"github.com/berthlabs/berth/nodeagent/internal/joinservice"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
	"github.com/berthlabs/berth/nodeagent/internal/statedisk"
	"github.com/berthlabs/berth/test/clustertest"
)

// faultStorm is how many agents each fault run boots: enough that a storm lasts about a second here, so
// that a fault injected after its first tickets lands in its middle.
const faultStorm = 100

// faultAfter is how many tickets a storm issues before its fault.
const faultAfter = 5

// tokenTTL is the join service's bootstrap token lifetime (joinservice.Config's default).
const tokenTTL = 10 * time.Minute

// TestFaults is make faults: storms in which the join service is killed with SIGKILL and restarted, and
// kube-apiserver is killed and restarted, and real agents crashed at every step of their join, or of a
// reseal, and booted again. After each: every agent holds a ticket, every disk key is the one the cluster
// derives for that disk, no bootstrap token lives longer than its TTL, and the join service's live heap after
// a storm does not keep growing with the storms.
func TestFaults(t *testing.T) {
	if os.Getenv("BERTH_FAULTS") == "" {
		t.Skip("fault runs: make faults runs them (BERTH_FAULTS=1)")
	}
	h := NewHost(t, poolSize)
	svc := h.StartService()
	// lastFault is when the last fault ended: a bootstrap token made before it may be one that a ticket the
	// fault cut off left behind.
	var lastFault time.Time

	t.Run("join service killed mid-storm", func(t *testing.T) {
		agents := h.stormWith(t, faultStorm, func(issued int) bool {
			if issued < faultAfter {
				return false
			}
			h.current().Kill()
			time.Sleep(time.Second)
			svc = h.StartService()
			lastFault = time.Now()
			return true
		})
		h.checkAgents(t, agents, lastFault)
	})
	t.Run("kube-apiserver restarted mid-storm", func(t *testing.T) {
		agents := h.stormWith(t, faultStorm, func(issued int) bool {
			if issued < faultAfter {
				return false
			}
			h.API.RestartAPIServer()
			lastFault = time.Now()
			return true
		})
		h.checkAgents(t, agents, lastFault)
	})
	t.Run("join service memory", func(t *testing.T) {
		var heaps []int64
		for range 3 {
			h.checkAgents(t, h.stormWith(t, faultStorm, nil), lastFault)
			heap, err := svc.HeapInUse()
			if err != nil {
				t.Fatal(err)
			}
			heaps = append(heaps, heap)
		}
		t.Logf("live heap after each of three storms of %d: %d, %d, %d KiB", faultStorm, heaps[0]>>10, heaps[1]>>10, heaps[2]>>10)
		// A leak keeps what every ticket leaves: the third storm would add what the second did.
		if growth := heaps[2] - heaps[1]; growth > 1<<20 && growth > (heaps[1]-heaps[0])/2 {
			t.Errorf("the live heap grew by %d KiB over the third storm after %d KiB over the second: something grows with every ticket", growth>>10, (heaps[1]-heaps[0])>>10)
		}
	})
	// The crash runs boot a failpoint build; the join service keeps running the build it started with.
	h.agentBin = buildFailpointAgent(t)
	t.Run("agents crashed at each step of the join", func(t *testing.T) {
		points := []string{
			joinclient.FailpointAfterLock,
			"disk-" + statedisk.StepKeyAdded,
			"disk-" + statedisk.StepLabelled, // the old key is still there: removing it is next
			joinclient.FailpointAfterCredentials,
			"kubeadm", // the agent is killed while kubeadm join runs
			// A worker that seals its key dies right after storing it: the next boot unlocks from the TPM.
			"disk-" + statedisk.StepSealedStored,
		}
		workers := h.AddWorkers(len(points))
		for i, point := range points {
			t.Run(point, func(t *testing.T) { h.crashAndReboot(t, workers[i].Name, workers[i].Addresses[0].String(), point) })
		}
	})
	t.Run("sealing workers crashed at each step of a reseal", func(t *testing.T) {
		points := []string{"disk-" + statedisk.StepSealedStored, "disk-" + statedisk.StepSealedPruned}
		workers := h.AddWorkers(len(points))
		for i, point := range points {
			t.Run(point, func(t *testing.T) { h.crashWhileResealing(t, workers[i].Name, workers[i].Addresses[0].String(), point) })
		}
	})
}

// crashWhileResealing runs a failpoint build of berth-agent as a worker that seals its key: it joins and
// seals to the policy, the policy gains an image, and the agent booted again unlocks from its TPM, learns
// the new policy at its next refresh, and dies at point while sealing to it. Booted once more, it unlocks
// from its TPM and keeps the key sealed to the new policy, not to its join ticket's, which allowed one image;
// its disk holds the derived key alone and one sealed key.
func (h *Host) crashWhileResealing(t *testing.T, name, addr, point string) {
	t.Helper()
	dir := filepath.Join(h.dir, "reseal", name)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	img := filepath.Join(dir, "state.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 32<<20); err != nil {
		t.Fatal(err)
	}
	kubeadm := filepath.Join(dir, "kubeadm")
	if err := os.WriteFile(kubeadm, []byte("#!/bin/sh\nexit 0\n"), 0o700); err != nil {
		t.Fatal(err)
	}
	// A sealing worker's agent stays up and asks for its policy every second here.
	config, err := h.writeAgentConfig(dir, addr, h.EKCA.NewTPM(t).Device(), img, kubeadm, map[string]any{
		"localUnlock": true, "localUnlockRefresh": "1s",
	})
	if err != nil {
		t.Fatal(err)
	}
	if out, err := h.runAgent(t, config, nil, "disk key sealed to the join policy"); err != nil {
		t.Fatalf("first boot: %v\n%s", err, out)
	}
	h.setPolicy(t, "swtpm-zero", "next")
	defer h.setPolicy(t, "swtpm-zero")
	out, err := h.runAgent(t, config, []string{failpoint.EnvVar + "=" + point}, "")
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("the agent was to die by SIGKILL at %s while it resealed; it ended with %v:\n%s", point, err, out)
	}
	if !strings.Contains(out, "state disk unlocked from the TPM") {
		t.Fatalf("the second boot did not unlock from the TPM:\n%s", out)
	}
	// Whatever a boot seals right after it unlocks, it has sealed by the time it says the boot finished.
	if out, err = h.runAgent(t, config, nil, `"msg":"boot finished"`); err != nil {
		t.Fatalf("booting after the crash at %s: %v\n%s", point, err, out)
	}
	if !strings.Contains(out, "state disk unlocked from the TPM") {
		t.Fatalf("the boot after the crash at %s did not unlock from the TPM:\n%s", point, out)
	}
	vol := luks.New(img, nil)
	h.checkDerivedKeyAlone(t, vol)
	tokens, err := vol.Tokens(context.Background(), statedisk.SealedTokenType)
	if err != nil || len(tokens) != 1 {
		t.Fatalf("sealed keys after the boot that followed the crash at %s: %d (%v), want the newest alone; its output:\n%s", point, len(tokens), err, out)
	}
	stored, err := statedisk.New(vol, nil).SealedKeys(context.Background())
	if err != nil || len(stored) != 1 {
		t.Fatalf("reading the sealed key: %d (%v)", len(stored), err)
	}
	want := []string{"swtpm-zero", "next"}
	// The policy the key is sealed to is stored beside it (localunlock's record).
	var sealed struct {
		Policy []byte `json:"policy"`
	}
	if err := json.Unmarshal(stored[0].Data, &sealed); err != nil {
		t.Fatalf("reading the sealed key: %v", err)
	}
	if images, err := imageNames(sealed.Policy); err != nil || !slices.Equal(images, want) {
		t.Errorf("after the boot that followed the crash at %s the key is sealed to the images %v (%v), want %v; its output:\n%s", point, images, err, want, out)
	}
	// A boot that cannot unseal (an operator's recovery) seals to the policy the node recorded last.
	recorded, err := os.ReadFile(filepath.Join(dir, "state", joinclient.UnlockPolicyFile))
	if err != nil {
		t.Fatal(err)
	}
	if images, err := imageNames(recorded); err != nil || !slices.Equal(images, want) {
		t.Errorf("after the crash at %s the node's recorded unlock policy allows %v (%v), want %v", point, images, err, want)
	}
}

// imageNames returns the names of the images of a policy document.
func imageNames(doc []byte) ([]string, error) {
	p, err := policy.Parse(doc)
	if err != nil {
		return nil, err
	}
	names := make([]string, len(p.Images))
	for i, img := range p.Images {
		names[i] = img.Name
	}
	return names, nil
}

// runAgent runs berth-agent boot with config and env until it exits or, if until is set, until its output
// holds until, when it is killed. It returns the agent's output and how it ended (nil when killed).
func (h *Host) runAgent(t *testing.T, config string, env []string, until string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out clustertest.SafeBuffer
	cmd := exec.CommandContext(ctx, h.agentBin, "boot", "--config", config)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	for {
		select {
		case err := <-exited:
			return out.String(), err
		case <-time.After(100 * time.Millisecond):
			if until != "" && strings.Contains(out.String(), until) {
				cmd.Process.Kill()
				<-exited
				return out.String(), nil
			}
		}
	}
}

// setPolicy makes the join service's policy admit the given images for workers: swtpm-zero is what the
// agents' fresh swtpms quote, any other name an image no agent runs.
func (h *Host) setPolicy(t *testing.T, images ...string) {
	t.Helper()
	p := &policy.Policy{}
	for _, name := range images {
		img := clustertest.ZeroPolicy(name, metadata.RoleWorker).Images[0]
		if name != "swtpm-zero" {
			for i := range img.PCRs {
				img.PCRs[i] = bytes.Repeat([]byte{0xb}, 32)
			}
		}
		p.Images = append(p.Images, img)
	}
	data, err := p.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	loaded := func() int { return strings.Count(h.current().Log(), `"msg":"join policy loaded"`) }
	before := loaded()
	if err := nodestate.WriteFile(filepath.Join(h.dir, "policy.yaml"), data, 0o600); err != nil {
		t.Fatal(err)
	}
	// The service reads its policy file every few seconds: wait until it has this one.
	for deadline := time.Now().Add(time.Minute); loaded() == before; time.Sleep(200 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the join service did not load the policy of %v", images)
		}
	}
}

// checkDerivedKeyAlone fails unless the disk opens with its derived key and holds no other keyslot.
func (h *Host) checkDerivedKeyAlone(t *testing.T, vol *luks.Volume) {
	t.Helper()
	ctx := context.Background()
	uuid, err := vol.UUID(ctx)
	if err != nil {
		t.Fatal(err)
	}
	label, err := keys.DiskLabel(uuid)
	if err != nil {
		t.Fatal(err)
	}
	key, err := keys.Derive(h.Master, h.Salt, label, 32)
	if err != nil {
		t.Fatal(err)
	}
	slot, err := vol.KeySlot(ctx, key)
	if err != nil {
		t.Fatalf("the state disk does not open with its derived key: %v", err)
	}
	slots, err := vol.Slots(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(slots) != 1 || slots[0] != slot {
		t.Errorf("the state disk holds key slots %v, want only slot %d of its derived key", slots, slot)
	}
}

// current is the join service running now.
func (h *Host) current() *Service {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.service
}

// stormWith runs a storm of n new workers; fault, if set, is called with the number of tickets issued so
// far until it returns true.
func (h *Host) stormWith(t *testing.T, n int, fault func(issued int) bool) []*Agent {
	t.Helper()
	workers := h.AddWorkers(n)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	done := make(chan []*Agent, 1)
	// A short cap keeps the run brisk; the schedule is otherwise the agents' own.
	go func() { done <- h.Storm(ctx, workers, backoff.Policy{Max: 2 * time.Second}, nil) }()
	issuedSoFar := func() int { return strings.Count(h.current().Log(), `"msg":"join ticket issued"`) }
	before := issuedSoFar()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case agents := <-done:
			if fault != nil {
				t.Fatal("the storm ended before the fault was injected")
			}
			return agents
		case <-tick.C:
			if fault == nil {
				continue
			}
			issued := issuedSoFar() - before
			if fault(issued) {
				fault = nil
				if issued >= n {
					t.Fatalf("the fault came after all %d tickets: the storm is too small to be interrupted", n)
				}
				t.Logf("fault injected after %d of %d tickets", issued, n)
			}
		}
	}
}

// checkAgents checks a storm's outcome: every agent joined, with the key the cluster derives for its disk;
// every bootstrap token expires within its TTL of being made; and each node has one disk record and one
// token, besides tokens made before lastFault.
func (h *Host) checkAgents(t *testing.T, agents []*Agent, lastFault time.Time) {
	t.Helper()
	for _, a := range agents {
		if a.Err != nil {
			t.Errorf("%s did not join: %v", a.Name, a.Err)
			continue
		}
		label, err := keys.DiskLabel(a.Disk)
		if err != nil {
			t.Fatal(err)
		}
		want, err := keys.Derive(h.Master, h.Salt, label, 32)
		if err != nil {
			t.Fatal(err)
		}
		if len(a.Keys) == 0 {
			t.Errorf("%s was given no disk key", a.Name)
		}
		for _, k := range a.Keys {
			if !bytes.Equal(k, want) {
				t.Errorf("%s was given a disk key that is not its disk's derived key", a.Name)
			}
		}
	}
	secrets, err := h.API.Client.CoreV1().Secrets(joinservice.Namespace).List(context.Background(), metav1.ListOptions{
		FieldSelector: "type=" + string(bootstrapapi.SecretTypeBootstrapToken)})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range secrets.Items {
		exp, err := time.Parse(time.RFC3339, string(s.Data[bootstrapapi.BootstrapTokenExpirationKey]))
		if err != nil {
			t.Errorf("bootstrap token %s: expiration %q: %v", s.Name, s.Data[bootstrapapi.BootstrapTokenExpirationKey], err)
			continue
		}
		// The creation time has second resolution, like the expiration.
		if life := exp.Sub(s.CreationTimestamp.Time); life > tokenTTL+time.Second {
			t.Errorf("bootstrap token %s lives %v, longer than its TTL %v", s.Name, life, tokenTTL)
		}
	}
	// A node that joined again (a crash between its ticket and its key swap formats a fresh disk) replaced
	// its record and its token: one of each per node at most. A ticket cut off by a fault after its token was
	// made leaves that token behind, never handed out, until it expires: the node's next ticket removes the
	// tokens the service's watch has seen, and the watch is behind while the API server restarts.
	records, err := h.API.Client.CoreV1().ConfigMaps(joinservice.Namespace).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	disks := map[string]int{}
	for _, r := range records.Items {
		disks[r.Annotations["berth.dev/instance-name"]]++
	}
	for node, n := range disks {
		if n > 1 && node != "" {
			t.Errorf("%d disk records of %s", n, node)
		}
	}
	tokens := map[string][]time.Time{}
	for _, s := range secrets.Items {
		node := s.Annotations["berth.dev/instance-name"]
		tokens[node] = append(tokens[node], s.CreationTimestamp.Time)
	}
	leftBehind := 0
	for node, made := range tokens {
		if len(made) < 2 || node == "" {
			continue
		}
		slices.SortFunc(made, time.Time.Compare)
		// Creation times are whole seconds.
		if older := made[len(made)-2]; older.After(lastFault) {
			t.Errorf("%s holds %d bootstrap tokens, made at %v; only a fault (the last ended at %v) may leave an older one behind", node, len(made), made, lastFault.Format(time.RFC3339Nano))
			continue
		}
		leftBehind += len(made) - 1
	}
	t.Logf("%d agents joined; %d bootstrap tokens, none living longer than %v, %d of them left behind by tickets a fault cut off; %d disk records",
		len(agents), len(secrets.Items), tokenTTL, leftBehind, len(records.Items))
}

// crashAndReboot boots a failpoint build of berth-agent as a worker that dies at point, boots it again
// normally, and checks that the node joined and its state disk opens with its derived key and holds no other.
func (h *Host) crashAndReboot(t *testing.T, name, addr, point string) {
	t.Helper()
	dir := filepath.Join(h.dir, "crash", name)
	tpm := h.EKCA.NewTPM(t)
	img := filepath.Join(dir, "state.img")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 32<<20); err != nil {
		t.Fatal(err)
	}
	kubeadm := filepath.Join(dir, "kubeadm")
	crashKubeadm := "#!/bin/sh\nkill -9 $PPID\nsleep 5\n"
	sealing := point == "disk-"+statedisk.StepSealedStored
	config, err := h.writeAgentConfig(dir, addr, tpm.Device(), img, kubeadm, map[string]any{"localUnlock": sealing})
	if err != nil {
		t.Fatal(err)
	}

	writeKubeadm := func(script string) {
		if err := os.WriteFile(kubeadm, []byte(script), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	env, script := []string{failpoint.EnvVar + "=" + point}, "#!/bin/sh\nexit 0\n"
	if point == "kubeadm" {
		env, script = nil, crashKubeadm
	}
	writeKubeadm(script)
	out, err := h.runAgent(t, config, env, "")
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("the agent was to die by SIGKILL at %s; it ended with %v:\n%s", point, err, out)
	}
	writeKubeadm("#!/bin/sh\nexit 0\n")
	// A sealing worker's agent stays up to refresh its seal: it is stopped once it has unlocked.
	until := ""
	if sealing {
		until = "state disk unlocked from the TPM"
	}
	if out, err := h.runAgent(t, config, nil, until); err != nil {
		t.Fatalf("booting again after the crash at %s: %v\n%s", point, err, out)
	}

	h.checkDerivedKeyAlone(t, luks.New(img, nil))
	if state, err := nodestate.Read(filepath.Join(dir, "state")); err != nil || state.NodeName == "" {
		t.Errorf("no node state after the reboot: %+v, %v", state, err)
	}
}

func buildFailpointAgent(t *testing.T) string {
	t.Helper()
	return repotest.BuildBinary(t, "./nodeagent/cmd/berth-agent", "failpoint")
}
