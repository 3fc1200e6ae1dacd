package recoveryserver

import (
	"bytes"
	"context"
	"net/netip"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/luks"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/rpc/rpctest"
)

// cannedProver answers as a TPM would without being one: the client, not the node, checks the evidence.
type cannedProver struct{}

func (cannedProver) Evidence([]byte, []int) (*berthv1.Evidence, error) {
	return &berthv1.Evidence{Quote: []byte("quote")}, nil
}

func (cannedProver) Activate(*berthv1.ActivationChallenge) ([]byte, error) {
	return make([]byte, 32), nil
}

// keyedDisk opens with one key only.
type keyedDisk struct{ key []byte }

func (d keyedDisk) SetKey(_ context.Context, _, key []byte) error {
	if !bytes.Equal(key, d.key) {
		return luks.ErrWrongKey
	}
	return nil
}

// FuzzRecover feeds the recovery handler three fuzzed messages (hello, challenge, key), decoded as gRPC's
// codec decodes them. Only the disk's own key may recover the node; everything else is refused with a
// status, and no answer carries a key.
func FuzzRecover(f *testing.F) {
	diskKey := bytes.Repeat([]byte{0x5a}, 32)
	wire := func(m *berthv1.RecoveryClientMessage) []byte {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		return b
	}
	hello := wire(&berthv1.RecoveryClientMessage{Msg: &berthv1.RecoveryClientMessage_Hello{Hello: &berthv1.RecoveryHello{Pcrs: []uint32{7}}}})
	challenge := wire(&berthv1.RecoveryClientMessage{Msg: &berthv1.RecoveryClientMessage_Challenge{Challenge: &berthv1.ActivationChallenge{}}})
	for _, key := range [][]byte{diskKey, bytes.Repeat([]byte{1}, 32), nil} {
		f.Add(hello, challenge, wire(&berthv1.RecoveryClientMessage{Msg: &berthv1.RecoveryClientMessage_Key{Key: &berthv1.RecoveryKey{DiskKey: key}}}))
	}
	ctx := rpctest.PeerContext(f, netip.MustParseAddr("192.0.2.99"))

	f.Fuzz(func(t *testing.T, hello, challenge, key []byte) {
		srv, err := New(Config{Prover: cannedProver{}, Disk: keyedDisk{diskKey}, DiskUUID: "0f1e2d3c-4b5a-4978-8796-a5b4c3d2e1f0",
			Self: &metadata.Instance{Name: "cp-0", Role: metadata.RoleControlPlane}})
		if err != nil {
			t.Fatal(err)
		}
		var in []*berthv1.RecoveryClientMessage
		var sent []byte
		for _, w := range [][]byte{hello, challenge, key} {
			m := &berthv1.RecoveryClientMessage{}
			if proto.Unmarshal(w, m) != nil {
				break
			}
			in = append(in, m)
			if k := m.GetKey().GetDiskKey(); k != nil && sent == nil {
				sent = k
			}
		}
		st := &rpctest.Stream[berthv1.RecoveryClientMessage, berthv1.RecoveryServerMessage]{Ctx: ctx, In: in}
		err = srv.Recover(st)
		if err == nil {
			if !bytes.Equal(srv.Key(), diskKey) {
				t.Fatalf("recovered with key %x, not the disk's", srv.Key())
			}
			return
		}
		s, ok := status.FromError(err)
		if !ok || s.Code() == codes.OK || s.Code() == codes.Unknown {
			t.Fatalf("Recover ended with %v, not a status", err)
		}
		if srv.Key() != nil {
			t.Fatalf("a refused recovery left the key %x", srv.Key())
		}
		if len(sent) >= 8 && bytes.Contains([]byte(s.Message()), sent) {
			t.Fatalf("the refusal %q repeats the key", s.Message())
		}
	})
}
