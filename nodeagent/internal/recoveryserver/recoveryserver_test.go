package recoveryserver_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
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

type fixture struct {
	endpoint string
	server   *recoveryserver.Server
	disk     *recordingDisk
	vol      *luks.Volume
	key      []byte
	root     []byte
	verifier *attest.Verifier
}

// newFixture is a node with a real swtpm and a LUKS2 disk keyed with the key its cluster's root key derives,
// serving recovery on loopback.
func newFixture(t *testing.T) *fixture {
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
	f := &fixture{disk: &recordingDisk{Disk: disk}, vol: vol, key: key, root: root,
		verifier: attest.NewVerifier(attest.NewCertChain(ca.Roots(), ca.Intermediates(), nil))}
	f.server, err = recoveryserver.New(recoveryserver.Config{Prover: prover, Disk: f.disk, DiskUUID: prepared.UUID,
		Self: &metadata.Instance{Name: "cp-0", Role: metadata.RoleControlPlane}})
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
	f := newFixture(t)
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

	// A wrong root key: the node refuses the key, which opens nothing, and its disk is unchanged.
	wrong := make([]byte, 32)
	rand.Read(wrong)
	_, err = recoveryclient.Recover(ctx, f.config(wrong, swtpm))
	if err == nil || !strings.Contains(err.Error(), "does not open this node's state disk") {
		t.Fatalf("Recover with a wrong root key = %v, want the node's refusal", err)
	}
	if len(f.disk.tried) != 1 || bytes.Equal(f.disk.tried[0], f.key) {
		t.Fatalf("the node was tried %d keys, want the one wrong key", len(f.disk.tried))
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
	if _, err := recoveryclient.Recover(ctx, cfg); err == nil || len(f.disk.tried) != 1 {
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
