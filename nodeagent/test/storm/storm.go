// Package storm drives join storms for make bench and make faults: many agents booting at once against one
// join service, the real `berth-agent joinservice` process, backed by a real kube-apiserver and etcd.
//
// The load side is built not to be the bottleneck: agents are goroutines of the test process running the
// real join client (TLS, gRPC, evidence, credential activation, credentials written to disk), each with its
// own loopback address and instance record, and their TPMs are a pool of swtpm processes, each manufactured
// with its own EK certificate, shared round-robin (attest.Prover serializes one TPM's commands). A quote and
// an activation cost a few milliseconds of swtpm time, so a pool of eight serves a thousand agents in
// seconds. The kubeadm join after the ticket and the state disk are stand-ins: a storm measures ticket
// issuance. Real agent processes (Host.BootAgent) boot beside the storm to measure an agent's own memory.
package storm

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/backoff"
	"github.com/berthlabs/berth/internal/initsecret"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/repotest"
	"github.com/berthlabs/berth/internal/swtpm/swtpmtest"
	"github.com/berthlabs/berth/nodeagent/internal/joinclient"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
	"github.com/berthlabs/berth/nodeagent/internal/statedisk"
	"github.com/berthlabs/berth/test/clustertest"
	"github.com/berthlabs/berth/test/kubetest"
)

// Host is the cluster side of a storm.
type Host struct {
	*clustertest.Cluster
	t   testing.TB
	dir string
	API *kubetest.APIServer
	// JoinAddr is host:port of the join service.
	JoinAddr string
	// InitSecret is the init secret whose hash the nodes' user-data holds.
	InitSecret []byte

	agentBin string
	config   string
	provers  []*attest.Prover

	mu      sync.Mutex
	workers int
	service *Service
}

// NewHost starts kube-apiserver and etcd, the metadata service and a pool of tpms swtpm processes, and
// prepares the join service's node (secrets, CA, policy) without starting it.
func NewHost(t testing.TB, tpms int) *Host {
	t.Helper()
	h := &Host{t: t, dir: t.TempDir()}
	h.API = kubetest.Start(t)
	port := uint16(kubetest.FreePort(t))
	h.JoinAddr = netip.AddrPortFrom(clustertest.ServiceAddr, port).String()
	secret, err := initsecret.NewSecret()
	if err != nil {
		t.Fatal(err)
	}
	hash, err := initsecret.Hash([]byte(secret))
	if err != nil {
		t.Fatal(err)
	}
	h.InitSecret = []byte(secret)
	h.Cluster = clustertest.New(t, clustertest.Options{Name: "storm", JoinPort: port, KubernetesCA: h.API.CA, InitSecretHash: hash})
	h.agentBin = repotest.BuildBinary(t, "./nodeagent/cmd/berth-agent", repotest.Build{})

	var wg sync.WaitGroup
	h.provers = make([]*attest.Prover, tpms)
	errs := make([]error, tpms)
	for i := range tpms {
		tpm := h.EKCA.NewTPM(t)
		wg.Go(func() {
			conn, err := attest.OpenTPM(tpm.Device())
			if err == nil {
				h.provers[i], err = attest.NewProver(conn)
			}
			errs[i] = err
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, p := range h.provers {
			p.Close()
		}
	})
	h.writeServiceNode()
	return h
}

// AddWorkers gives n more workers instance records, on loopback addresses from 127.1.0.1 up, and returns
// their names and addresses in order.
func (h *Host) AddWorkers(n int) []metadata.Instance {
	h.mu.Lock()
	defer h.mu.Unlock()
	first := h.workers
	h.workers += n
	added := make([]metadata.Instance, n)
	for i := range n {
		k := first + i + 1
		addr := netip.AddrFrom4([4]byte{127, byte(1 + k/65536), byte(k / 256 % 256), byte(k % 256)})
		added[i] = metadata.Instance{Name: fmt.Sprintf("worker-%d", k), Role: metadata.RoleWorker, Addresses: []netip.Addr{addr}}
	}
	h.AddInstances(added...)
	return added
}

// writeServiceNode lays out what a control-plane node's agent keeps for its join service: the cluster
// secrets, the Kubernetes CA, the EK CA bundle, a kubeconfig and a policy file.
func (h *Host) writeServiceNode() {
	t := h.t
	paths := nodestate.Paths{State: filepath.Join(h.dir, "state"), KubernetesDir: filepath.Join(h.dir, "kubernetes"),
		KubeletDir: filepath.Join(h.dir, "kubelet")}
	joinKey, err := pki.EncodeKeyPEM(h.JoinCA.Key)
	if err != nil {
		t.Fatal(err)
	}
	if err := nodestate.WriteSecrets(paths.State, &nodestate.ClusterSecrets{
		MasterSecret: h.Master, Salt: h.Salt, JoinCACert: h.JoinCA.CertPEM(), JoinCAKey: joinKey,
		APIServerEndpoint: strings.TrimPrefix(h.API.URL, "https://"), KubernetesVersion: repotest.KubernetesVersion,
	}); err != nil {
		t.Fatal(err)
	}
	caKey, err := pki.EncodeKeyPEM(h.API.CA.Key)
	if err != nil {
		t.Fatal(err)
	}
	// Fresh swtpms hold zeros in every PCR the agents quote.
	polData, err := clustertest.ZeroPolicy("swtpm-zero", metadata.RoleWorker).Marshal()
	if err != nil {
		t.Fatal(err)
	}
	files := map[string][]byte{
		filepath.Join(paths.PKIDir(), "ca.crt"): h.API.CA.CertPEM(),
		filepath.Join(paths.PKIDir(), "ca.key"): caKey,
		filepath.Join(h.dir, "ek-ca.pem"):       h.EKCA.BundlePEM(),
		filepath.Join(h.dir, "admin.conf"):      h.API.Kubeconfig,
		filepath.Join(h.dir, "policy.yaml"):     polData,
	}
	for p, data := range files {
		if err := nodestate.WriteFile(p, data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	cfg := map[string]any{
		"metadataURL": h.MetaURL, "stateDisk": "unused: the join service opens no disk",
		"paths":         map[string]string{"state": paths.State, "kubernetesDir": paths.KubernetesDir, "kubeletDir": paths.KubeletDir},
		"sourceAddress": "127.0.0.1", "joinListenHost": "127.0.0.1",
		"ekCABundle": filepath.Join(h.dir, "ek-ca.pem"), "kubeconfig": filepath.Join(h.dir, "admin.conf"),
		"policyFile": filepath.Join(h.dir, "policy.yaml"),
	}
	data, err := yaml.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	h.config = filepath.Join(h.dir, "joinservice.yaml")
	if err := os.WriteFile(h.config, data, 0o600); err != nil {
		t.Fatal(err)
	}
}

// Service is a running join service process.
type Service struct {
	cmd     *exec.Cmd
	log     *clustertest.SafeBuffer
	Ready   time.Time
	Debug   string // its pprof address
	cpu0    time.Duration
	stopped bool
}

// StartService starts `berth-agent joinservice` and waits until it listens.
func (h *Host) StartService() *Service {
	t := h.t
	t.Helper()
	debug := fmt.Sprintf("127.0.0.1:%d", kubetest.FreePort(t))
	s := &Service{log: &clustertest.SafeBuffer{}, Debug: debug}
	s.cmd = exec.Command(h.agentBin, "joinservice", "--config", h.config, "--debug-listen", debug)
	s.cmd.Stdout, s.cmd.Stderr = s.log, s.log
	if err := s.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	h.mu.Lock()
	h.service = s
	h.mu.Unlock()
	t.Cleanup(func() { s.Kill() })
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(s.log.String(), `"msg":"join service listening"`) {
		if time.Now().After(deadline) || s.cmd.ProcessState != nil {
			t.Fatalf("the join service did not start listening:\n%s", s.log.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	s.Ready = time.Now()
	s.cpu0 = s.CPU()
	return s
}

// CPU is the process's user and system time so far.
func (s *Service) CPU() time.Duration {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", s.cmd.Process.Pid))
	if err != nil {
		return 0
	}
	// The fields after the command name, which is in parentheses and may hold spaces.
	fields := strings.Fields(string(data[bytes.LastIndexByte(data, ')')+2:]))
	utime, _ := strconv.ParseInt(fields[11], 10, 64)
	stime, _ := strconv.ParseInt(fields[12], 10, 64)
	const clockTicks = 100 // USER_HZ on Linux
	return time.Duration(utime+stime) * time.Second / clockTicks
}

// StormCPU is the CPU time spent since the service became ready.
func (s *Service) StormCPU() time.Duration { return s.CPU() - s.cpu0 }

// PeakRSS is the process's high-water resident set size, in bytes.
func (s *Service) PeakRSS() int64 { return peakRSS(s.cmd.Process.Pid) }

// HeapInUse reads the service's live heap from its pprof endpoint, after a garbage collection.
func (s *Service) HeapInUse() (int64, error) {
	resp, err := http.Get("http://" + s.Debug + "/debug/pprof/heap?debug=1&gc=1")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	var buf bytes.Buffer
	if _, err := buf.ReadFrom(resp.Body); err != nil {
		return 0, err
	}
	for line := range strings.SplitSeq(buf.String(), "\n") {
		if v, ok := strings.CutPrefix(line, "# HeapInuse = "); ok {
			return strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		}
	}
	return 0, errors.New("no HeapInuse in the heap profile")
}

// Log is what the service wrote.
func (s *Service) Log() string { return s.log.String() }

// Kill ends the service with SIGKILL, as a crash would.
func (s *Service) Kill() {
	if s.stopped {
		return
	}
	s.stopped = true
	s.cmd.Process.Kill()
	s.cmd.Wait()
}

// Agent is one storm agent's outcome.
type Agent struct {
	Name   string
	Start  time.Time
	Ticket time.Time // when Join returned with the ticket
	Err    error
	Disk   string
	Keys   [][]byte // every disk key the agent was given, in order
}

// Storm joins every instance at once with the join client and returns when all are done or ctx ends.
// Backoff and rnd set the agents' retry schedule.
func (h *Host) Storm(ctx context.Context, workers []metadata.Instance, bo backoff.Policy, rnd func() float64) []*Agent {
	var wg sync.WaitGroup
	agents := make([]*Agent, len(workers))
	for i, w := range workers {
		a := &Agent{Name: w.Name}
		agents[i] = a
		wg.Go(func() { h.join(ctx, i, w, a, bo, rnd) })
	}
	wg.Wait()
	return agents
}

func (h *Host) join(ctx context.Context, i int, w metadata.Instance, a *Agent, bo backoff.Policy, rnd func() float64) {
	dir := filepath.Join(h.dir, "agents", w.Name)
	disk := &keyRecorder{}
	a.Disk = newUUID()
	jc := joinclient.New(joinclient.Config{
		Metadata: h.Metadata(w.Addresses[0]),
		Prover:   h.provers[i%len(h.provers)],
		Disk:     disk,
		Lock:     &nodestate.Lock{},
		Kubeadm:  noKubeadm{},
		Paths: nodestate.Paths{State: filepath.Join(dir, "state"), KubernetesDir: filepath.Join(dir, "kubernetes"),
			KubeletDir: filepath.Join(dir, "kubelet")},
		PCRs: clustertest.QuotedPCRs, LocalAddr: w.Addresses[0], Backoff: bo, Rand: rnd,
	})
	a.Start = time.Now()
	_, a.Err = jc.Join(ctx, statedisk.Prepared{UUID: a.Disk, Fresh: true, InitialKey: make([]byte, 32)})
	a.Ticket = time.Now()
	a.Keys = disk.keys
}

// keyRecorder stands for the state disk: a storm measures tickets, not LUKS.
type keyRecorder struct{ keys [][]byte }

func (k *keyRecorder) SetKey(_ context.Context, _, key []byte) error {
	k.keys = append(k.keys, slices.Clone(key))
	return nil
}

// noKubeadm stands for kubeadm: a storm needs no kubelet.
type noKubeadm struct{}

func (noKubeadm) Init(context.Context, string, func(string)) error {
	return errors.New("storm agents do not init")
}
func (noKubeadm) Join(context.Context, string, func(string)) error { return nil }
func (noKubeadm) Reset(context.Context, func(string)) error {
	return errors.New("storm agents join fresh disks only")
}

// BootAgent boots one real `berth-agent boot` process as worker w, with tpm (its own, from h.EKCA), a LUKS2
// image as its state disk and a kubeadm that succeeds at once, and returns when the agent exits: the node
// has joined. It returns the process's peak RSS.
func (h *Host) BootAgent(ctx context.Context, w metadata.Instance, tpm *swtpmtest.TPM) (peakBytes int64, took time.Duration, err error) {
	dir := filepath.Join(h.dir, "processes", w.Name)
	img := filepath.Join(dir, "state.img")
	kubeadm := filepath.Join(dir, "kubeadm")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return 0, 0, err
	}
	if err := createStateImage(img); err != nil {
		return 0, 0, err
	}
	if err := os.WriteFile(kubeadm, []byte("#!/bin/sh\nexit 0\n"), 0o700); err != nil {
		return 0, 0, err
	}
	config, err := h.writeAgentConfig(dir, w.Addresses[0].String(), tpm.Device(), img, kubeadm, nil)
	if err != nil {
		return 0, 0, err
	}
	var out clustertest.SafeBuffer
	cmd := exec.CommandContext(ctx, h.agentBin, "boot", "--config", config)
	cmd.Stdout, cmd.Stderr = &out, &out
	start := time.Now()
	if err := cmd.Start(); err != nil {
		return 0, 0, err
	}
	// The process's own high-water mark, sampled until it exits: wait4's ru_maxrss would also count the
	// test process, whose memory the child shared between fork and exec.
	done := make(chan struct{})
	sampled := make(chan int64, 1)
	go func() {
		var peak int64
		for {
			peak = max(peak, peakRSS(cmd.Process.Pid))
			select {
			case <-done:
				sampled <- peak
				return
			case <-time.After(20 * time.Millisecond):
			}
		}
	}()
	err = cmd.Wait()
	close(done)
	peak := <-sampled
	if err != nil {
		return 0, 0, fmt.Errorf("berth-agent boot as %s: %w\n%s", w.Name, err, out.String())
	}
	return peak, time.Since(start), nil
}

// StartInitNode starts one real `berth-agent boot` process as the fresh control-plane node cp, with tpm, a
// LUKS2 image as its state disk and a kubeadm whose init leaves the storm's admin kubeconfig where kubeadm
// writes it, so that the node records its cluster in the storm's real API server. It returns when the node's
// init server listens at initAddr; the process is killed when the test ends.
func (h *Host) StartInitNode(ctx context.Context, cp metadata.Instance, tpm *swtpmtest.TPM, initAddr string) error {
	dir := filepath.Join(h.dir, "processes", cp.Name)
	img := filepath.Join(dir, "state.img")
	kubeadm := filepath.Join(dir, "kubeadm")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	if err := createStateImage(img); err != nil {
		return err
	}
	script := fmt.Sprintf("#!/bin/sh\nfor a in \"$@\"; do [ \"$a\" = init ] && cp %q %q; done\nexit 0\n",
		filepath.Join(h.dir, "admin.conf"), filepath.Join(dir, "kubernetes", "admin.conf"))
	if err := os.WriteFile(kubeadm, []byte(script), 0o700); err != nil {
		return err
	}
	config, err := h.writeAgentConfig(dir, cp.Addresses[0].String(), tpm.Device(), img, kubeadm, map[string]any{"initListen": initAddr})
	if err != nil {
		return err
	}
	out := &clustertest.SafeBuffer{}
	cmd := exec.CommandContext(ctx, h.agentBin, "boot", "--config", config)
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		return err
	}
	h.t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	for !strings.Contains(out.String(), `"msg":"init server listening"`) {
		if ctx.Err() != nil {
			return fmt.Errorf("the init server of %s did not listen: %w\n%s", cp.Name, ctx.Err(), out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	return nil
}

// createStateImage makes an empty 32 MiB file for a node's LUKS2 state disk.
func createStateImage(img string) error {
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		return err
	}
	return os.Truncate(img, 32<<20)
}

// writeAgentConfig writes a worker agent's configuration, with extra settings over the defaults.
func (h *Host) writeAgentConfig(dir, addr, tpm, img, kubeadm string, extra map[string]any) (string, error) {
	cfg := map[string]any{
		"metadataURL": h.MetaURL, "tpm": tpm, "stateDisk": img, "sourceAddress": addr, "kubeadm": kubeadm,
		"pcrs": clustertest.QuotedPCRs, "retryMax": "2s",
		"paths": map[string]string{"state": filepath.Join(dir, "state"), "kubernetesDir": filepath.Join(dir, "kubernetes"),
			"kubeletDir": filepath.Join(dir, "kubelet")},
	}
	maps.Copy(cfg, extra)
	data, err := yaml.Marshal(cfg)
	if err != nil {
		return "", err
	}
	path := filepath.Join(dir, "agent.yaml")
	return path, os.WriteFile(path, data, 0o600)
}

func peakRSS(pid int) int64 {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for line := range strings.SplitSeq(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb * 1024
		}
	}
	return 0
}

func newUUID() string {
	var b [16]byte
	rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	h := hex.EncodeToString(b[:])
	return h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}
