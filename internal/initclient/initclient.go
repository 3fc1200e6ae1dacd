// Package initclient initializes a Berth cluster on its first control-plane node: it proves the node
// before it sends the node anything secret, then streams kubeadm's progress and returns the admin
// kubeconfig. The Terraform provider and the tests use it.
//
// The node's init server has no certificate anyone could pin: it runs before the cluster exists, so no
// cluster CA vouches for it. TLS therefore only gives a private channel to an unauthenticated peer: the
// client accepts any certificate (TLS 1.3 only) and authenticates the node by attestation bound to this
// very connection instead:
//
//  1. the client names the PCRs it expects (those of the image's manifest);
//  2. the node quotes them with its TPM over the connection's TLS exporter value (attest.Nonce), which
//     only the two ends of this TLS session can compute, so a quote made on any other connection (by a
//     relay in the middle, say, which has a session of its own with each side) does not verify;
//  3. the client checks that the EK certificate chains to a trusted root and that every expected PCR
//     holds the value the image predicts, then challenges the attestation key to prove that it lives in
//     that EK's TPM (credential activation).
//
// Only then does the client send the init request, so the init secret and the master secret reach only
// an attested node running the expected image, over a channel whose other end is that node. The node in
// turn checks the init secret before it does anything.
package initclient

import (
	"cmp"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/netip"
	"slices"
	"time"

	"google.golang.org/grpc"
	grpcbackoff "google.golang.org/grpc/backoff"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/initsecret"
	"github.com/berthlabs/berth/internal/rpc"
)

// DefaultTimeout bounds a whole init when Config.Timeout is zero: kubeadm init pulls and starts the
// control plane, which takes minutes on a slow machine.
const DefaultTimeout = 15 * time.Minute

// maxPCR is the highest PCR index of a TPM 2.0 PC client.
const maxPCR = 23

// Config is one init call.
type Config struct {
	// Endpoint is host:port of the node's init server.
	Endpoint string
	// Verifier trusts the node's TPM: by its EK certificate's chain, or by the EK its cloud reports for
	// InstanceID.
	Verifier *attest.Verifier
	// InstanceID is the node's id at its cloud (an EC2 instance id), for a Verifier whose EK trust asks the
	// cloud; empty otherwise.
	InstanceID string
	// ExpectedPCRs are the SHA-256 measurements the node must show, by PCR index (from the Packer
	// manifest).
	ExpectedPCRs map[int][]byte
	// Request is sent only to a node that passed attestation.
	Request *berthv1.InitRequest
	// Progress, if set, receives each line of kubeadm's output, in order.
	Progress func(line string)
	// LocalAddr, if valid, is the source address of the connection.
	LocalAddr netip.Addr
	// Timeout bounds the whole call, waits for a busy node included; DefaultTimeout if zero.
	Timeout time.Duration
	// Busy, if set, is told each time the node was busy with another exchange, before the wait for the
	// next attempt.
	Busy func(attempt int, wait time.Duration)
}

// MeasurementError is a node whose quoted PCR differs from what the image predicts. Got is nil when the
// node did not quote the PCR at all.
type MeasurementError struct {
	PCR           int
	Expected, Got []byte
}

func (e *MeasurementError) Error() string {
	if e.Got == nil {
		return fmt.Sprintf("PCR %d: expected %x, got no value", e.PCR, e.Expected)
	}
	return fmt.Sprintf("PCR %d: expected %x, got %x", e.PCR, e.Expected, e.Got)
}

// Init attests the node at cfg.Endpoint, sends it the init request and returns its result. A node busy
// with another client's exchange is asked again until cfg.Timeout. Errors from the node keep their gRPC
// status (status.Code works on them); a node whose measurements differ gives an error wrapping
// *MeasurementError.
func Init(ctx context.Context, cfg Config) (*berthv1.InitResult, error) {
	pcrs, err := cfg.check()
	if err != nil {
		return nil, fmt.Errorf("init: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, cmp.Or(cfg.Timeout, DefaultTimeout))
	defer cancel()
	return rpc.RetryBusy(ctx, func() (*berthv1.InitResult, error) { return attemptInit(ctx, cfg, pcrs) }, cfg.Busy)
}

// attemptInit is one exchange, on a connection of its own: the init server serves one exchange per
// connection.
func attemptInit(ctx context.Context, cfg Config, pcrs []int) (*berthv1.InitResult, error) {
	// A node is usually created in the same run that initializes it, so its init server may not listen yet:
	// the stream waits for the connection, redialling every few seconds, until the timeout.
	opts := append(rpc.DialOptions(tlsConfig(), cfg.LocalAddr), grpc.WithConnectParams(grpc.ConnectParams{
		Backoff:           grpcbackoff.Config{BaseDelay: 250 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 5 * time.Second},
		MinConnectTimeout: 5 * time.Second,
	}))
	conn, err := grpc.NewClient(cfg.Endpoint, opts...)
	if err != nil {
		return nil, fmt.Errorf("init of %s: %w", cfg.Endpoint, err)
	}
	defer conn.Close()
	st, err := berthv1.NewInitServiceClient(conn).Init(ctx, grpc.WaitForReady(true))
	if err != nil {
		return nil, fmt.Errorf("init of %s: opening stream: %w", cfg.Endpoint, err)
	}
	res, err := run(st, cfg, pcrs)
	if err != nil {
		return nil, fmt.Errorf("init of %s: %w", cfg.Endpoint, err)
	}
	return res, nil
}

// tlsConfig accepts any server certificate: see the package documentation for why that is safe here.
func tlsConfig() *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		// The node has no certificate anyone could check; the attestation bound to this connection
		// authenticates it before anything secret is sent.
		InsecureSkipVerify: true,
	}
}

// check validates cfg and returns the PCR indexes to ask for, sorted.
func (cfg *Config) check() ([]int, error) {
	switch {
	case cfg.Endpoint == "":
		return nil, errors.New("no endpoint")
	case cfg.Verifier == nil:
		return nil, errors.New("no verifier")
	case cfg.Request == nil:
		return nil, errors.New("no init request")
	case len(cfg.Request.InitSecret) == 0:
		return nil, errors.New("the init request has no init secret")
	case len(cfg.ExpectedPCRs) == 0:
		return nil, errors.New("no expected PCR values: an unmeasured node must not receive the cluster's secrets")
	}
	pcrs := slices.Sorted(maps.Keys(cfg.ExpectedPCRs))
	for _, i := range pcrs {
		if i < 0 || i > maxPCR {
			return nil, fmt.Errorf("expected PCR index %d is out of range 0-%d", i, maxPCR)
		}
		if n := len(cfg.ExpectedPCRs[i]); n != sha256.Size {
			return nil, fmt.Errorf("expected value of PCR %d has %d bytes, want a SHA-256 value of %d", i, n, sha256.Size)
		}
	}
	return pcrs, nil
}

type stream = grpc.BidiStreamingClient[berthv1.InitClientMessage, berthv1.InitServerMessage]

// run is the exchange on one stream: hello, secret challenge and proof, evidence, challenge, proof,
// request, progress, result.
func run(st stream, cfg Config, pcrs []int) (*berthv1.InitResult, error) {
	nonce, err := rpc.StreamNonce(st.Context())
	if err != nil {
		return nil, err
	}
	hello := &berthv1.InitHello{Pcrs: make([]uint32, len(pcrs))}
	for i, p := range pcrs {
		hello.Pcrs[i] = uint32(p)
	}
	if err := send(st, &berthv1.InitClientMessage{Msg: &berthv1.InitClientMessage_Hello{Hello: hello}}); err != nil {
		return nil, fmt.Errorf("sending hello: %w", err)
	}
	msg, err := st.Recv()
	if err != nil {
		return nil, fmt.Errorf("receiving the init secret challenge: %w", err)
	}
	// Agents before the secret challenge answer the hello with evidence at once.
	if c := msg.GetSecretChallenge(); c != nil {
		proof, err := initsecret.Proof(c.GetHashParameters(), int(c.GetHashLength()), cfg.Request.InitSecret, nonce)
		if err != nil {
			return nil, fmt.Errorf("answering the init secret challenge: %w", err)
		}
		if err := send(st, &berthv1.InitClientMessage{Msg: &berthv1.InitClientMessage_SecretProof{SecretProof: &berthv1.InitSecretProof{Mac: proof}}}); err != nil {
			return nil, fmt.Errorf("sending the init secret proof: %w", err)
		}
		if msg, err = st.Recv(); err != nil {
			return nil, fmt.Errorf("receiving evidence: %w", err)
		}
	}
	ev := msg.GetEvidence()
	if ev == nil {
		return nil, errors.New("the node answered the hello without evidence")
	}
	pending, err := cfg.Verifier.Verify(st.Context(), ev, nonce, cfg.InstanceID)
	if err != nil {
		return nil, fmt.Errorf("verifying the node's evidence: %w", err)
	}
	// Verify checked that the quote covers every value in ev.Pcrs; a PCR the node left out is caught here.
	for _, i := range pcrs {
		if got, ok := ev.Pcrs[uint32(i)]; !ok || !slices.Equal(got, cfg.ExpectedPCRs[i]) {
			return nil, fmt.Errorf("the node does not run the expected image: %w",
				&MeasurementError{PCR: i, Expected: slices.Clone(cfg.ExpectedPCRs[i]), Got: slices.Clone(got)})
		}
	}
	if err := send(st, &berthv1.InitClientMessage{Msg: &berthv1.InitClientMessage_Challenge{Challenge: pending.Challenge}}); err != nil {
		return nil, fmt.Errorf("sending activation challenge: %w", err)
	}
	if msg, err = st.Recv(); err != nil {
		return nil, fmt.Errorf("receiving activation proof: %w", err)
	}
	if _, err := pending.Complete(msg.GetProof()); err != nil {
		return nil, fmt.Errorf("verifying the node's attestation key: %w", err)
	}

	if err := send(st, &berthv1.InitClientMessage{Msg: &berthv1.InitClientMessage_Request{Request: cfg.Request}}); err != nil {
		return nil, fmt.Errorf("sending init request: %w", err)
	}
	if err := st.CloseSend(); err != nil {
		return nil, fmt.Errorf("sending init request: %w", err)
	}
	for {
		msg, err := st.Recv()
		if errors.Is(err, io.EOF) {
			return nil, errors.New("the node ended the stream without a result")
		}
		if err != nil {
			return nil, err
		}
		switch m := msg.Msg.(type) {
		case *berthv1.InitServerMessage_Progress:
			if cfg.Progress != nil {
				cfg.Progress(m.Progress.GetLine())
			}
		case *berthv1.InitServerMessage_Result:
			if m.Result == nil || len(m.Result.Kubeconfig) == 0 {
				return nil, errors.New("the node's result has no kubeconfig")
			}
			return m.Result, nil
		default:
			return nil, fmt.Errorf("unexpected message %T from the node during init", msg.Msg)
		}
	}
}

// send sends m; when the node has already ended the stream, gRPC's Send says only io.EOF, and the node's
// status is what Recv returns.
func send(st stream, m *berthv1.InitClientMessage) error {
	err := st.Send(m)
	if errors.Is(err, io.EOF) {
		if _, rerr := st.Recv(); rerr != nil {
			return rerr
		}
	}
	return err
}

// AwaitsInit reports whether a Berth init server answers at endpoint, that is, a node waits there to be
// initialized. It says hello and hangs up at the node's first answer, its init secret challenge (or, from
// agents before that challenge, evidence), unverified: nothing else is sent to the node, and the answer
// means only that the node at endpoint is not (yet) a cluster member. An error says why nothing answered.
func AwaitsInit(ctx context.Context, endpoint string, timeout time.Duration) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	conn, err := grpc.NewClient(endpoint, rpc.DialOptions(tlsConfig(), netip.Addr{})...)
	if err != nil {
		return false, err
	}
	defer conn.Close()
	st, err := berthv1.NewInitServiceClient(conn).Init(ctx)
	if err != nil {
		return false, err
	}
	hello := &berthv1.InitClientMessage{Msg: &berthv1.InitClientMessage_Hello{Hello: &berthv1.InitHello{Pcrs: []uint32{0}}}}
	if err := send(st, hello); err != nil {
		return false, err
	}
	msg, err := st.Recv()
	if rpc.IsBusy(err) {
		// Another client's exchange holds the slot: an init server all the same.
		return true, nil
	}
	if err != nil {
		return false, err
	}
	return msg.GetSecretChallenge() != nil || msg.GetEvidence() != nil, nil
}
