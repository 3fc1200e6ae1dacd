package recoveryserver_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/clustersecrets"
	"github.com/berthlabs/berth/internal/keys"
	"github.com/berthlabs/berth/internal/luks"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/internal/rpc"
	"github.com/berthlabs/berth/nodeagent/internal/initserver"
	"github.com/berthlabs/berth/nodeagent/internal/recoveryclient"
	"github.com/berthlabs/berth/nodeagent/internal/recoveryserver"
	"github.com/berthlabs/berth/nodeagent/internal/statedisk"
	"github.com/berthlabs/berth/test/clustertest"
	"github.com/berthlabs/berth/test/swtpm/swtpmtest"
)

// recordingDisk is the real state disk, remembering every key it was asked to take.
type recordingDisk struct {
	*statedisk.Disk
	tried [][]byte
}

func (d *recordingDisk) SetKey(ctx context.Context, initial, key []byte) error {
	d.tried = append(d.tried, bytes.Clone(key))
	return d.Disk.SetKey(ctx, initial, key)
}

// countingProver is the node's real prover, counting its quotes.
type countingProver struct {
	*attest.Prover
	quotes atomic.Int64
}

func (p *countingProver) Evidence(nonce []byte, pcrs []int) (*berthv1.Evidence, error) {
	p.quotes.Add(1)
	return p.Prover.Evidence(nonce, pcrs)
}

type fixture struct {
	prover   *countingProver
	endpoint string
	server   *recoveryserver.Server
	disk     *recordingDisk
	vol      *luks.Volume
	key      []byte
	root     []byte
	verifier *attest.Verifier
}

// newFixture is a node with a real swtpm and a LUKS2 disk keyed with the key its cluster's root key derives,
// serving recovery on loopback with the admission key the disk keeps; edit, if set, changes the server's
// configuration first.
func newFixture(t *testing.T, edit func(*recoveryserver.Config)) *fixture {
	t.Helper()
	ca := swtpmtest.NewCA(t)
	tpm, err := attest.OpenTPM(ca.NewTPM(t).Device())
	if err != nil {
		t.Fatal(err)
	}
	prover, err := attest.NewProver(tpm)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { prover.Close() })

	img := filepath.Join(t.TempDir(), "state.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 32<<20); err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	vol := luks.New(img, nil)
	disk := statedisk.New(vol, nil)
	prepared, err := disk.Prepare(ctx)
	if err != nil {
		t.Fatal(err)
	}
	root := make([]byte, 32)
	rand.Read(root)
	secrets, err := clustersecrets.Derive(root)
	if err != nil {
		t.Fatal(err)
	}
	label, err := keys.DiskLabel(prepared.UUID)
	if err != nil {
		t.Fatal(err)
	}
	key, err := keys.Derive(secrets.MasterSecret, secrets.Salt, label, 32)
	if err != nil {
		t.Fatal(err)
	}
	if err := disk.SetKey(ctx, prepared.InitialKey, key); err != nil {
		t.Fatal(err)
	}
	admission, err := disk.RecoveryAdmissionKey(ctx)
	if err != nil || admission == nil {
		t.Fatalf("the keyed disk's admission key: %x, %v", admission, err)
	}
	f := &fixture{disk: &recordingDisk{Disk: disk}, vol: vol, key: key, root: root, prover: &countingProver{Prover: prover},
		verifier: attest.NewVerifier(attest.NewCertChain(ca.Roots(), ca.Intermediates(), nil))}
	cfg := recoveryserver.Config{Prover: f.prover, Disk: f.disk, DiskUUID: prepared.UUID, AdmissionKey: admission,
		Self: &metadata.Instance{Name: "cp-0", Role: metadata.RoleControlPlane}}
	if edit != nil {
		edit(&cfg)
	}
	f.server, err = recoveryserver.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := initserver.ServerCredentials()
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer(rpc.ServerOptions(cert)...)
	berthv1.RegisterRecoveryServiceServer(gs, f.server)
	go gs.Serve(lis)
	t.Cleanup(gs.Stop)
	f.endpoint = lis.Addr().String()
	return f
}

func (f *fixture) config(root []byte, images ...policy.Image) recoveryclient.Config {
	return recoveryclient.Config{Endpoint: f.endpoint, Verifier: f.verifier, RootKey: root, Policy: &policy.Policy{Images: images},
		Timeout: 30 * time.Second}
}

func TestRecover(t *testing.T) {
	f := newFixture(t, nil)
	ctx := t.Context()
	swtpm := clustertest.ZeroPolicy("swtpm-zero", metadata.RoleControlPlane).Images[0]
	other := swtpm
	other.Name, other.PCRs = "other", map[int][]byte{11: bytes.Repeat([]byte{1}, 32)}

	// An image outside the policy: refused by the client, and the node never sees a key.
	_, err := recoveryclient.Recover(ctx, f.config(f.root, other))
	var mismatch *policy.MismatchError
	if !errors.As(err, &mismatch) || mismatch.PCR != 11 || !strings.Contains(err.Error(), "nothing was sent") {
		t.Fatalf("Recover of a node outside the policy = %v, want a mismatch at PCR 11", err)
	}
	if len(f.disk.tried) != 0 {
		t.Fatalf("the node was sent %d keys before its measurements were checked", len(f.disk.tried))
	}

	// A wrong root key: the node refuses its proof before it quotes, and is never sent the key.
	quotes := f.prover.quotes.Load()
	wrong := make([]byte, 32)
	rand.Read(wrong)
	_, err = recoveryclient.Recover(ctx, f.config(wrong, swtpm))
	if err == nil || !strings.Contains(err.Error(), "the proof is not of this node's disk key") {
		t.Fatalf("Recover with a wrong root key = %v, want the node's refusal of the proof", err)
	}
	if len(f.disk.tried) != 0 || f.prover.quotes.Load() != quotes {
		t.Fatalf("for a wrong root key the node was tried %d keys and quoted %d times, want neither", len(f.disk.tried), f.prover.quotes.Load()-quotes)
	}
	select {
	case <-f.server.Done():
		t.Fatal("the server is done after a wrong key")
	default:
	}

	// The operator expects another node: nothing is sent.
	cfg := f.config(f.root, swtpm)
	cfg.Confirm = func(n recoveryclient.Node) error {
		if n.Name != "cp-0" || n.Role != "control-plane" || n.Image != "swtpm-zero" || len(n.EK) != 64 {
			t.Errorf("attested node %+v", n)
		}
		return errors.New("not the node I meant")
	}
	if _, err := recoveryclient.Recover(ctx, cfg); err == nil || len(f.disk.tried) != 0 {
		t.Fatalf("Recover refused by Confirm = %v, %d keys tried", err, len(f.disk.tried))
	}

	node, err := recoveryclient.Recover(ctx, f.config(f.root, other, swtpm))
	if err != nil {
		t.Fatalf("Recover: %v", err)
	}
	if node.Image != "swtpm-zero" || node.Name != "cp-0" {
		t.Errorf("recovered node %+v", node)
	}
	select {
	case <-f.server.Done():
	default:
		t.Fatal("the server is not done after the right key")
	}
	if !bytes.Equal(f.server.Key(), f.key) {
		t.Error("the server's key is not the disk's derived key")
	}
	if slot, err := f.vol.KeySlot(ctx, f.key); err != nil {
		t.Errorf("the derived key no longer opens the disk: %v (slot %d)", err, slot)
	}
}

// A stranger, who cannot prove the disk key, gets no quote and no slot: silence after the hello, a wrong
// proof, the key itself instead of the proof, and evidence asked for without a hello all end before the
// node quotes, while the operator recovers the node meanwhile.
func TestRecoverAdmitsBeforeItQuotes(t *testing.T) {
	f := newFixture(t, nil)
	hello := &berthv1.RecoveryClientMessage{Msg: &berthv1.RecoveryClientMessage_Hello{Hello: &berthv1.RecoveryHello{Pcrs: []uint32{7}}}}
	for name, answer := range map[string]*berthv1.RecoveryClientMessage{
		"a wrong proof":   {Msg: &berthv1.RecoveryClientMessage_AdmissionProof{AdmissionProof: &berthv1.RecoveryAdmissionProof{Mac: bytes.Repeat([]byte{1}, 32)}}},
		"an empty proof":  {Msg: &berthv1.RecoveryClientMessage_AdmissionProof{AdmissionProof: &berthv1.RecoveryAdmissionProof{}}},
		"the key instead": {Msg: &berthv1.RecoveryClientMessage_Key{Key: &berthv1.RecoveryKey{DiskKey: f.key}}},
	} {
		t.Run(name, func(t *testing.T) {
			st := f.rawStream(t)
			if err := st.Send(hello); err != nil {
				t.Fatal(err)
			}
			msg, err := st.Recv()
			if err != nil || msg.GetAdmissionChallenge().GetDiskUuid() == "" {
				t.Fatalf("want the admission challenge naming the disk, got %v, %v", msg, err)
			}
			if err := st.Send(answer); err != nil {
				t.Fatal(err)
			}
			if _, err := st.Recv(); err == nil {
				t.Fatal("the node went on after a stranger's answer")
			}
		})
	}
	// Strangers that say hello and then nothing hold their connections while the operator recovers.
	for range 4 {
		st := f.rawStream(t)
		if err := st.Send(hello); err != nil {
			t.Fatal(err)
		}
	}
	swtpm := clustertest.ZeroPolicy("swtpm-zero", metadata.RoleControlPlane).Images[0]
	if _, err := recoveryclient.Recover(t.Context(), f.config(f.root, swtpm)); err != nil {
		t.Fatalf("Recover while strangers stall: %v", err)
	}
	if got := f.prover.quotes.Load(); got != 1 {
		t.Errorf("the node quoted %d times, want once, for the operator", got)
	}
	if len(f.disk.tried) != 1 {
		t.Errorf("the node was tried %d keys, want the operator's", len(f.disk.tried))
	}
}

// A disk whose keying stopped before its admission key was stored is still recovered: the node names no
// disk and answers the hello with its evidence.
func TestRecoverWithoutAdmissionKey(t *testing.T) {
	f := newFixture(t, func(c *recoveryserver.Config) { c.AdmissionKey = nil })
	swtpm := clustertest.ZeroPolicy("swtpm-zero", metadata.RoleControlPlane).Images[0]
	if _, err := recoveryclient.Recover(t.Context(), f.config(f.root, swtpm)); err != nil {
		t.Fatalf("Recover of a node without an admission key: %v", err)
	}
}

// rawStream opens a recovery stream to f's server.
func (f *fixture) rawStream(t *testing.T) grpc.BidiStreamingClient[berthv1.RecoveryClientMessage, berthv1.RecoveryServerMessage] {
	t.Helper()
	conn, err := grpc.NewClient(f.endpoint, rpc.DialOptions(&tls.Config{MinVersion: tls.VersionTLS13, InsecureSkipVerify: true}, netip.Addr{})...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	st, err := berthv1.NewRecoveryServiceClient(conn).Recover(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	return st
}
