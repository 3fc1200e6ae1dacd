// Package recoveryclient is the operator's side of a node's recovery (berth-agent recover): it attests a
// node that cannot unlock its state disk by itself and, only once the node's measurements are allowed by
// the join policy for the role it names, sends the node the disk key derived from the cluster's root key.
//
// As with the init client, the node's server has no certificate anyone could pin, so TLS gives a private
// channel and the attestation bound to that channel (a quote over its TLS exporter value, and credential
// activation against a certified EK) authenticates the node. The disk key is the only secret sent, and it
// opens only the disk the node names: a genuine image on a machine the operator did not mean to recover
// gains the key of its own disk, which is why the tool shows the node's name, disk and TPM first.
package recoveryclient

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"time"

	"google.golang.org/grpc"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/clustersecrets"
	"github.com/berthlabs/berth/internal/keys"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/internal/rpc"
)

// DefaultTimeout bounds a whole recovery when Config.Timeout is zero.
const DefaultTimeout = 2 * time.Minute

// Config is one recovery.
type Config struct {
	// Endpoint is host:port of the node's recovery server (the init port, 7451 by default).
	Endpoint string
	// Verifier trusts the node's TPM: by its EK certificate's chain, or by the EK its cloud reports for
	// InstanceID.
	Verifier *attest.Verifier
	// InstanceID is the node's id at its cloud (an EC2 instance id), for a Verifier whose EK trust asks the
	// cloud; empty otherwise.
	InstanceID string
	// Policy lists the images the node may run, per role: the join policy, or an image manifest's image.
	Policy *policy.Policy
	// RootKey is the cluster's root key (berth_secrets' root_key), decoded.
	RootKey []byte
	// Confirm, if set, is asked before the key is sent, with what the attested node is; an error stops the
	// recovery with nothing sent.
	Confirm func(Node) error
	// LocalAddr, if valid, is the source address of the connection.
	LocalAddr netip.Addr
	// Timeout bounds the whole recovery, waits for a busy node included; DefaultTimeout if zero.
	Timeout time.Duration
	// Busy, if set, is told each time the node was busy with another exchange, before the next attempt.
	Busy  func(attempt int, wait time.Duration)
	Clock func() time.Time
}

// Node is what the attested node is: its own name, role and disk, and what attestation proved.
type Node struct {
	Name, Role, Disk string
	// Image is the policy's image whose measurements the node quoted.
	Image string
	// EK is the fingerprint of the node's TPM.
	EK string
}

// Recover attests the node at cfg.Endpoint and sends it its disk key, asking again while the node is busy
// with another exchange, until cfg.Timeout. Errors from the node keep their gRPC
// status; a node whose measurements the policy refuses gives an error wrapping *policy.MismatchError,
// which names the PCR, expected and got, and nothing was sent to it.
func Recover(ctx context.Context, cfg Config) (*Node, error) {
	secrets, err := cfg.check()
	if err != nil {
		return nil, fmt.Errorf("recovery: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, cmp.Or(cfg.Timeout, DefaultTimeout))
	defer cancel()
	return rpc.RetryBusy(ctx, func() (*Node, error) { return attempt(ctx, cfg, secrets) }, cfg.Busy)
}

// attempt is one exchange, on a connection of its own: the node serves one exchange per connection.
func attempt(ctx context.Context, cfg Config, secrets *clustersecrets.Secrets) (*Node, error) {
	conn, err := grpc.NewClient(cfg.Endpoint, rpc.DialOptions(tlsConfig(), cfg.LocalAddr)...)
	if err != nil {
		return nil, fmt.Errorf("recovery of %s: %w", cfg.Endpoint, err)
	}
	defer conn.Close()
	st, err := berthv1.NewRecoveryServiceClient(conn).Recover(ctx)
	if err != nil {
		return nil, fmt.Errorf("recovery of %s: opening stream: %w", cfg.Endpoint, err)
	}
	node, err := run(st, cfg, secrets)
	if err != nil {
		return node, fmt.Errorf("recovery of %s: %w", cfg.Endpoint, err)
	}
	return node, nil
}

// tlsConfig accepts any server certificate: the node is authenticated by the attestation bound to the
// connection before its key is sent.
func tlsConfig() *tls.Config {
	return &tls.Config{MinVersion: tls.VersionTLS13, InsecureSkipVerify: true}
}

func (cfg *Config) check() (*clustersecrets.Secrets, error) {
	switch {
	case cfg.Endpoint == "":
		return nil, errors.New("no endpoint")
	case cfg.Verifier == nil:
		return nil, errors.New("no EK verifier")
	case cfg.Policy == nil || len(cfg.Policy.Images) == 0:
		return nil, errors.New("no images to check the node against: an unmeasured node must not receive a disk key")
	}
	secrets, err := clustersecrets.Derive(cfg.RootKey)
	if err != nil {
		return nil, err
	}
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	return secrets, nil
}

type stream = grpc.BidiStreamingClient[berthv1.RecoveryClientMessage, berthv1.RecoveryServerMessage]

// run is the exchange: hello, admission challenge and proof, evidence, policy check, challenge, proof, key,
// result.
func run(st stream, cfg Config, secrets *clustersecrets.Secrets) (*Node, error) {
	nonce, err := rpc.StreamNonce(st.Context())
	if err != nil {
		return nil, err
	}
	indexes := cfg.Policy.PCRIndexes()
	hello := &berthv1.RecoveryHello{Pcrs: make([]uint32, len(indexes))}
	for i, p := range indexes {
		hello.Pcrs[i] = uint32(p)
	}
	if err := send(st, &berthv1.RecoveryClientMessage{Msg: &berthv1.RecoveryClientMessage_Hello{Hello: hello}}); err != nil {
		return nil, fmt.Errorf("sending hello: %w", err)
	}
	msg, err := st.Recv()
	if err != nil {
		return nil, fmt.Errorf("receiving the node's admission challenge: %w", err)
	}
	// A node whose disk keeps no admission key answers the hello with evidence at once.
	challenged := ""
	if c := msg.GetAdmissionChallenge(); c != nil {
		challenged = c.GetDiskUuid()
		if err := prove(st, secrets, challenged, nonce); err != nil {
			return &Node{Disk: challenged}, err
		}
		if msg, err = st.Recv(); err != nil {
			return &Node{Disk: challenged}, fmt.Errorf("receiving evidence: %w", err)
		}
	}
	ev := msg.GetEvidence()
	if ev == nil || ev.Evidence == nil {
		return nil, errors.New("the node answered without evidence")
	}
	node := &Node{Name: ev.NodeName, Role: ev.Role, Disk: ev.DiskUuid}
	if challenged != "" && ev.DiskUuid != challenged {
		return node, fmt.Errorf("the node named disk %s in its challenge and %s with its evidence", challenged, ev.DiskUuid)
	}
	label, err := keys.DiskLabel(ev.DiskUuid)
	if err != nil {
		return node, fmt.Errorf("the node's disk: %w", err)
	}
	pending, err := cfg.Verifier.Verify(st.Context(), ev.Evidence, nonce, cfg.InstanceID)
	if err != nil {
		return node, fmt.Errorf("verifying the node's evidence: %w", err)
	}
	quoted := make(map[int][]byte, len(ev.Evidence.Pcrs))
	for i, v := range ev.Evidence.Pcrs {
		quoted[int(i)] = v
	}
	image, err := cfg.Policy.Check(metadata.Role(ev.Role), quoted, cfg.Clock())
	if err != nil {
		return node, fmt.Errorf("the node does not run an allowed image; nothing was sent to it: %w", err)
	}
	node.Image = image.Name
	if err := send(st, &berthv1.RecoveryClientMessage{Msg: &berthv1.RecoveryClientMessage_Challenge{Challenge: pending.Challenge}}); err != nil {
		return node, fmt.Errorf("sending activation challenge: %w", err)
	}
	if msg, err = st.Recv(); err != nil {
		return node, fmt.Errorf("receiving activation proof: %w", err)
	}
	result, err := pending.Complete(msg.GetProof())
	if err != nil {
		return node, fmt.Errorf("verifying the node's attestation key: %w", err)
	}
	node.EK = result.EKFingerprint
	if cfg.Confirm != nil {
		if err := cfg.Confirm(*node); err != nil {
			return node, err
		}
	}
	key, err := keys.Derive(secrets.MasterSecret, secrets.Salt, label, keys.DiskKeySize)
	if err != nil {
		return node, err
	}
	if err := send(st, &berthv1.RecoveryClientMessage{Msg: &berthv1.RecoveryClientMessage_Key{Key: &berthv1.RecoveryKey{DiskKey: key}}}); err != nil {
		return node, fmt.Errorf("sending the disk key: %w", err)
	}
	if err := st.CloseSend(); err != nil {
		return node, err
	}
	if msg, err = st.Recv(); err != nil {
		return node, err
	}
	if msg.GetResult() == nil {
		return node, fmt.Errorf("unexpected message %T from the node", msg.Msg)
	}
	return node, nil
}

// prove answers the node's admission challenge for disk: the proof, over this connection's nonce, of the
// disk's key as the cluster's secrets derive it.
func prove(st stream, secrets *clustersecrets.Secrets, disk string, nonce []byte) error {
	label, err := keys.DiskLabel(disk)
	if err != nil {
		return fmt.Errorf("the node's disk: %w", err)
	}
	key, err := keys.Derive(secrets.MasterSecret, secrets.Salt, label, keys.DiskKeySize)
	if err != nil {
		return err
	}
	admission, err := keys.RecoveryAdmissionKey(key)
	if err != nil {
		return err
	}
	proof := &berthv1.RecoveryAdmissionProof{Mac: keys.AdmissionProof(admission, nonce)}
	if err := send(st, &berthv1.RecoveryClientMessage{Msg: &berthv1.RecoveryClientMessage_AdmissionProof{AdmissionProof: proof}}); err != nil {
		return fmt.Errorf("sending the proof of the disk key: %w", err)
	}
	return nil
}

// send sends m; when the node has already ended the stream, Send says only io.EOF, and the node's status
// is what Recv returns.
func send(st stream, m *berthv1.RecoveryClientMessage) error {
	err := st.Send(m)
	if errors.Is(err, io.EOF) {
		if _, rerr := st.Recv(); rerr != nil {
			return rerr
		}
	}
	return err
}
