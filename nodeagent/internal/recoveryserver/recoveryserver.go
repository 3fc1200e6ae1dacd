// Package recoveryserver gives a node its disk key back from an operator who holds the cluster's root key,
// when nothing else can: see the RecoveryService in internal/api/berthv1/recovery.proto for the exchange.
//
// Before anything else the client proves that it holds the disk's key: the server names its disk, the client
// answers an HMAC of the connection's nonce keyed with the disk's recovery admission key, and the server
// checks it against the admission key the disk's header keeps (statedisk). A stranger costs a connection for
// seconds and never a TPM command or the slot. Then the server sends what anyone may know (its evidence, its
// disk's UUID, its name and role) and accepts one thing: a key, which it uses only if it opens the node's
// disk. A wrong key costs nothing but an error; the disk is never changed by one. One exchange runs at a
// time, each bounded in time, and the server stops once a key has opened the disk.
package recoveryserver

import (
	"context"
	"crypto/hmac"
	"errors"
	"log/slog"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/keys"
	"github.com/berthlabs/berth/internal/luks"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/rpc"
)

// Prover makes TPM evidence (attest.Prover).
type Prover interface {
	Evidence(nonce []byte, pcrs []int) (*berthv1.Evidence, error)
	Activate(*berthv1.ActivationChallenge) ([]byte, error)
}

// Disk is the node's keyed state disk: SetKey with no initial key succeeds only for a key that opens it,
// and then makes it the disk's only key (statedisk.Disk).
type Disk interface {
	SetKey(ctx context.Context, initial, key []byte) error
}

// DefaultTimeout bounds one exchange: a quote and an activation take well under a second, and an
// operator's tool answers at once.
const DefaultTimeout = time.Minute

// slotWait is how long a recovery waits while another holds the node's one slot; the client then hears
// "busy" and asks again.
const slotWait = 10 * time.Second

// Config wires a Server; AdmissionKey, Timeout and Logger are optional.
type Config struct {
	Prover   Prover
	Disk     Disk
	DiskUUID string
	// AdmissionKey is the disk's recovery admission key (keys.RecoveryAdmissionKey of its key), which
	// clients must prove they hold before the node quotes. Without one (a disk whose keying was interrupted
	// before it was stored) the server quotes for anyone who says hello.
	AdmissionKey []byte
	Self         *metadata.Instance
	Timeout      time.Duration
	Logger       *slog.Logger
}

// Server implements berthv1.RecoveryServiceServer.
type Server struct {
	berthv1.UnimplementedRecoveryServiceServer
	cfg  Config
	slot rpc.Slot

	once sync.Once
	done chan struct{}
	key  []byte
}

// New checks cfg.
func New(cfg Config) (*Server, error) {
	if cfg.Prover == nil || cfg.Disk == nil || cfg.Self == nil || cfg.DiskUUID == "" {
		return nil, errors.New("recovery server: prover, disk, its UUID and the node's instance record are required")
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return &Server{cfg: cfg, slot: rpc.NewSlot(), done: make(chan struct{})}, nil
}

// Done is closed once a key has opened the disk; Key returns it then.
func (s *Server) Done() <-chan struct{} { return s.done }

// Key is the key that opened the disk, nil before Done is closed.
func (s *Server) Key() []byte {
	select {
	case <-s.done:
		return s.key
	default:
		return nil
	}
}

// Recover runs one recovery exchange.
func (s *Server) Recover(st berthv1.RecoveryService_RecoverServer) error {
	ctx, cancel := context.WithTimeout(st.Context(), s.cfg.Timeout)
	defer cancel()
	// As on the init server: the slot only for a stream that said hello at once and proved the disk key,
	// each later answer within rpc.StepTimeout.
	hello, err := rpc.RecvWithin(ctx, st, rpc.FirstMessageTimeout)
	if err != nil {
		return recvErr("hello", err)
	}
	if hello.GetHello() == nil {
		return status.Error(codes.InvalidArgument, "expected a hello")
	}
	log := s.cfg.Logger
	if addr, err := rpc.PeerAddr(ctx); err == nil {
		log = log.With("peer", addr.String())
	}
	if err := s.admit(ctx, st); err != nil {
		log.Warn("recovery refused before any TPM command", "reason", err)
		return err
	}
	if !s.slot.Take(ctx, slotWait) {
		return rpc.ErrBusy
	}
	defer s.slot.Release()
	key, err := s.exchange(ctx, st, hello)
	if err != nil {
		log.Warn("recovery refused", "reason", err)
		return err
	}
	if err := s.cfg.Disk.SetKey(ctx, nil, key); err != nil {
		if errors.Is(err, luks.ErrWrongKey) {
			log.Warn("recovery refused: the key does not open the state disk", "disk", s.cfg.DiskUUID)
			return status.Error(codes.PermissionDenied, "the key does not open this node's state disk: was it derived from this cluster's root key?")
		}
		log.Error("recovery: setting the state disk key", "error", err)
		return status.Error(codes.Internal, "the node could not set its state disk key; see its log")
	}
	s.once.Do(func() {
		s.key = key
		close(s.done)
	})
	log.Info("state disk recovered by the operator", "disk", s.cfg.DiskUUID)
	return st.Send(&berthv1.RecoveryServerMessage{Msg: &berthv1.RecoveryServerMessage_Result{Result: &berthv1.RecoveryResult{}}})
}

// admit names the disk and checks the client's proof that it holds the disk's key; it lets everyone in when
// the disk keeps no admission key.
func (s *Server) admit(ctx context.Context, st berthv1.RecoveryService_RecoverServer) error {
	if s.cfg.AdmissionKey == nil {
		return nil
	}
	nonce, err := rpc.StreamNonce(ctx)
	if err != nil {
		return status.Error(codes.FailedPrecondition, err.Error())
	}
	if err := st.Send(&berthv1.RecoveryServerMessage{Msg: &berthv1.RecoveryServerMessage_AdmissionChallenge{
		AdmissionChallenge: &berthv1.RecoveryAdmissionChallenge{DiskUuid: s.cfg.DiskUUID}}}); err != nil {
		return err
	}
	msg, err := rpc.RecvWithin(ctx, st, rpc.StepTimeout)
	if err != nil {
		return recvErr("admission proof", err)
	}
	if msg.GetAdmissionProof() == nil {
		return status.Error(codes.InvalidArgument, "expected the proof of the disk key")
	}
	if !hmac.Equal(msg.GetAdmissionProof().GetMac(), keys.AdmissionProof(s.cfg.AdmissionKey, nonce)) {
		return status.Error(codes.PermissionDenied, "the proof is not of this node's disk key: was it derived from this cluster's root key?")
	}
	return nil
}

// exchange attests the node to the client and returns the key the client sent.
func (s *Server) exchange(ctx context.Context, st berthv1.RecoveryService_RecoverServer, hello *berthv1.RecoveryClientMessage) ([]byte, error) {
	nonce, err := rpc.StreamNonce(ctx)
	if err != nil {
		return nil, status.Error(codes.FailedPrecondition, err.Error())
	}
	pcrs, err := attest.PCRIndexes(hello.GetHello().GetPcrs())
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "hello: %v", err)
	}
	ev, err := s.cfg.Prover.Evidence(nonce, pcrs)
	if err != nil {
		return nil, status.Errorf(codes.Unavailable, "quoting PCRs: %v", err)
	}
	if err := st.Send(&berthv1.RecoveryServerMessage{Msg: &berthv1.RecoveryServerMessage_Evidence{Evidence: &berthv1.RecoveryEvidence{
		Evidence: ev, DiskUuid: s.cfg.DiskUUID, NodeName: s.cfg.Self.Name, Role: string(s.cfg.Self.Role),
	}}}); err != nil {
		return nil, err
	}
	msg, err := rpc.RecvWithin(ctx, st, rpc.StepTimeout)
	if err != nil {
		return nil, recvErr("activation challenge", err)
	}
	if msg.GetChallenge() == nil {
		return nil, status.Error(codes.InvalidArgument, "expected an activation challenge")
	}
	secret, err := s.cfg.Prover.Activate(msg.GetChallenge())
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "activating the challenge: %v", err)
	}
	if err := st.Send(&berthv1.RecoveryServerMessage{Msg: &berthv1.RecoveryServerMessage_Proof{Proof: &berthv1.ActivationProof{Secret: secret}}}); err != nil {
		return nil, err
	}
	if msg, err = rpc.RecvWithin(ctx, st, rpc.StepTimeout); err != nil {
		return nil, recvErr("disk key", err)
	}
	key := msg.GetKey().GetDiskKey()
	if len(key) < luks.MinKeySize || len(key) > luks.MaxKeySize {
		return nil, status.Errorf(codes.InvalidArgument, "expected a disk key of %d to %d bytes", luks.MinKeySize, luks.MaxKeySize)
	}
	return key, nil
}

// recvErr is the status of a failed receive of what: the stream's own (a deadline, a cancellation), or, when
// the client ended its side early, a refusal that says what was missing.
func recvErr(what string, err error) error {
	if st, ok := status.FromError(err); ok && st.Code() != codes.Unknown {
		return err
	}
	return status.Errorf(codes.InvalidArgument, "the stream ended before the %s", what)
}
