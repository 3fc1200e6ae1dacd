// Package initserver makes a fresh control-plane node the first node of a new cluster, once, for a client
// that has attested the node and proves that it holds the init secret.
//
// The client (internal/initclient) names the PCRs it wants; the node quotes them over the connection's
// TLS exporter value, proves its attestation key by credential activation, and only then receives the init
// request. Until the request's init secret has been checked against the hash in the node's user-data, the
// server answers nothing useful: it logs nothing, and every failure (a malformed message, a timeout, a TPM
// error, a wrong secret, no hash at all) ends the stream with the same "init refused", so that anyone who
// can reach the port learns nothing about the node, its TPM or its metadata.
//
// Nothing runs for a client that has not shown it holds the init secret: after its hello, the server sends
// the parameters and salt of the secret's hash and the client answers an HMAC of the connection's nonce
// keyed with the hash it computed (internal/initsecret, Proof), which the server checks with one HMAC. Only
// then does the exchange take the node's one exchange slot (a quote, an activation and 64 MiB of argon2id
// each). A stranger thus costs a connection for seconds and never the slot, so any number of strangers
// cannot delay a genuine init. The stream waits for the slot up to SlotWait and is then told "busy", which
// the client retries within its own timeout, and it loses the slot when any of its answers takes longer
// than ten seconds.
//
// After the secret, the server explains itself. The request is checked in full before the node lock is
// taken, since checking changes nothing and a typo should not cost the operator the node. Taking the lock
// commits the node: the join client stops, and every later init is refused, even if this one fails, since
// a failure from then on leaves the node half-initialized (its disk keyed, kubeadm perhaps half run), and
// such a node is replaced, not retried. From that point the work no longer depends on the client: kubeadm
// init runs to its end even if the client goes away, so that a dropped connection costs the result, not
// the control plane.
package initserver

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/clusterinfo"
	"github.com/berthlabs/berth/internal/initsecret"
	"github.com/berthlabs/berth/internal/keys"
	"github.com/berthlabs/berth/internal/kubeadm"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/podnetwork"
	"github.com/berthlabs/berth/internal/rpc"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
	"github.com/berthlabs/berth/nodeagent/internal/statedisk"
)

// Prover makes TPM evidence (attest.Prover).
type Prover interface {
	Evidence(nonce []byte, pcrs []int) (*berthv1.Evidence, error)
	Activate(*berthv1.ActivationChallenge) ([]byte, error)
}

// Locker is the node lock (nodestate.Lock).
type Locker interface {
	TryLock(owner string) bool
}

// Disk is the state disk (statedisk.Disk).
type Disk interface {
	SetKey(ctx context.Context, initial, key []byte) error
}

// Recorder writes what an init puts into the new cluster, with the admin kubeconfig kubeadm wrote: the
// cluster's record (clusterinfo) and its pod network (podnetwork.Install).
type Recorder interface {
	RecordCluster(ctx context.Context, info clusterinfo.Info) error
	InstallPodNetwork(ctx context.Context, plugin, podSubnet string) error
}

// Defaults of Config's bounds.
const (
	// DefaultTimeout bounds an exchange until the init request has arrived and its secret is checked:
	// a TPM quote and credential activation take well under a second even on slow vTPMs.
	DefaultTimeout = 2 * time.Minute
	// DefaultInitTimeout bounds the work after the node lock: keying the disk and kubeadm init, which
	// pulls images and waits for the control plane.
	DefaultInitTimeout = 10 * time.Minute
	// DefaultSlotWait is how long an exchange that said hello waits for the one init slot before it is
	// told "busy" (and its client retries).
	DefaultSlotWait = 10 * time.Second
)

// Files the server writes, relative to Paths.State.
const (
	KubeadmConfigFile = "kubeadm-init.yaml"
	JoinPolicyFile    = "join-policy.yaml"
)

// Config wires a Server. All fields but Timeout, InitTimeout, SlotWait, Clock and Logger are required.
type Config struct {
	Prover Prover
	Lock   Locker
	Disk   Disk
	// Prepared is the freshly formatted state disk: its UUID and the initial key that SetKey replaces.
	Prepared statedisk.Prepared
	// Self is the node's own instance record (a control-plane one) and user-data, which holds the
	// init secret's hash.
	Self    *metadata.Self
	Kubeadm kubeadm.Runner
	// Recorder writes the cluster's record and pod network into the new cluster before the client gets its
	// result.
	Recorder Recorder
	// KubeadmInit holds this machine's kubeadm settings (image repository, skipped phases, kubelet); the
	// server fills in the node, the request's cluster settings and the certificates directory.
	KubeadmInit kubeadm.InitParams
	Paths       nodestate.Paths

	// Timeout bounds an exchange until the init request arrives; DefaultTimeout if zero.
	Timeout time.Duration
	// InitTimeout bounds the work after the node lock, kubeadm init included; DefaultInitTimeout if zero.
	InitTimeout time.Duration
	// SlotWait is how long an exchange waits for the init slot; DefaultSlotWait if zero.
	SlotWait time.Duration
	Clock    func() time.Time
	Logger   *slog.Logger
	// Metrics, if set, counts the exchanges by result.
	Metrics Metrics
}

// Metrics counts init exchanges by result, one of Results.
type Metrics interface {
	InitExchange(result string, took time.Duration)
}

// Results of an init exchange, as Metrics counts them. Before the init secret is checked every failure is
// ResultRefused, as the client is told: the metrics, like the answers, tell nothing about a wrong secret
// that a malformed hello would not.
const (
	ResultInitialized = "initialized"
	ResultRefused     = "refused"
	ResultBusy        = "busy"            // another exchange held the init slot
	ResultInvalid     = "invalid_request" // the secret was right, the request was not
	ResultLocked      = "locked"          // the node is a member already, or joining
	ResultFailed      = "failed"          // the init failed after the node was committed
)

// Results are every result of an init exchange.
var Results = []string{ResultInitialized, ResultRefused, ResultBusy, ResultInvalid, ResultLocked, ResultFailed}

// Initialized is what a successful init made of the node.
type Initialized struct {
	State        *nodestate.State
	Secrets      *nodestate.ClusterSecrets
	KubernetesCA *pki.CA
}

// Server implements berthv1.InitServiceServer.
type Server struct {
	berthv1.UnimplementedInitServiceServer
	cfg  Config
	disk keys.Label
	// slot admits one Init at a time: an init secret check costs 64 MiB of argon2id, and two inits
	// must never race for the node.
	slot rpc.Slot
	done chan struct{}

	mu     sync.Mutex
	result *Initialized
}

// errRefused is every answer before the init secret has been checked.
var errRefused = status.Error(codes.PermissionDenied, "init refused")

// New checks cfg.
func New(cfg Config) (*Server, error) {
	switch {
	case cfg.Prover == nil, cfg.Lock == nil, cfg.Disk == nil, cfg.Kubeadm == nil, cfg.Recorder == nil, cfg.Self == nil:
		return nil, errors.New("init server: prover, lock, disk, kubeadm, recorder and own metadata are required")
	case !cfg.Prepared.Fresh || len(cfg.Prepared.InitialKey) == 0:
		return nil, errors.New("init server: the state disk is not fresh; a node that was keyed before cannot be initialized")
	case cfg.Self.Instance.Role != metadata.RoleControlPlane:
		return nil, fmt.Errorf("init server: the instance record says role %q; only a %s node can be initialized",
			cfg.Self.Instance.Role, metadata.RoleControlPlane)
	}
	if err := cfg.Self.Instance.Validate(); err != nil {
		return nil, fmt.Errorf("init server: %w", err)
	}
	disk, err := keys.DiskLabel(cfg.Prepared.UUID)
	if err != nil {
		return nil, fmt.Errorf("init server: state disk: %w", err)
	}
	for name, dir := range map[string]string{"state": cfg.Paths.State, "Kubernetes": cfg.Paths.KubernetesDir} {
		if !filepath.IsAbs(dir) || filepath.Clean(dir) != dir {
			return nil, fmt.Errorf("init server: %s directory %q is not a clean absolute path", name, dir)
		}
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.InitTimeout == 0 {
		cfg.InitTimeout = DefaultInitTimeout
	}
	if cfg.SlotWait == 0 {
		cfg.SlotWait = DefaultSlotWait
	}
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Metrics == nil {
		cfg.Metrics = noMetrics{}
	}
	if cfg.Self.UserData.InitSecretHash == "" {
		cfg.Logger.Warn("user-data holds no init secret hash: every init will be refused")
	}
	return &Server{cfg: cfg, disk: disk, slot: rpc.NewSlot(), done: make(chan struct{})}, nil
}

// ServerCredentials makes the init server's TLS certificate, on a new key held only in memory. Nobody can
// pin it, since the node has no cluster yet, and nobody needs to: clients accept any certificate and
// authenticate the node by attestation bound to the connection (see internal/initclient). Use it with
// rpc.ServerOptions.
func ServerCredentials() (tls.Certificate, error) {
	now := time.Now()
	// The CA signs this one certificate and its key is dropped on return. It outlives the leaf by a
	// margin because certificates keep whole seconds and now does not.
	ca, err := pki.NewCA("berth-init-server-ca", now, certValidity+time.Minute)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("init server certificate: %w", err)
	}
	key, err := pki.NewKey()
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("init server certificate: %w", err)
	}
	leaf, err := ca.IssueServer(key.Public(), []string{"berth-init"}, nil, now, certValidity)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("init server certificate: %w", err)
	}
	return tls.Certificate{Certificate: [][]byte{leaf.Raw, ca.Cert.Raw}, PrivateKey: key, Leaf: leaf}, nil
}

// portSlots bounds the connections served at once on the init port. Its servers run one exchange at a
// time, and a legitimate client (Terraform, an operator) needs a connection or two; the rest are room for
// strangers, whom the init server keeps for seconds before it refuses them (about 32 KiB each), so that
// dozens of stranger addresses do not make a genuine client wait for a connection.
const portSlots = 64

// Listen wraps the init port's listener inner in its limits: portSlots connections served at once, two per
// address, each serving one exchange of at most exchange (see docs/agent.md, Limits). The init and recovery
// servers use it.
func Listen(inner net.Listener, exchange time.Duration, log *slog.Logger) *rpc.AdmitListener {
	return rpc.Admit(inner, rpc.AdmitConfig{Slots: portSlots, Exchange: exchange, Logger: log})
}

// certValidity outlasts any wait for the init; clients do not check it.
const certValidity = 365 * 24 * time.Hour

// Done is closed once this server has initialized the node.
func (s *Server) Done() <-chan struct{} { return s.done }

// Result is what the init made; nil until Done is closed.
func (s *Server) Result() *Initialized {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.result
}

// Init runs one init exchange; see the package documentation.
func (s *Server) Init(st berthv1.InitService_InitServer) error {
	start := time.Now()
	outcome := ResultRefused
	defer func() { s.cfg.Metrics.InitExchange(outcome, time.Since(start)) }()
	ctx, cancel := context.WithTimeout(st.Context(), s.cfg.Timeout)
	defer cancel()
	// The slot is taken only by a stream that said hello at once and proved it holds the init secret: a
	// silent one or a stranger never holds it, and one that stalls later loses it after rpc.StepTimeout.
	hello, err := rpc.RecvWithin(ctx, st, rpc.FirstMessageTimeout)
	if err != nil || hello.GetHello() == nil {
		return errRefused
	}
	pcrs, err := attest.PCRIndexes(hello.GetHello().GetPcrs())
	if err != nil {
		return errRefused
	}
	if !s.admit(ctx, st) {
		return errRefused
	}
	if !s.slot.Take(ctx, s.cfg.SlotWait) {
		outcome = ResultBusy
		return rpc.ErrBusy
	}
	defer s.slot.Release()
	req := s.authenticate(ctx, st, pcrs)
	if req == nil {
		return errRefused
	}

	log := s.cfg.Logger
	if addr, err := rpc.PeerAddr(ctx); err == nil {
		log = log.With("peer", addr.String())
	}
	log.Info("init secret accepted")
	base := s.cfg.KubeadmInit
	base.CertificatesDir = s.cfg.Paths.PKIDir()
	checked, err := validateRequest(req, s.cfg.Self.Instance, s.cfg.Clock())
	var p *plan
	if err == nil {
		p, err = planInit(checked, s.cfg.Self.Instance, s.disk, base)
	}
	if err != nil {
		log.Warn("init request refused", "reason", err)
		outcome = ResultInvalid
		return status.Errorf(codes.InvalidArgument, "init request refused: %v", err)
	}
	if !s.cfg.Lock.TryLock(nodestate.OwnerInit) {
		log.Warn("init refused: the node lock is taken")
		outcome = ResultLocked
		return status.Error(codes.FailedPrecondition, "node is already a cluster member (or joining)")
	}
	log = log.With("cluster", p.record.ID)
	log.Info("node lock taken: initializing the cluster", "kubernetes_version", p.secrets.KubernetesVersion,
		"api_server_endpoint", p.apiEndpoint)

	work, cancelWork := context.WithTimeout(context.WithoutCancel(st.Context()), s.cfg.InitTimeout)
	defer cancelWork()
	out := &progress{st: st, log: log}
	res, kubeconfig, err := s.initialize(work, log, p, out.line)
	if err != nil {
		log.Error("init failed: the node is half-initialized and refuses every further init; replace it", "error", err)
		outcome = ResultFailed
		return status.Errorf(codes.Internal,
			"init failed after the node was committed: it is half-initialized and refuses every further init; replace it: %v", err)
	}
	result := &berthv1.InitResult{Kubeconfig: kubeconfig, ClusterId: p.record.ID, ApiServerEndpoint: p.apiEndpoint}
	if err := st.Send(&berthv1.InitServerMessage{Msg: &berthv1.InitServerMessage_Result{Result: result}}); err != nil {
		log.Warn("the node is initialized, but its result did not reach the client", "error", err)
	}
	s.mu.Lock()
	// The node lock admits one success; the check only keeps a faulty Locker from closing done twice.
	if s.result == nil {
		s.result = res
		close(s.done)
	}
	s.mu.Unlock()
	log.Info("cluster initialized", "node", res.State.NodeName)
	outcome = ResultInitialized
	return nil
}

// noMetrics counts nothing.
type noMetrics struct{}

func (noMetrics) InitExchange(string, time.Duration) {}

// admit runs the secret challenge and reports whether the client proved, over this connection, that it
// can compute the init secret's hash. Like authenticate, it neither logs nor tells why.
func (s *Server) admit(ctx context.Context, st berthv1.InitService_InitServer) bool {
	hash := s.cfg.Self.UserData.InitSecretHash
	params, keyLen, err := initsecret.Challenge(hash)
	if err != nil {
		return false
	}
	nonce, err := rpc.StreamNonce(ctx)
	if err != nil {
		return false
	}
	challenge := &berthv1.InitSecretChallenge{HashParameters: params, HashLength: uint32(keyLen)}
	if st.Send(&berthv1.InitServerMessage{Msg: &berthv1.InitServerMessage_SecretChallenge{SecretChallenge: challenge}}) != nil {
		return false
	}
	msg, err := rpc.RecvWithin(ctx, st, rpc.StepTimeout)
	if err != nil || msg.GetSecretProof() == nil {
		return false
	}
	ok, err := initsecret.CheckProof(hash, nonce, msg.GetSecretProof().GetMac())
	return err == nil && ok
}

// authenticate runs the exchange up to the init secret check and returns the request that passed it, or
// nil. It neither logs nor tells why: see the package documentation.
func (s *Server) authenticate(ctx context.Context, st berthv1.InitService_InitServer, pcrs []int) *berthv1.InitRequest {
	nonce, err := rpc.StreamNonce(ctx)
	if err != nil {
		return nil
	}
	ev, err := s.cfg.Prover.Evidence(nonce, pcrs)
	if err != nil {
		return nil
	}
	if st.Send(&berthv1.InitServerMessage{Msg: &berthv1.InitServerMessage_Evidence{Evidence: ev}}) != nil {
		return nil
	}
	msg, err := rpc.RecvWithin(ctx, st, rpc.StepTimeout)
	if err != nil || msg.GetChallenge() == nil {
		return nil
	}
	secret, err := s.cfg.Prover.Activate(msg.GetChallenge())
	if err != nil {
		return nil
	}
	if st.Send(&berthv1.InitServerMessage{Msg: &berthv1.InitServerMessage_Proof{Proof: &berthv1.ActivationProof{Secret: secret}}}) != nil {
		return nil
	}
	if msg, err = rpc.RecvWithin(ctx, st, rpc.StepTimeout); err != nil || msg.GetRequest() == nil {
		return nil
	}
	req := msg.GetRequest()
	hash := s.cfg.Self.UserData.InitSecretHash
	if hash == "" {
		return nil
	}
	if ok, err := initsecret.Verify(hash, req.InitSecret); err != nil || !ok {
		return nil
	}
	return req
}

// initialize applies p: it keys the disk, installs the Kubernetes CA where kubeadm takes it from, runs
// kubeadm init and records the membership. It returns the admin kubeconfig.
func (s *Server) initialize(ctx context.Context, log *slog.Logger, p *plan, progress func(string)) (*Initialized, []byte, error) {
	paths := s.cfg.Paths
	if err := s.cfg.Disk.SetKey(ctx, s.cfg.Prepared.InitialKey, p.diskKey); err != nil {
		return nil, nil, fmt.Errorf("setting the state disk key: %w", err)
	}
	log.Info("state disk keyed", "disk", s.cfg.Prepared.UUID)

	// kubeadm uses an existing ca.crt and ca.key instead of making a CA of its own, so the cluster's CA is
	// the one whose pin every node already has.
	if err := nodestate.WriteFile(filepath.Join(paths.PKIDir(), "ca.crt"), p.kubeCA.CertPEM(), 0o644); err != nil {
		return nil, nil, err
	}
	if err := nodestate.WriteFile(filepath.Join(paths.PKIDir(), "ca.key"), p.kubeCAKeyPEM, 0o600); err != nil {
		return nil, nil, err
	}
	configPath := filepath.Join(paths.State, KubeadmConfigFile)
	if err := nodestate.WriteFile(configPath, p.kubeadmConfig, 0o600); err != nil {
		return nil, nil, err
	}
	if err := s.cfg.Kubeadm.Init(ctx, configPath, progress); err != nil {
		return nil, nil, fmt.Errorf("kubeadm init: %w", err)
	}
	kubeconfig, err := os.ReadFile(filepath.Join(paths.KubernetesDir, "admin.conf"))
	if err != nil {
		return nil, nil, fmt.Errorf("reading the admin kubeconfig kubeadm wrote: %w", err)
	}
	if err := s.cfg.Recorder.RecordCluster(ctx, p.record); err != nil {
		return nil, nil, err
	}
	log.Info("cluster record published", "configmap", clusterinfo.Namespace+"/"+clusterinfo.Name)
	if p.podNetwork != podnetwork.None {
		progress("installing the pod network: " + p.podNetwork)
		if err := s.cfg.Recorder.InstallPodNetwork(ctx, p.podNetwork, p.podSubnet); err != nil {
			return nil, nil, err
		}
		log.Info("pod network installed", "plugin", p.podNetwork, "pod_subnet", p.podSubnet)
	}

	if err := nodestate.WriteSecrets(paths.State, p.secrets); err != nil {
		return nil, nil, err
	}
	if len(p.joinPolicy) > 0 {
		if err := nodestate.WriteFile(filepath.Join(paths.State, JoinPolicyFile), p.joinPolicy, 0o600); err != nil {
			return nil, nil, err
		}
	}
	// The membership record comes last: its presence means the node is complete.
	state := &nodestate.State{ClusterID: p.record.ID, NodeName: s.cfg.Self.Instance.Name,
		Role: string(metadata.RoleControlPlane), Via: nodestate.OwnerInit, Since: s.cfg.Clock().UTC()}
	if err := nodestate.Write(paths.State, state); err != nil {
		return nil, nil, err
	}
	return &Initialized{State: state, Secrets: p.secrets, KubernetesCA: p.kubeCA}, kubeconfig, nil
}

// progress passes kubeadm's lines to the log and the client. Once a send fails (the client went away),
// the lines go to the log only, and kubeadm carries on.
type progress struct {
	st      berthv1.InitService_InitServer
	log     *slog.Logger
	stopped bool
}

func (p *progress) line(l string) {
	p.log.Info("kubeadm", "line", l)
	if p.stopped {
		return
	}
	if err := p.st.Send(&berthv1.InitServerMessage{Msg: &berthv1.InitServerMessage_Progress{Progress: &berthv1.InitProgress{Line: l}}}); err != nil {
		p.stopped = true
		p.log.Warn("the client stopped receiving progress; init continues", "error", err)
	}
}
