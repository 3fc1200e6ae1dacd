// Package joinclient makes a booting node a cluster member without a human: it finds the join service from
// its own metadata, attests on the connection it asks on, and with the ticket sets its state-disk key,
// writes its credentials and runs kubeadm join. After a reboot it asks for a rejoin ticket to unlock the disk.
//
// Retries back off exponentially with full jitter from an immediate first try, so a thousand nodes that boot
// together neither wait out a fixed tick nor arrive in lockstep.
package joinclient

import (
	"context"
	"crypto/ecdsa"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/backoff"
	"github.com/berthlabs/berth/internal/kubeadm"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/rpc"
	"github.com/berthlabs/berth/nodeagent/internal/failpoint"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
	"github.com/berthlabs/berth/nodeagent/internal/statedisk"
)

// Prover makes TPM evidence (attest.Prover).
type Prover interface {
	Evidence(nonce []byte, pcrs []int) (*berthv1.Evidence, error)
	Activate(*berthv1.ActivationChallenge) ([]byte, error)
}

// Metadata is the node's view of its instance metadata (metadata.Client).
type Metadata interface {
	Self(ctx context.Context) (*metadata.Self, error)
	// ControlPlanes lists the control-plane instances, where join services may answer.
	ControlPlanes(ctx context.Context) ([]metadata.Instance, error)
}

// Disk is the state disk (statedisk.Disk).
type Disk interface {
	SetKey(ctx context.Context, initial, key []byte) error
}

// Kubeadm runs kubeadm join (kubeadm.Exec), and kubeadm reset before a join that an earlier boot began.
type Kubeadm interface {
	Join(ctx context.Context, configPath string, progress func(line string)) error
	Reset(ctx context.Context, progress func(line string)) error
}

// Locker is the node lock (nodestate.Lock).
type Locker interface {
	TryLock(owner string) bool
}

// DefaultPCRs are quoted unless configured otherwise: firmware, boot loader, UKI and command line. PCR 10
// is left out because IMA keeps extending it, so its value read after the quote may already differ.
var DefaultPCRs = []int{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 14, 15}

// Failpoints of a join, for fault tests that crash a failpoint build of the agent there.
const (
	FailpointAfterLock        = "join-after-lock"
	FailpointAfterCredentials = "join-after-credentials"
)

// UnlockPolicyFile, under Paths.State, is the join ticket's unlock policy: what the node may seal its disk
// key to, until the join service tells it more.
const UnlockPolicyFile = "unlock-policy.yaml"

// ErrLockTaken means the init server made this node a member first.
var ErrLockTaken = errors.New("node lock taken by the init server")

// Config wires a Client.
type Config struct {
	Metadata Metadata
	Prover   Prover
	Disk     Disk
	Lock     Locker
	Kubeadm  Kubeadm
	// KubeadmJoin holds this machine's kubeadm settings (phases, kubelet flags, CRI socket, Cloud.External,
	// for tickets that join without kubeadm too); the ticket fills in the rest, the node's record its
	// provider ID.
	KubeadmJoin kubeadm.JoinParams
	// Kubelet holds this machine's kubelet settings, for tickets that join without kubeadm.
	Kubelet kubeadm.KubeletSettings
	Paths   nodestate.Paths

	PCRs      []int
	LocalAddr netip.Addr // optional source address for outgoing connections
	Backoff   backoff.Policy
	// RequestTimeout bounds one attempt against one endpoint.
	RequestTimeout time.Duration
	Sleep          backoff.Sleeper
	Rand           func() float64
	Clock          func() time.Time
	Logger         *slog.Logger
}

// Client joins or rejoins one node.
type Client struct {
	cfg    Config
	mu     sync.Mutex
	cancel context.CancelFunc
}

// New fills in defaults.
func New(cfg Config) *Client {
	if len(cfg.PCRs) == 0 {
		cfg.PCRs = DefaultPCRs
	}
	if cfg.RequestTimeout == 0 {
		cfg.RequestTimeout = 30 * time.Second
	}
	if cfg.Sleep == nil {
		cfg.Sleep = backoff.Sleep
	}
	if cfg.Rand == nil {
		cfg.Rand = rand.Float64
	}
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return &Client{cfg: cfg}
}

// Stop makes a running Join or Rejoin return; it does not wait for it.
func (c *Client) Stop() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cancel != nil {
		c.cancel()
	}
}

func (c *Client) start(ctx context.Context) (context.Context, context.CancelFunc) {
	c.mu.Lock()
	defer c.mu.Unlock()
	ctx, cancel := context.WithCancel(ctx)
	c.cancel = cancel
	return ctx, cancel
}

// Join runs the whole first join of a node. disk is Fresh when it was just formatted; a disk that is not
// fresh was keyed on an earlier boot whose join never finished, and with the kubeadm method kubeadm's
// half-written files are cleared (kubeadm reset) before kubeadm join runs again.
func (c *Client) Join(ctx context.Context, disk statedisk.Prepared) (*nodestate.State, error) {
	ctx, cancel := c.start(ctx)
	defer cancel()
	self, err := c.self(ctx)
	if err != nil {
		return nil, err
	}
	log := c.cfg.Logger.With("node", self.Instance.Name, "role", string(self.Instance.Role))
	kubeletKey, csr, err := kubeletCSR(self.Instance)
	if err != nil {
		return nil, err
	}
	msg, err := c.request(ctx, log, self, "join ticket", berthv1.JoinServiceClient.IssueJoinTicket,
		func(ev *berthv1.Evidence) *berthv1.JoinClientMessage {
			return &berthv1.JoinClientMessage{Msg: &berthv1.JoinClientMessage_Join{Join: &berthv1.JoinRequest{
				Evidence: ev, DiskUuid: disk.UUID, KubeletCsr: csr, Role: string(self.Instance.Role), NodeName: self.Instance.Name,
			}}}
		}, func(m *berthv1.JoinServerMessage) bool { return m.GetJoinTicket() != nil })
	if err != nil {
		return nil, err
	}
	ticket := msg.GetJoinTicket()
	method := ticket.JoinMethod
	if method != berthv1.JoinMethod_JOIN_METHOD_KUBEADM && method != berthv1.JoinMethod_JOIN_METHOD_KUBELET {
		return nil, fmt.Errorf("join ticket's join method %v is not one this agent knows: is the join service newer than this image?", method)
	}
	attrs := []any{"cluster", ticket.ClusterId, "method", method.String()}
	if method == berthv1.JoinMethod_JOIN_METHOD_KUBEADM {
		attrs = append(attrs, "token_expires", time.Unix(ticket.BootstrapTokenExpiresUnix, 0).UTC())
	}
	log.Info("join ticket received", attrs...)
	// Before the node commits to the ticket (its lock, its disk key), it checks all of it.
	plan, err := planJoin(&c.cfg, self, ticket, kubeletKey, disk.UUID)
	if err != nil {
		return nil, fmt.Errorf("join ticket refused: %w", err)
	}

	if !c.cfg.Lock.TryLock(nodestate.OwnerJoin) {
		log.Info("init server took the node lock first; join stops")
		return nil, ErrLockTaken
	}
	failpoint.Crash(FailpointAfterLock)
	if err := c.cfg.Disk.SetKey(ctx, disk.InitialKey, plan.diskKey); err != nil {
		return nil, fmt.Errorf("setting state disk key: %w", err)
	}
	log.Info("state disk keyed", "disk", disk.UUID)
	kubeadmLog := func(line string) { log.Info("kubeadm", "line", line) }
	if !disk.Fresh && method == berthv1.JoinMethod_JOIN_METHOD_KUBEADM {
		log.Warn("an earlier boot began this join; resetting kubeadm before joining again")
		if err := c.cfg.Kubeadm.Reset(ctx, kubeadmLog); err != nil {
			return nil, fmt.Errorf("resetting an interrupted join: %w", err)
		}
	}
	if err := plan.write(&c.cfg); err != nil {
		return nil, err
	}
	failpoint.Crash(FailpointAfterCredentials)
	if plan.joinConfig != "" {
		if err := c.cfg.Kubeadm.Join(ctx, plan.joinConfig, kubeadmLog); err != nil {
			return nil, fmt.Errorf("kubeadm join: %w", err)
		}
	} else {
		log.Info("kubelet credentials and configuration written; the kubelet registers the node")
	}
	state := &nodestate.State{ClusterID: ticket.ClusterId, NodeName: ticket.NodeName, Role: string(self.Instance.Role),
		Via: nodestate.OwnerJoin, Since: c.cfg.Clock().UTC(), KubeletRenewal: method == berthv1.JoinMethod_JOIN_METHOD_KUBELET}
	if err := nodestate.Write(c.cfg.Paths.State, state); err != nil {
		return nil, err
	}
	log.Info("node joined", "cluster", state.ClusterID)
	return state, nil
}

// Rejoin fetches the key of a state disk that was keyed on an earlier boot.
func (c *Client) Rejoin(ctx context.Context, diskUUID string) (*berthv1.RejoinTicket, error) {
	ctx, cancel := c.start(ctx)
	defer cancel()
	self, err := c.self(ctx)
	if err != nil {
		return nil, err
	}
	log := c.cfg.Logger.With("node", self.Instance.Name, "role", string(self.Instance.Role))
	msg, err := c.request(ctx, log, self, "rejoin ticket", berthv1.JoinServiceClient.IssueRejoinTicket,
		func(ev *berthv1.Evidence) *berthv1.JoinClientMessage {
			return &berthv1.JoinClientMessage{Msg: &berthv1.JoinClientMessage_Rejoin{Rejoin: &berthv1.RejoinRequest{
				Evidence: ev, DiskUuid: diskUUID, Role: string(self.Instance.Role), NodeName: self.Instance.Name,
			}}}
		}, func(m *berthv1.JoinServerMessage) bool { return m.GetRejoinTicket() != nil })
	if err != nil {
		return nil, err
	}
	ticket := msg.GetRejoinTicket()
	log.Info("rejoin ticket received", "cluster", ticket.ClusterId)
	if err := checkRejoinTicket(ticket, self.Instance.Role); err != nil {
		return nil, fmt.Errorf("rejoin ticket refused: %w", err)
	}
	return ticket, nil
}

// RenewKubeletCertificate has the join service sign a new client certificate for the kubelet, on a new key,
// and puts both in the file the kubelet's kubeconfig names, which client-go reads again when it changes, so
// the kubelet takes the new certificate without a restart. It returns the new certificate.
func (c *Client) RenewKubeletCertificate(ctx context.Context, diskUUID string) (*x509.Certificate, error) {
	ctx, cancel := c.start(ctx)
	defer cancel()
	self, err := c.self(ctx)
	if err != nil {
		return nil, err
	}
	log := c.cfg.Logger.With("node", self.Instance.Name, "role", string(self.Instance.Role))
	key, csr, err := kubeletCSR(self.Instance)
	if err != nil {
		return nil, err
	}
	msg, err := c.request(ctx, log, self, "kubelet certificate", berthv1.JoinServiceClient.RenewKubeletCertificate,
		func(ev *berthv1.Evidence) *berthv1.JoinClientMessage {
			return &berthv1.JoinClientMessage{Msg: &berthv1.JoinClientMessage_Renew{Renew: &berthv1.RenewRequest{
				Evidence: ev, DiskUuid: diskUUID, KubeletCsr: csr, Role: string(self.Instance.Role), NodeName: self.Instance.Name,
			}}}
		}, func(m *berthv1.JoinServerMessage) bool { return m.GetRenewedCertificate() != nil })
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(msg.GetRenewedCertificate().KubeletCertificate)
	if err != nil {
		return nil, fmt.Errorf("renewed kubelet certificate: %w", err)
	}
	if err := checkRenewed(c.cfg.Paths, cert, key); err != nil {
		return nil, err
	}
	keyPEM, err := pki.EncodeKeyPEM(key)
	if err != nil {
		return nil, err
	}
	if err := nodestate.WriteFile(KubeletCertPath(c.cfg.Paths), append(pki.EncodeCertPEM(cert), keyPEM...), 0o600); err != nil {
		return nil, fmt.Errorf("writing the renewed kubelet certificate: %w", err)
	}
	log.Info("kubelet certificate renewed", "serial", cert.SerialNumber.Text(16), "not_after", cert.NotAfter.UTC())
	return cert, nil
}

// checkRenewed checks a renewed certificate as a ticket's: for this node's new key, and signed by the CA
// the kubelet already trusts (the one its join wrote).
func checkRenewed(p nodestate.Paths, cert *x509.Certificate, key *ecdsa.PrivateKey) error {
	caPEM, err := os.ReadFile(filepath.Join(p.PKIDir(), "ca.crt"))
	if err != nil {
		return fmt.Errorf("the cluster CA the join wrote: %w", err)
	}
	ca, err := pki.ParseCertPEM(caPEM)
	if err != nil {
		return fmt.Errorf("the cluster CA the join wrote: %w", err)
	}
	if err := cert.CheckSignatureFrom(ca); err != nil {
		return fmt.Errorf("the renewed kubelet certificate is not signed by the cluster CA: %w", err)
	}
	if !key.PublicKey.Equal(cert.PublicKey) {
		return errors.New("the renewed kubelet certificate is not for the key this node sent in its CSR")
	}
	return nil
}

func (c *Client) self(ctx context.Context) (*metadata.Self, error) {
	return metadata.WaitSelf(ctx, c.cfg.Metadata, c.cfg.Backoff, c.cfg.Sleep, c.cfg.Rand, c.cfg.Logger)
}

// endpoints are where join services may answer: the configured load balancers, then every control-plane
// instance. A source that fails is a warning; having no endpoint at all is the error.
func (c *Client) endpoints(ctx context.Context, log *slog.Logger, self *metadata.Self) ([]string, error) {
	eps := slices.Clone(self.UserData.JoinEndpoints)
	instances, err := c.cfg.Metadata.ControlPlanes(ctx)
	if err != nil {
		log.Warn("listing control-plane instances failed; using the configured endpoints only", "error", err)
	}
	port := strconv.Itoa(int(self.UserData.JoinPort))
	for _, in := range instances {
		if in.Role == metadata.RoleControlPlane && len(in.Addresses) > 0 && in.Name != self.Instance.Name {
			eps = append(eps, net.JoinHostPort(in.Addresses[0].String(), port))
		}
	}
	seen := make(map[string]bool, len(eps))
	eps = slices.DeleteFunc(eps, func(ep string) bool {
		dup := seen[ep]
		seen[ep] = true
		return dup
	})
	if len(eps) == 0 {
		return nil, errors.New("no join endpoint: user-data names no load balancer and metadata lists no other control-plane instance")
	}
	// Start at a random endpoint so that a storm of nodes spreads over the control plane.
	k := int(c.cfg.Rand() * float64(len(eps)))
	return append(eps[k:], eps[:k]...), nil
}

type opener func(berthv1.JoinServiceClient, context.Context, ...grpc.CallOption) (bidi, error)

// errNotListening marks a try whose connection was refused: nothing listens at the endpoint yet.
var errNotListening = errors.New("nothing listens there yet")

// notListeningLogEvery spaces the log lines of tries that no endpoint answered: they repeat every few hundred
// milliseconds while a control plane comes up, which can take minutes.
const notListeningLogEvery = 10 * time.Second

// request runs one kind of exchange against every endpoint once per attempt, until an answer that has what
// valid wants arrives. It backs off between attempts that an endpoint answered, and tries again soon when
// every endpoint refused the connection: a refusal costs a service that is not up yet nothing, and a node
// that waits for it should find it as soon as it listens.
func (c *Client) request(ctx context.Context, log *slog.Logger, self *metadata.Self, what string, open opener,
	build func(*berthv1.Evidence) *berthv1.JoinClientMessage, valid func(*berthv1.JoinServerMessage) bool) (*berthv1.JoinServerMessage, error) {
	tlsCfg, err := rpc.PinnedTLS(self.UserData.JoinCAPin, c.cfg.Clock)
	if err != nil {
		return nil, err
	}
	var answer *berthv1.JoinServerMessage
	var lastNotListening time.Time
	err = backoff.Retry(ctx, c.cfg.Backoff, c.cfg.Sleep, c.cfg.Rand, func(ctx context.Context) error {
		eps, err := c.endpoints(ctx, log, self)
		if err != nil {
			return err
		}
		type failure struct {
			endpoint string
			err      error
		}
		failures := make([]failure, 0, len(eps))
		listening := false
		for _, ep := range eps {
			msg, err := c.try(ctx, log, ep, tlsCfg, open, build)
			if err == nil && !valid(msg) {
				err = fmt.Errorf("join service answered without a %s", what)
			}
			if err == nil {
				answer = msg
				return nil
			}
			listening = listening || !errors.Is(err, errNotListening)
			failures = append(failures, failure{ep, err})
		}
		errs := make([]error, len(failures))
		for i, f := range failures {
			errs[i] = fmt.Errorf("%s: %w", f.endpoint, f.err)
			if listening {
				log.Warn("requesting "+what, "endpoint", f.endpoint, "error", f.err)
			}
		}
		if !listening {
			return backoff.Unanswered(errors.Join(errs...))
		}
		if d, ok := retryDelay(errs); ok {
			return backoff.After(errors.Join(errs...), d)
		}
		return errors.Join(errs...)
	}, func(attempt int, err error, next time.Duration) {
		if !backoff.IsUnanswered(err) {
			lastNotListening = time.Time{}
			log.Info("retrying "+what, "attempt", attempt, "retry_in", next.Round(time.Millisecond))
			return
		}
		if now := c.cfg.Clock(); now.Sub(lastNotListening) >= notListeningLogEvery {
			lastNotListening = now
			log.Info("no join service listens yet; trying again soon, without backing off", "attempt", attempt,
				"retry_in", next.Round(time.Millisecond), "error", err)
		}
	})
	if err != nil {
		return nil, fmt.Errorf("requesting %s: %w", what, err)
	}
	return answer, nil
}

// retryDelay is the longest wait a join service asked for in errs (google.rpc.RetryInfo), such as for a node
// held back until the control plane runs its Kubernetes release: asking sooner would cost the service a
// quote's verification for the same answer.
func retryDelay(errs []error) (time.Duration, bool) {
	var longest time.Duration
	found := false
	for _, err := range errs {
		st, ok := status.FromError(err)
		if !ok {
			continue
		}
		for _, d := range st.Details() {
			if ri, isRetry := d.(*errdetails.RetryInfo); isRetry && ri.GetRetryDelay().IsValid() {
				longest, found = max(longest, min(ri.GetRetryDelay().AsDuration(), maxRetryDelay)), true
			}
		}
	}
	return longest, found
}

// maxRetryDelay bounds what a join service may ask a node to wait: a hostile or broken service must not
// park a node for longer than a genuine one ever asks.
const maxRetryDelay = 5 * time.Minute

// try runs one exchange on a new connection to endpoint. Its error wraps errNotListening when the endpoint
// refused the connection.
func (c *Client) try(ctx context.Context, log *slog.Logger, endpoint string, tlsCfg *tls.Config, open opener, build func(*berthv1.Evidence) *berthv1.JoinClientMessage) (*berthv1.JoinServerMessage, error) {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.RequestTimeout)
	defer cancel()
	var refused atomic.Bool
	conn, err := grpc.NewClient(endpoint, rpc.ObservedDialOptions(tlsCfg, c.cfg.LocalAddr, func(err error) {
		if err == nil {
			log.Debug("connected to the join service", "endpoint", endpoint)
		}
		refused.Store(errors.Is(err, syscall.ECONNREFUSED))
	})...)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	client := berthv1.NewJoinServiceClient(conn)
	msg, err := c.exchange(ctx, func(ctx context.Context, opts ...grpc.CallOption) (bidi, error) {
		return open(client, ctx, opts...)
	}, build)
	if err != nil && refused.Load() {
		return nil, fmt.Errorf("%w: %w", errNotListening, err)
	}
	return msg, err
}

type bidi = grpc.BidiStreamingClient[berthv1.JoinClientMessage, berthv1.JoinServerMessage]

// exchange runs the attested request on a new stream: request with evidence, challenge, proof, ticket.
func (c *Client) exchange(ctx context.Context, open func(context.Context, ...grpc.CallOption) (bidi, error), request func(*berthv1.Evidence) *berthv1.JoinClientMessage) (*berthv1.JoinServerMessage, error) {
	st, err := open(ctx, grpc.WaitForReady(false))
	if err != nil {
		return nil, err
	}
	defer st.CloseSend()
	nonce, err := rpc.StreamNonce(st.Context())
	if err != nil {
		return nil, err
	}
	ev, err := c.cfg.Prover.Evidence(nonce, c.cfg.PCRs)
	if err != nil {
		return nil, fmt.Errorf("attesting: %w", err)
	}
	if err := st.Send(request(ev)); err != nil {
		return nil, recvErr(st, err)
	}
	msg, err := rpc.Recv(ctx, st)
	if err != nil {
		return nil, err
	}
	ch := msg.GetChallenge()
	if ch == nil {
		return nil, errors.New("join service answered without an activation challenge")
	}
	secret, err := c.cfg.Prover.Activate(ch)
	if err != nil {
		return nil, err
	}
	if err := st.Send(&berthv1.JoinClientMessage{Msg: &berthv1.JoinClientMessage_Proof{Proof: &berthv1.ActivationProof{Secret: secret}}}); err != nil {
		return nil, recvErr(st, err)
	}
	return rpc.Recv(ctx, st)
}

// recvErr turns io.EOF from Send, which gRPC returns when the server already ended the stream, into the
// server's status.
func recvErr(st bidi, err error) error {
	if _, rerr := st.Recv(); rerr != nil {
		return rerr
	}
	return err
}
