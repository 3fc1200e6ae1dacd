// Package joinservice issues join and rejoin tickets to nodes that prove, on the very connection they ask
// on, that they run an image the join policy allows for the role their instance record gives them.
//
// Nothing is taken from the request on trust: the node's name, addresses and role come from the instance
// record looked up by the connecting address; its measurements come from a TPM quote bound to the TLS
// exporter of the connection; its TPM is proven by credential activation against a certified EK. Each
// attestation runs on its own goroutine with no lock shared between them.
package joinservice

import (
	"context"
	"crypto"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"runtime"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/instancecache"
	"github.com/berthlabs/berth/internal/keys"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/internal/rpc"
)

// InstanceLookup finds the instance record of a connecting address, from a source the node cannot write
// (the cloud's API, or the lab's metadata service).
type InstanceLookup interface {
	InstanceByAddress(ctx context.Context, addr netip.Addr) (*metadata.Instance, error)
}

// TokenIssuer creates short-lived kubeadm bootstrap tokens.
type TokenIssuer interface {
	// Issue creates a token for node that expires after ttl, and deletes node's earlier tokens: a node
	// joins with one, so asking again never leaves more than one behind.
	Issue(ctx context.Context, ttl time.Duration, node string) (token string, expires time.Time, err error)
}

// DiskRegistry remembers which TPM first received each disk's key.
type DiskRegistry interface {
	// Claim records ek as the owner of disk, the state disk of inst, or succeeds if ek owns it already;
	// ErrDiskOwnedByOther otherwise. A node has one state disk at a time: once disk is inst's, the records
	// of inst's earlier disks are removed, so a node that joins again with a fresh disk replaces its record
	// instead of adding one.
	Claim(ctx context.Context, disk, ek string, inst *metadata.Instance) error
	// Owner is the TPM that first received disk's key; ErrDiskUnknown if none did.
	Owner(ctx context.Context, disk string) (string, error)
}

// Errors of a DiskRegistry.
var (
	ErrDiskOwnedByOther = errors.New("disk is keyed to another TPM")
	ErrDiskUnknown      = errors.New("disk never joined")
)

// PolicySource hands out the current join policy.
type PolicySource interface {
	Load() *policy.Policy
}

// KubeletSigner signs the client certificate of a node's kubelet, after the service has attested the node
// and checked its CSR: CN system:node:<name>, O system:nodes, the node's addresses as IP SANs.
type KubeletSigner interface {
	SignKubelet(ctx context.Context, csr *x509.CertificateRequest, node string, ips []net.IP) (*x509.Certificate, error)
}

// Metrics counts what each exchange came to, for the operator's dashboards. Its label values come from the
// service's fixed lists (Calls, RefusalReasons, ErrorKinds), never from what a peer sent.
type Metrics interface {
	TicketIssued(call string, took time.Duration)
	TicketRefused(call, reason string, took time.Duration)
	ExchangeFailed(call, kind string, took time.Duration)
}

// Calls of the service, as Metrics names them.
const (
	CallJoin   = "join"
	CallRejoin = "rejoin"
	CallRenew  = "renew"
)

// Calls are every call of the service.
var Calls = []string{CallJoin, CallRejoin, CallRenew}

// Reasons the service refuses a node, as Metrics counts them.
const (
	RefusedConnection   = "connection"         // the connection carries no TLS exporter to bind a quote to
	RefusedRequest      = "request"            // the first message is not the call's request, or is malformed
	RefusedDiskID       = "disk_id"            // the disk id is not a UUID
	RefusedNoInstance   = "no_instance"        // no instance record at the connecting address
	RefusedAddress      = "address"            // the node names another instance than its address's
	RefusedRole         = "role"               // the node's role is not its record's, or not one this service joins
	RefusedAttestation  = "attestation"        // the quote, EK or credential activation failed
	RefusedMeasurements = "measurements"       // the policy allows no image with these PCRs for the role
	RefusedCSR          = "csr"                // the kubelet CSR does not name the instance
	RefusedDiskOwner    = "disk_owner"         // the disk is keyed to another TPM
	RefusedDiskUnknown  = "disk_unknown"       // a rejoin or renewal for a disk that never joined
	RefusedMethod       = "method"             // a renewal where kubelets rotate through the API server
	RefusedHeldBack     = "held_back"          // the image's Kubernetes is newer than an API server: the node waits
	RefusedVersion      = "kubernetes_version" // the version skew policy does not let the image's Kubernetes join
)

// RefusalReasons are every reason the service refuses a node.
var RefusalReasons = []string{RefusedConnection, RefusedRequest, RefusedDiskID, RefusedNoInstance, RefusedAddress,
	RefusedRole, RefusedAttestation, RefusedMeasurements, RefusedCSR, RefusedDiskOwner, RefusedDiskUnknown, RefusedMethod,
	RefusedHeldBack, RefusedVersion}

// Kinds of exchange that end without ticket or refusal, as Metrics counts them.
const (
	ErrorInternal = "internal" // the service failed (API server, signer): the node retries
	ErrorStream   = "stream"   // the stream ended: peer gone, timeout
)

// ErrorKinds are every kind of exchange error.
var ErrorKinds = []string{ErrorInternal, ErrorStream}

// Config is everything a Server needs; all fields but Method, Kubelet, Clock, Logger, Metrics, TokenTTL,
// Timeout, KubeletSigner, ControlPlaneFiles, KubernetesVersion, APIServers and HeldBackRetry are required,
// and Tokens is required for the kubeadm method only.
type Config struct {
	Verifier  *attest.Verifier
	Policy    PolicySource
	Instances InstanceLookup
	Tokens    TokenIssuer
	Disks     DiskRegistry

	// Method is how nodes join with the tickets: JOIN_METHOD_KUBEADM (the default) for clusters kubeadm
	// made, or JOIN_METHOD_KUBELET for an external control plane, whose nodes are all workers and get no
	// bootstrap token.
	Method berthv1.JoinMethod
	// Kubelet are the cluster's kubelet settings, sent with JOIN_METHOD_KUBELET tickets.
	Kubelet *berthv1.KubeletSettings

	// MasterSecret and Salt are the roots of every derived key.
	MasterSecret, Salt []byte
	// KubernetesCA is the cluster's CA: nodes get its certificate to trust the API server, and, unless
	// KubeletSigner is set, its key signs kubelet client certificates.
	KubernetesCA *pki.CA
	// KubeletSigner, if set, signs kubelet client certificates instead of KubernetesCA's key, such as a
	// CFSSL remote signer beside a control plane that keeps its CA key there (CFSSLSigner).
	KubeletSigner     KubeletSigner
	APIServerEndpoint string
	// KubernetesVersion is the release the cluster was set up with; it stands for the API servers' when
	// APIServers is not set or finds none.
	KubernetesVersion string
	// APIServers, if set, tells the releases the API servers run, which a joining node's image must suit.
	APIServers APIServerVersions
	// UpgradeTarget, if set, tells the release of an instructed upgrade, whose control-plane nodes join
	// ahead of the API servers.
	UpgradeTarget UpgradeTarget
	// HeldBackRetry is how long a node held back for its Kubernetes release is asked to wait before it
	// asks again; DefaultHeldBackRetry if zero.
	HeldBackRetry time.Duration
	// ControlPlaneFiles returns the files a joining control-plane node needs (CA and service-account keys).
	ControlPlaneFiles func() ([]*berthv1.File, error)
	// JoinCA, when set, goes with the master secret to joining control-plane nodes, so that they serve
	// joins too.
	JoinCA *pki.CA

	// TokenTTL is the bootstrap token's lifetime: minutes, since it is issued with the ticket.
	TokenTTL time.Duration
	// Timeout bounds one whole exchange, slow TPMs included.
	Timeout time.Duration
	// Workers bounds the exchanges working at once (verifying evidence; checking the proof, signing and
	// writing the ticket's records); DefaultWorkers if zero. An exchange waiting for its node's next message
	// holds none, so a peer that keeps its exchange slow costs a connection, not the CPU genuine nodes need.
	Workers int
	Clock   func() time.Time
	Logger  *slog.Logger
	// Metrics, if set, counts the exchanges.
	Metrics Metrics
}

// DefaultWorkers is Config.Workers when zero: the work is mostly CPU, with an API server round trip or two
// per ticket, so a few per CPU keep the CPUs busy.
func DefaultWorkers() int { return 4 * runtime.GOMAXPROCS(0) }

// Server implements berthv1.JoinServiceServer.
type Server struct {
	berthv1.UnimplementedJoinServiceServer
	cfg       Config
	workers   chan struct{}
	clusterID string
	caPins    []string
	// signsWithCA: the service signs kubelet certificates with the Kubernetes CA's own key, checked at New
	// to be the certificate's, so what it signs needs no check against the CA afterwards.
	signsWithCA bool
}

// New checks cfg and derives what every ticket shares.
func New(cfg Config) (*Server, error) {
	switch cfg.Method {
	case berthv1.JoinMethod_JOIN_METHOD_UNSPECIFIED:
		cfg.Method = berthv1.JoinMethod_JOIN_METHOD_KUBEADM
	case berthv1.JoinMethod_JOIN_METHOD_KUBEADM, berthv1.JoinMethod_JOIN_METHOD_KUBELET:
	default:
		return nil, fmt.Errorf("join service: unknown join method %v", cfg.Method)
	}
	var missing []string
	for _, dep := range []struct {
		name string
		ok   bool
	}{
		{"verifier", cfg.Verifier != nil}, {"policy", cfg.Policy != nil}, {"instances", cfg.Instances != nil},
		{"tokens", cfg.Tokens != nil || cfg.Method == berthv1.JoinMethod_JOIN_METHOD_KUBELET},
		{"disks", cfg.Disks != nil}, {"Kubernetes CA", cfg.KubernetesCA != nil},
		{"API server endpoint", cfg.APIServerEndpoint != ""},
	} {
		if !dep.ok {
			missing = append(missing, dep.name)
		}
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("join service: %s is required", strings.Join(missing, ", "))
	}
	if cfg.TokenTTL == 0 {
		cfg.TokenTTL = 10 * time.Minute
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.HeldBackRetry == 0 {
		cfg.HeldBackRetry = DefaultHeldBackRetry
	}
	if cfg.Workers <= 0 {
		cfg.Workers = DefaultWorkers()
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
	signsWithCA := cfg.KubeletSigner == nil
	if signsWithCA {
		if cfg.KubernetesCA.Key == nil {
			return nil, errors.New("join service: the Kubernetes CA has no key and no kubelet signer is configured")
		}
		pub, ok := cfg.KubernetesCA.Key.Public().(interface{ Equal(crypto.PublicKey) bool })
		if !ok || !pub.Equal(cfg.KubernetesCA.Cert.PublicKey) {
			return nil, errors.New("join service: the Kubernetes CA's key is not the one its certificate names")
		}
		cfg.KubeletSigner = caSigner{ca: cfg.KubernetesCA, clock: cfg.Clock}
	}
	// Admission and attestation both look up the connecting address, and a storm asks about each many
	// times: the cache answers from memory for a few seconds.
	cfg.Instances = instancecache.New(instancecache.Config{Lookup: cfg.Instances})
	id, err := keys.ClusterIDOf(cfg.MasterSecret, cfg.Salt)
	if err != nil {
		return nil, fmt.Errorf("join service: %w", err)
	}
	return &Server{cfg: cfg, workers: make(chan struct{}, cfg.Workers), clusterID: id,
		caPins: []string{pki.SPKIPin(cfg.KubernetesCA.Cert)}, signsWithCA: signsWithCA}, nil
}

// exchange is what one attested request established.
type exchange struct {
	instance *metadata.Instance
	image    string
	// kubernetesVersion is the release the matched policy image carries; empty when the policy does not say.
	kubernetesVersion string
	ek                string
	disk              keys.Label
	diskUUID          string
	log               *slog.Logger
	// release frees the worker the exchange holds from its activation proof on; the call's handler
	// releases it when it returns.
	release func()
}

// work waits for a worker; the caller calls the release it returns once its work is done.
func (s *Server) work(ctx context.Context) (release func(), err error) {
	select {
	case s.workers <- struct{}{}:
		return func() { <-s.workers }, nil
	case <-ctx.Done():
		return nil, status.FromContextError(ctx.Err()).Err()
	}
}

type stream = berthv1.JoinService_IssueJoinTicketServer

// IssueJoinTicket attests a new node and hands it everything to join.
func (s *Server) IssueJoinTicket(st berthv1.JoinService_IssueJoinTicketServer) (err error) {
	defer s.observe(CallJoin, time.Now(), &err)
	ctx, cancel := context.WithTimeout(st.Context(), s.cfg.Timeout)
	defer cancel()
	var csr *x509.CertificateRequest
	ex, err := s.attest(ctx, st, func(m *berthv1.JoinClientMessage) (claim, error) {
		req := m.GetJoin()
		if req == nil {
			return claim{}, status.Error(codes.InvalidArgument, "first message must be a join request")
		}
		var err error
		if csr, err = parseCSR(req.KubeletCsr); err != nil {
			return claim{}, status.Error(codes.InvalidArgument, err.Error())
		}
		return claim{req.Evidence, req.DiskUuid, req.Role, req.NodeName}, nil
	})
	if err != nil {
		return err
	}
	defer ex.release()
	if err := checkCSR(csr, ex.instance); err != nil {
		return s.refuse(ex.log, RefusedCSR, codes.PermissionDenied, "kubelet CSR refused", err)
	}
	if s.cfg.Method == berthv1.JoinMethod_JOIN_METHOD_KUBELET && ex.instance.Role != metadata.RoleWorker {
		return s.refuse(ex.log, RefusedRole, codes.PermissionDenied, "role refused",
			fmt.Errorf("this join service joins workers to an external control plane; the instance record says %q", ex.instance.Role))
	}
	if err := s.checkVersion(ctx, ex); err != nil {
		return err
	}
	switch err := s.cfg.Disks.Claim(ctx, ex.diskUUID, ex.ek, ex.instance); {
	case errors.Is(err, ErrDiskOwnedByOther):
		return s.refuse(ex.log, RefusedDiskOwner, codes.PermissionDenied, "disk refused", err)
	case err != nil:
		return s.fail(ex.log, "recording disk owner", err)
	}
	ticket, err := s.joinTicket(ctx, ex, csr)
	if err != nil {
		return s.fail(ex.log, "issuing join ticket", err)
	}
	if err := st.Send(&berthv1.JoinServerMessage{Msg: &berthv1.JoinServerMessage_JoinTicket{JoinTicket: ticket}}); err != nil {
		return err
	}
	attrs := []any{"method", ticket.JoinMethod.String(), "control_plane_files", len(ticket.ControlPlaneFiles), "cluster_secrets", ticket.ClusterSecrets != nil}
	if ticket.BootstrapToken != "" {
		attrs = append(attrs, "token_expires", time.Unix(ticket.BootstrapTokenExpiresUnix, 0).UTC())
	}
	ex.log.Info("join ticket issued", attrs...)
	return nil
}

// IssueRejoinTicket gives a node that joined before the key to its state disk, if the disk was first keyed
// to the TPM that asks.
func (s *Server) IssueRejoinTicket(st berthv1.JoinService_IssueRejoinTicketServer) (err error) {
	defer s.observe(CallRejoin, time.Now(), &err)
	ctx, cancel := context.WithTimeout(st.Context(), s.cfg.Timeout)
	defer cancel()
	ex, err := s.attest(ctx, st, func(m *berthv1.JoinClientMessage) (claim, error) {
		req := m.GetRejoin()
		if req == nil {
			return claim{}, status.Error(codes.InvalidArgument, "first message must be a rejoin request")
		}
		return claim{req.Evidence, req.DiskUuid, req.Role, req.NodeName}, nil
	})
	if err != nil {
		return err
	}
	defer ex.release()
	if err := s.checkOwner(ctx, ex, "rejoin refused"); err != nil {
		return err
	}
	diskKey, measurement, err := s.nodeKeys(ex.disk)
	if err != nil {
		return s.fail(ex.log, "deriving keys", err)
	}
	unlock, err := s.unlockPolicy(ex.instance.Role)
	if err != nil {
		return s.fail(ex.log, "writing the unlock policy", err)
	}
	ticket := &berthv1.RejoinTicket{ClusterId: s.clusterID, DiskKey: diskKey, MeasurementSecret: measurement, UnlockPolicy: unlock}
	if err := st.Send(&berthv1.JoinServerMessage{Msg: &berthv1.JoinServerMessage_RejoinTicket{RejoinTicket: ticket}}); err != nil {
		return err
	}
	ex.log.Info("rejoin ticket issued")
	return nil
}

// RenewKubeletCertificate signs a new kubelet client certificate for a node that joined with a kubelet-method
// ticket, after the checks of a rejoin (its TPM owns its disk) and of a join (the CSR names the instance).
func (s *Server) RenewKubeletCertificate(st berthv1.JoinService_RenewKubeletCertificateServer) (err error) {
	defer s.observe(CallRenew, time.Now(), &err)
	ctx, cancel := context.WithTimeout(st.Context(), s.cfg.Timeout)
	defer cancel()
	var csr *x509.CertificateRequest
	ex, err := s.attest(ctx, st, func(m *berthv1.JoinClientMessage) (claim, error) {
		req := m.GetRenew()
		if req == nil {
			return claim{}, status.Error(codes.InvalidArgument, "first message must be a renewal request")
		}
		var err error
		if csr, err = parseCSR(req.KubeletCsr); err != nil {
			return claim{}, status.Error(codes.InvalidArgument, err.Error())
		}
		return claim{req.Evidence, req.DiskUuid, req.Role, req.NodeName}, nil
	})
	if err != nil {
		return err
	}
	defer ex.release()
	if s.cfg.Method != berthv1.JoinMethod_JOIN_METHOD_KUBELET {
		return s.refuse(ex.log, RefusedMethod, codes.FailedPrecondition, "renewal refused",
			errors.New("this cluster's kubelets rotate their certificates through the API server"))
	}
	if err := s.checkOwner(ctx, ex, "renewal refused"); err != nil {
		return err
	}
	if err := checkCSR(csr, ex.instance); err != nil {
		return s.refuse(ex.log, RefusedCSR, codes.PermissionDenied, "kubelet CSR refused", err)
	}
	cert, err := s.signKubelet(ctx, ex, csr)
	if err != nil {
		return s.fail(ex.log, "renewing kubelet certificate", err)
	}
	if err := st.Send(&berthv1.JoinServerMessage{Msg: &berthv1.JoinServerMessage_RenewedCertificate{
		RenewedCertificate: &berthv1.RenewedCertificate{KubeletCertificate: cert.Raw}}}); err != nil {
		return err
	}
	ex.log.Info("kubelet certificate renewed", "kubelet_cert_serial", cert.SerialNumber.Text(16), "not_after", cert.NotAfter.UTC())
	return nil
}

// checkOwner refuses, with summary, a node whose TPM is not the one that first received its disk's key.
func (s *Server) checkOwner(ctx context.Context, ex *exchange, summary string) error {
	owner, err := s.cfg.Disks.Owner(ctx, ex.diskUUID)
	switch {
	case errors.Is(err, ErrDiskUnknown):
		return s.refuse(ex.log, RefusedDiskUnknown, codes.FailedPrecondition, summary, err)
	case err != nil:
		return s.fail(ex.log, "looking up disk owner", err)
	case owner != ex.ek:
		return s.refuse(ex.log, RefusedDiskOwner, codes.PermissionDenied, summary, ErrDiskOwnedByOther)
	}
	return nil
}

// claim is what a request says: its evidence and disk, and who the node believes it is. The role and name
// grant nothing; they must match the instance record.
type claim struct {
	evidence       *berthv1.Evidence
	diskUUID       string
	role, nodeName string
}

// attest runs the part all calls share: read the request, find the instance, verify the evidence for
// this connection, challenge the attestation key, and check the policy for the instance's role. Each
// message of the node has its own deadline, and a worker is held only while the service computes: the
// exchange it returns holds one, for the rest of the call.
func (s *Server) attest(ctx context.Context, st stream, first func(*berthv1.JoinClientMessage) (claim, error)) (_ *exchange, err error) {
	log := s.cfg.Logger
	addr, err := rpc.PeerAddr(ctx)
	if err != nil {
		return nil, s.fail(log, "reading peer address", err)
	}
	log = log.With("peer", addr.String())
	nonce, err := rpc.StreamNonce(ctx)
	if err != nil {
		return nil, s.refuse(log, RefusedConnection, codes.FailedPrecondition, "connection refused", err)
	}
	msg, err := rpc.RecvWithin(ctx, st, rpc.FirstMessageTimeout)
	if err != nil {
		return nil, s.streamErr(log, "receiving request", err)
	}
	c, err := first(msg)
	if err != nil {
		log.Warn("request refused", "reason", err)
		return nil, &refusal{reason: RefusedRequest, st: status.Convert(err)}
	}
	disk, err := keys.DiskLabel(c.diskUUID)
	if err != nil {
		return nil, s.refuse(log, RefusedDiskID, codes.InvalidArgument, "disk id refused", err)
	}
	inst, err := s.cfg.Instances.InstanceByAddress(ctx, addr)
	switch {
	case errors.Is(err, metadata.ErrNotFound):
		return nil, s.refuse(log, RefusedNoInstance, codes.PermissionDenied, "no instance record for this address", err)
	case err != nil:
		return nil, s.fail(log, "looking up instance record", err)
	}
	log = log.With("peer_node", inst.Name, "peer_role", string(inst.Role))
	if c.nodeName != inst.Name {
		return nil, s.refuse(log, RefusedAddress, codes.PermissionDenied, "address refused", fmt.Errorf(
			"the connection comes from the address of instance %q, but the node says it is %q: a load balancer in front of the join service must pass the nodes' own source addresses on (docs/agent.md, Limits)",
			inst.Name, c.nodeName))
	}
	if metadata.Role(c.role) != inst.Role {
		return nil, s.refuse(log, RefusedRole, codes.PermissionDenied, "role refused",
			fmt.Errorf("node asked as %q but its instance record says %q", c.role, inst.Role))
	}

	release, err := s.work(ctx)
	if err != nil {
		return nil, s.streamErr(log, "waiting for a worker", err)
	}
	pending, err := s.cfg.Verifier.Verify(ctx, c.evidence, nonce, inst.ID)
	release()
	if err != nil {
		return nil, s.attestErr(log, err)
	}
	if err := st.Send(&berthv1.JoinServerMessage{Msg: &berthv1.JoinServerMessage_Challenge{Challenge: pending.Challenge}}); err != nil {
		return nil, err
	}
	msg, err = rpc.RecvWithin(ctx, st, rpc.StepTimeout)
	if err != nil {
		return nil, s.streamErr(log, "receiving activation proof", err)
	}
	if release, err = s.work(ctx); err != nil {
		return nil, s.streamErr(log, "waiting for a worker", err)
	}
	defer func() {
		if err != nil {
			release()
		}
	}()
	result, err := pending.Complete(msg.GetProof())
	if err != nil {
		return nil, s.attestErr(log, err)
	}
	log = log.With("ek", result.EKFingerprint[:16])
	if log.Enabled(ctx, slog.LevelDebug) {
		log.Debug("quote verified", "pcrs", hexPCRs(result.PCRs))
	}
	image, err := s.cfg.Policy.Load().Check(inst.Role, result.PCRs, s.cfg.Clock())
	if err != nil {
		return nil, s.refuse(log, RefusedMeasurements, codes.PermissionDenied, "measurements refused", err)
	}
	return &exchange{instance: inst, image: image.Name, kubernetesVersion: image.KubernetesVersion, ek: result.EKFingerprint,
		disk: disk, diskUUID: c.diskUUID, log: log.With("image", image.Name, "disk", c.diskUUID), release: release}, nil
}

func (s *Server) joinTicket(ctx context.Context, ex *exchange, csr *x509.CertificateRequest) (*berthv1.JoinTicket, error) {
	diskKey, measurement, err := s.nodeKeys(ex.disk)
	if err != nil {
		return nil, err
	}
	cert, err := s.signKubelet(ctx, ex, csr)
	if err != nil {
		return nil, err
	}
	var files []*berthv1.File
	var secrets *berthv1.ClusterSecrets
	if ex.instance.Role == metadata.RoleControlPlane {
		if s.cfg.ControlPlaneFiles != nil {
			if files, err = s.cfg.ControlPlaneFiles(); err != nil {
				return nil, fmt.Errorf("reading control-plane files: %w", err)
			}
		}
		if s.cfg.JoinCA != nil {
			key, err := s.cfg.JoinCA.KeyPEM()
			if err != nil {
				return nil, err
			}
			secrets = &berthv1.ClusterSecrets{MasterSecret: s.cfg.MasterSecret, Salt: s.cfg.Salt,
				JoinCaCertificate: s.cfg.JoinCA.CertPEM(), JoinCaKey: key}
		}
	}
	unlock, err := s.unlockPolicy(ex.instance.Role)
	if err != nil {
		return nil, fmt.Errorf("writing the unlock policy: %w", err)
	}
	ex.log = ex.log.With("kubelet_cert_serial", cert.SerialNumber.Text(16))
	ticket := &berthv1.JoinTicket{
		UnlockPolicy:            unlock,
		NodeName:                ex.instance.Name,
		ClusterId:               s.clusterID,
		DiskKey:                 diskKey,
		MeasurementSecret:       measurement,
		ApiServerEndpoint:       s.cfg.APIServerEndpoint,
		KubeletCertificate:      cert.Raw,
		KubernetesCaCertificate: s.cfg.KubernetesCA.Cert.Raw,
		KubernetesVersion:       s.cfg.KubernetesVersion,
		ControlPlaneFiles:       files,
		ClusterSecrets:          secrets,
		JoinMethod:              s.cfg.Method,
	}
	if s.cfg.Method == berthv1.JoinMethod_JOIN_METHOD_KUBELET {
		ticket.KubeletSettings = s.cfg.Kubelet
		return ticket, nil
	}
	// The token is made last so that no failure above leaves one behind unused.
	token, expires, err := s.cfg.Tokens.Issue(ctx, s.cfg.TokenTTL, ex.instance.Name)
	if err != nil {
		return nil, fmt.Errorf("creating bootstrap token: %w", err)
	}
	ticket.BootstrapToken, ticket.BootstrapTokenExpiresUnix, ticket.DiscoveryCaCertHashes = token, expires.Unix(), s.caPins
	return ticket, nil
}

// signKubelet has the signer sign a checked CSR for the exchange's node.
func (s *Server) signKubelet(ctx context.Context, ex *exchange, csr *x509.CertificateRequest) (*x509.Certificate, error) {
	cert, err := s.cfg.KubeletSigner.SignKubelet(ctx, csr, ex.instance.Name, ipsOf(ex.instance.Addresses))
	if err != nil {
		return nil, fmt.Errorf("signing kubelet certificate: %w", err)
	}
	if s.signsWithCA {
		return cert, nil
	}
	// Nodes trust the API server and present this certificate by the one CA the ticket names; a remote
	// signer with another CA would fail every node after it took its ticket.
	if err := cert.CheckSignatureFrom(s.cfg.KubernetesCA.Cert); err != nil {
		return nil, fmt.Errorf("the kubelet certificate is not signed by the Kubernetes CA %q (its issuer is %q): the signer must sign with the cluster CA: %w",
			s.cfg.KubernetesCA.Cert.Subject.String(), cert.Issuer.String(), err)
	}
	return cert, nil
}

// unlockPolicy is the policy cut to what a node of role may seal its disk key to.
func (s *Server) unlockPolicy(role metadata.Role) ([]byte, error) {
	return s.cfg.Policy.Load().ForRole(role, s.cfg.Clock()).Marshal()
}

func (s *Server) nodeKeys(disk keys.Label) (diskKey, measurement []byte, err error) {
	if diskKey, err = keys.Derive(s.cfg.MasterSecret, s.cfg.Salt, disk, keys.DiskKeySize); err != nil {
		return nil, nil, err
	}
	if measurement, err = keys.Derive(s.cfg.MasterSecret, s.cfg.Salt, keys.MeasurementSecret, 32); err != nil {
		return nil, nil, err
	}
	return diskKey, measurement, nil
}

// refuse tells the operator the whole reason and the node what it may know: the summary and the reason,
// which never contains a secret (measurements, names and addresses are not secret). why is the refusal's
// reason for the metrics, one of RefusalReasons.
func (s *Server) refuse(log *slog.Logger, why string, code codes.Code, summary string, reason error) error {
	log.Warn(summary, "code", code.String(), "reason", reason)
	return &refusal{reason: why, st: status.Newf(code, "%s: %v", summary, reason)}
}

// fail is an error of the service itself: the node learns only that it may retry.
func (s *Server) fail(log *slog.Logger, what string, err error) error {
	log.Error(what, "error", err)
	return &failure{st: status.Newf(codes.Unavailable, "join service failed %s; retry later", what)}
}

func (s *Server) attestErr(log *slog.Logger, err error) error {
	if errors.Is(err, attest.ErrMalformed) {
		return s.refuse(log, RefusedAttestation, codes.InvalidArgument, "attestation refused", err)
	}
	return s.refuse(log, RefusedAttestation, codes.Unauthenticated, "attestation refused", err)
}

// refusal is the status a refused node gets, with the reason the metrics count it under.
type refusal struct {
	reason string
	st     *status.Status
}

func (r *refusal) Error() string              { return r.st.Err().Error() }
func (r *refusal) GRPCStatus() *status.Status { return r.st }

// failure is the status of an exchange the service failed.
type failure struct{ st *status.Status }

func (f *failure) Error() string              { return f.st.Err().Error() }
func (f *failure) GRPCStatus() *status.Status { return f.st }

// observe counts an exchange of call that started at start and ended with *err.
func (s *Server) observe(call string, start time.Time, err *error) {
	took := time.Since(start)
	var r *refusal
	var f *failure
	switch {
	case *err == nil:
		s.cfg.Metrics.TicketIssued(call, took)
	case errors.As(*err, &r):
		s.cfg.Metrics.TicketRefused(call, r.reason, took)
	case errors.As(*err, &f):
		s.cfg.Metrics.ExchangeFailed(call, ErrorInternal, took)
	default:
		s.cfg.Metrics.ExchangeFailed(call, ErrorStream, took)
	}
}

// noMetrics counts nothing.
type noMetrics struct{}

func (noMetrics) TicketIssued(string, time.Duration)           {}
func (noMetrics) TicketRefused(string, string, time.Duration)  {}
func (noMetrics) ExchangeFailed(string, string, time.Duration) {}

func (s *Server) streamErr(log *slog.Logger, what string, err error) error {
	if st, ok := status.FromError(err); ok && st.Code() != codes.Unknown {
		log.Warn(what, "code", st.Code().String(), "error", err)
		return err
	}
	log.Warn(what, "error", err)
	return status.Errorf(codes.Canceled, "%s: stream ended", what)
}

func ipsOf(addrs []netip.Addr) []net.IP {
	ips := make([]net.IP, len(addrs))
	for i, a := range addrs {
		ips[i] = a.AsSlice()
	}
	return ips
}

// hexPCRs shows PCR values as an operator compares them with berth-image.json.
func hexPCRs(pcrs map[int][]byte) map[string]string {
	out := make(map[string]string, len(pcrs))
	for i, v := range pcrs {
		out[strconv.Itoa(i)] = hex.EncodeToString(v)
	}
	return out
}
