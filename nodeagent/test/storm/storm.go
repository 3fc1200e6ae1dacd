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
//
// A host made by NewEC2Host runs its join service as on EC2 (agent.yaml aws:): the control-plane node reads
// its own record from AWS's IMDS emulator (imdstest), and the service looks every connecting node up in a
// local EC2 endpoint (ec2test) and trusts a TPM only if its EK is the one EC2 reports for the instance. Every
// node is an instance there: each worker's loopback address is the private address of an instance of the
// workers' autoscaling group, whose EK is that of the TPM the worker uses; the TPMs have no EK certificate,
// as NitroTPMs. The agents read their own records from the metadata service in both modes.
package storm

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
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
	"sync/atomic"
	"testing"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/backoff"
	"github.com/berthlabs/berth/internal/cloud/aws/ec2instances"
	"github.com/berthlabs/berth/internal/cloud/aws/ec2instances/ec2test"
	"github.com/berthlabs/berth/internal/initsecret"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/repotest"
	"github.com/berthlabs/berth/nodeagent/internal/joinclient"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
	"github.com/berthlabs/berth/nodeagent/internal/statedisk"
	"github.com/berthlabs/berth/test/clustertest"
	"github.com/berthlabs/berth/test/imdstest"
	"github.com/berthlabs/berth/test/kubetest"
	"github.com/berthlabs/berth/test/swtpm/swtpmtest"
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
	// MetricsAddr is host:port of the join service's metrics and health endpoints (agent.yaml metricsListen).
	MetricsAddr string
	// AgentLog, if set, receives the storm agents' join client logs, JSON lines.
	AgentLog io.Writer

	// EC2 and IMDS are what a host of NewEC2Host's join service asks; nil otherwise.
	EC2  *ec2test.Server
	IMDS *imdstest.Server

	// agentsDir holds the storm agents' state directories.
	agentsDir string
	agentBin  string
	config    string
	provers   []*attest.Prover
	// poolEKs are the DER SubjectPublicKeyInfos of the provers' EKs, on EC2 hosts.
	poolEKs [][]byte

	mu      sync.Mutex
	workers int
	// proverOf is the pool TPM of each worker AddWorkers made, by name.
	proverOf map[string]int
	// instances are the EC2 instances of the nodes, by name, on EC2 hosts.
	instances map[string]ec2test.Instance
	service   *Service
}

// EC2 settings of an EC2 host: its VPC and image, and the autoscaling groups of its nodes.
const (
	ec2VPC            = "vpc-0b5e7c3a9d1f24e68"
	ec2Image          = "ami-0f1e2d3c4b5a69788"
	workerGroup       = "storm-workers"
	controlPlaneGroup = "storm-control-plane"
)

// NewHost starts kube-apiserver and etcd, the metadata service and a pool of tpms swtpm processes, and
// prepares the join service's node (secrets, CA, policy) without starting it.
func NewHost(t testing.TB, tpms int) *Host { return newHost(t, tpms, false) }

// NewEC2Host is NewHost for a join service on EC2: it also starts a local EC2 endpoint holding the
// control-plane node's instance, and AWS's IMDS emulator answering for that node; the pool's TPMs have no EK
// certificate, as NitroTPMs.
func NewEC2Host(t testing.TB, tpms int) *Host { return newHost(t, tpms, true) }

func newHost(t testing.TB, tpms int, onEC2 bool) *Host {
	t.Helper()
	h := &Host{t: t, dir: t.TempDir(), agentsDir: memoryDir(t), proverOf: map[string]int{}}
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
	h.MetricsAddr = fmt.Sprintf("127.0.0.1:%d", kubetest.FreePort(t))
	h.Cluster = clustertest.New(t, clustertest.Options{Name: "storm", JoinPort: port, KubernetesCA: h.API.CA, InitSecretHash: hash})
	h.agentBin = repotest.BuildBinary(t, "./nodeagent/cmd/berth-agent", "")
	if onEC2 {
		h.EC2 = ec2test.New(t)
		h.instances = map[string]ec2test.Instance{}
		h.poolEKs = make([][]byte, tpms)
	}

	var wg sync.WaitGroup
	h.provers = make([]*attest.Prover, tpms)
	errs := make([]error, tpms)
	for i := range tpms {
		tpm := h.NewTPM(t)
		wg.Go(func() {
			conn, err := attest.OpenTPM(tpm.Device())
			if err == nil && onEC2 {
				h.poolEKs[i], err = rsaEK(conn)
			}
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
	if onEC2 {
		h.startIMDS(port, hash)
	}
	h.writeServiceNode()
	return h
}

// memoryDir is a temporary directory in memory (/dev/shm) where there is one, else on disk. The storm
// agents write their credentials there: each write is synced, and on a disk a thousand agents' syncs cost
// the load side more CPU than the join service spends on their tickets, while a node syncs only its own.
func memoryDir(t testing.TB) string {
	dir, err := os.MkdirTemp("/dev/shm", "berth-storm-")
	if err != nil {
		return t.TempDir()
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// NewTPM starts a TPM of the kind the host's nodes have: manufactured under the host's EK CA, or on an EC2
// host without EK certificate, as a NitroTPM.
func (h *Host) NewTPM(t testing.TB) *swtpmtest.TPM {
	if h.EC2 != nil {
		return swtpmtest.NewTPMWithoutEKCertificate(t)
	}
	return h.EKCA.NewTPM(t)
}

// AddWorkers gives n more workers instance records, on loopback addresses from 127.1.0.1 up, and returns
// their names and addresses in order. Each uses a TPM of the pool, round-robin; on an EC2 host each is also
// an instance of the workers' autoscaling group whose EK is that TPM's.
func (h *Host) AddWorkers(n int) []metadata.Instance {
	h.mu.Lock()
	defer h.mu.Unlock()
	first := h.workers
	h.workers += n
	added := make([]metadata.Instance, n)
	var instances []ec2test.Instance
	for i := range n {
		k := first + i + 1
		addr := netip.AddrFrom4([4]byte{127, byte(1 + k/65536), byte(k / 256 % 256), byte(k % 256)})
		added[i] = metadata.Instance{Name: fmt.Sprintf("worker-%d", k), Role: metadata.RoleWorker, Addresses: []netip.Addr{addr}}
		h.proverOf[added[i].Name] = (k - 1) % len(h.provers)
		if h.EC2 != nil {
			inst := ec2Instance(k, added[i], workerGroup, h.poolEKs[(k-1)%len(h.provers)])
			h.instances[inst.PrivateDNSName] = inst
			instances = append(instances, inst)
		}
	}
	h.AddInstances(added...)
	if h.EC2 != nil {
		h.EC2.Put(instances...)
	}
	return added
}

// ec2Instance is node k's running EC2 instance (k = 0 for cp-0) in the host's VPC and autoscaling group,
// with the EK ek.
func ec2Instance(k int, rec metadata.Instance, group string, ek []byte) ec2test.Instance {
	return ec2test.Instance{
		ID: fmt.Sprintf("i-%017x", k), ImageID: ec2Image, VPCID: ec2VPC, PrivateDNSName: rec.Name,
		Interfaces: [][]netip.Addr{rec.Addresses}, Tags: map[string]string{ec2instances.GroupTag: group}, EK: ek,
	}
}

// startIMDS puts the control-plane node cp-0 into EC2 and serves its own record in AWS's IMDS emulator: its
// instance, and user-data naming the join endpoint and the autoscaling groups whose instances may join.
func (h *Host) startIMDS(port uint16, initSecretHash string) {
	t := h.t
	cp := metadata.Instance{Name: "cp-0", Role: metadata.RoleControlPlane, Addresses: []netip.Addr{clustertest.ServiceAddr}}
	inst := ec2Instance(0, cp, controlPlaneGroup, nil)
	h.instances[cp.Name] = inst
	h.EC2.Put(inst)
	userData, err := json.Marshal(metadata.UserData{
		ClusterName: "storm", JoinEndpoints: []string{h.JoinAddr}, JoinPort: port, JoinCAPin: pki.SPKIPin(h.JoinCA.Cert),
		InitSecretHash: initSecretHash, Role: metadata.RoleControlPlane,
		AutoscalingGroups: map[string]metadata.Role{workerGroup: metadata.RoleWorker, controlPlaneGroup: metadata.RoleControlPlane},
	})
	if err != nil {
		t.Fatal(err)
	}
	h.IMDS = imdstest.Start(t, imdstest.Config{InstanceID: inst.ID, LocalHostname: cp.Name,
		LocalIPv4: clustertest.ServiceAddr.String(), AMIID: ec2Image, UserData: userData})
}

// useTPM makes tpm worker w's, on an EC2 host: EC2 then reports its EK for w's instance.
func (h *Host) useTPM(w metadata.Instance, tpm *swtpmtest.TPM) error {
	if h.EC2 == nil {
		return nil
	}
	conn, err := attest.OpenTPM(tpm.Device())
	if err != nil {
		return err
	}
	ek, err := rsaEK(conn)
	conn.Close()
	if err != nil {
		return err
	}
	h.mu.Lock()
	inst, ok := h.instances[w.Name]
	if !ok {
		h.mu.Unlock()
		return fmt.Errorf("%s is no EC2 instance of this host's: make it with AddWorkers", w.Name)
	}
	inst.EK = ek
	h.instances[w.Name] = inst
	h.mu.Unlock()
	h.EC2.Put(inst)
	return nil
}

// rsaEK is the DER SubjectPublicKeyInfo of the EK attest.NewProver presents for tpm: its RSA one.
func rsaEK(tpm *attest.TPM) ([]byte, error) {
	eks, err := tpm.EKs()
	if err != nil {
		return nil, fmt.Errorf("reading endorsement keys: %w", err)
	}
	var pub *rsa.PublicKey
	for _, ek := range eks {
		if k, ok := ek.Public.(*rsa.PublicKey); ok && (pub == nil || ek.Certificate != nil) {
			pub = k
		}
	}
	if pub == nil {
		return nil, errors.New("the TPM has no RSA endorsement key")
	}
	return x509.MarshalPKIXPublicKey(pub)
}

// awsEnv is the environment of a join service on EC2: the SDK signs with made-up credentials, and nothing of
// the developer's AWS configuration, nor the real IMDS, is used.
func (h *Host) awsEnv() []string {
	env := slices.DeleteFunc(os.Environ(), func(kv string) bool { return strings.HasPrefix(kv, "AWS_") })
	none := filepath.Join(h.dir, "no-aws-config")
	return append(env, "AWS_ACCESS_KEY_ID=AKIASTORMBENCH000000", "AWS_SECRET_ACCESS_KEY=storm-bench",
		"AWS_EC2_METADATA_DISABLED=true", "AWS_CONFIG_FILE="+none, "AWS_SHARED_CREDENTIALS_FILE="+none)
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
		// The join service opens no disk, but its configuration is an agent's, which names one.
		"metadataURL": h.MetaURL, "stateDisk": filepath.Join(h.dir, "unused-state-disk"),
		"paths":         map[string]string{"state": paths.State, "kubernetesDir": paths.KubernetesDir, "kubeletDir": paths.KubeletDir},
		"sourceAddress": "127.0.0.1", "joinListenHost": "127.0.0.1",
		"ekCABundle": filepath.Join(h.dir, "ek-ca.pem"), "kubeconfig": filepath.Join(h.dir, "admin.conf"),
		"policyFile": filepath.Join(h.dir, "policy.yaml"), "metricsListen": h.MetricsAddr,
	}
	if h.EC2 != nil {
		// The autoscaling groups come from the node's user-data, as Terraform writes them.
		delete(cfg, "metadataURL")
		cfg["aws"] = map[string]any{"region": h.EC2.Region, "vpcID": ec2VPC, "imdsEndpoint": h.IMDS.URL, "ec2Endpoint": h.EC2.URL}
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
	Ready   time.Time // when it logged that it listens
	Debug   string    // its pprof address
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
	if h.EC2 != nil {
		s.cmd.Env = h.awsEnv()
	}
	s.cmd.Stdout, s.cmd.Stderr = s.log, s.log
	if err := s.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	h.mu.Lock()
	h.service = s
	h.mu.Unlock()
	t.Cleanup(func() { s.Kill() })
	deadline := time.Now().Add(30 * time.Second)
	for s.Ready.IsZero() {
		if time.Now().After(deadline) || s.cmd.ProcessState != nil {
			t.Fatalf("the join service did not start listening:\n%s", s.log.String())
		}
		time.Sleep(5 * time.Millisecond)
		s.Ready = listeningSince(s.log.String())
	}
	s.cpu0 = s.CPU()
	return s
}

// Pid is the process's id.
func (s *Service) Pid() int { return s.cmd.Process.Pid }

// listeningSince is the time of the join service's line saying it listens, zero before it is logged.
func listeningSince(log string) time.Time {
	for line := range strings.Lines(log) {
		var rec struct {
			Time time.Time `json:"time"`
			Msg  string    `json:"msg"`
		}
		if json.Unmarshal([]byte(line), &rec) == nil && rec.Msg == "join service listening" {
			return rec.Time
		}
	}
	return time.Time{}
}

// CPU is the process's user and system time so far.
func (s *Service) CPU() time.Duration {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", s.cmd.Process.Pid))
	if err != nil {
		return 0
	}
	_, _, fields, ok := parseStat(data)
	if !ok {
		return 0
	}
	return statCPU(fields)
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

	connected atomic.Int64 // Unix nanoseconds of the first TCP connection to the join service, 0 before
}

// Connected is when the agent's first TCP connection to the join service was established (zero if never):
// when its retries found a listening service, whatever the service then made it wait for.
func (a *Agent) Connected() time.Time {
	if ns := a.connected.Load(); ns != 0 {
		return time.Unix(0, ns)
	}
	return time.Time{}
}

// connectWatch is an agent's log handler: it notes when the join client first logs its connection to the
// join service, and passes records on to next, if any.
type connectWatch struct {
	agent *Agent
	next  slog.Handler
}

func (w connectWatch) Enabled(context.Context, slog.Level) bool { return true }

func (w connectWatch) Handle(ctx context.Context, r slog.Record) error {
	if r.Message == "connected to the join service" {
		w.agent.connected.CompareAndSwap(0, r.Time.UnixNano())
	}
	if w.next != nil && w.next.Enabled(ctx, r.Level) {
		return w.next.Handle(ctx, r)
	}
	return nil
}

func (w connectWatch) WithAttrs(attrs []slog.Attr) slog.Handler {
	if w.next != nil {
		w.next = w.next.WithAttrs(attrs)
	}
	return w
}

func (w connectWatch) WithGroup(name string) slog.Handler {
	if w.next != nil {
		w.next = w.next.WithGroup(name)
	}
	return w
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
	dir := filepath.Join(h.agentsDir, w.Name)
	disk := &keyRecorder{}
	a.Disk = newUUID()
	watch := connectWatch{agent: a}
	if h.AgentLog != nil {
		watch.next = slog.NewJSONHandler(h.AgentLog, nil)
	}
	log := slog.New(watch)
	jc := joinclient.New(joinclient.Config{
		Logger:   log,
		Metadata: h.Metadata(w.Addresses[0]),
		Prover:   h.prover(i, w),
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

// prover is the pool TPM of the i-th agent of a storm, w: the one AddWorkers gave it.
func (h *Host) prover(i int, w metadata.Instance) *attest.Prover {
	h.mu.Lock()
	defer h.mu.Unlock()
	if p, ok := h.proverOf[w.Name]; ok {
		return h.provers[p]
	}
	return h.provers[i%len(h.provers)]
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

// BootAgent boots one real `berth-agent boot` process as worker w, with tpm (its own, from h.NewTPM), a
// LUKS2 image as its state disk and a kubeadm that succeeds at once, and returns when the agent exits: the
// node has joined. It returns the process's peak RSS.
func (h *Host) BootAgent(ctx context.Context, w metadata.Instance, tpm *swtpmtest.TPM) (peakBytes int64, took time.Duration, err error) {
	if err := h.useTPM(w, tpm); err != nil {
		return 0, 0, err
	}
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
