package joinservice

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/x509"
	"encoding/hex"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/internal/rpc/rpctest"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// FuzzCheckCSR feeds arbitrary bytes to the CSR checks a joining node's request goes through. They must never
// panic, and whatever they accept must be exactly the kubelet identity of the instance record.
func FuzzCheckCSR(f *testing.F) {
	f.Fuzz(func(t *testing.T, data []byte) {
		csr, err := parseCSR(data)
		if err != nil {
			if csr != nil {
				t.Fatalf("parseCSR returned a CSR with the error %v", err)
			}
			return
		}
		if err := checkCSR(csr, &csrInstance); err != nil {
			return
		}
		if csr.Subject.CommonName != "system:node:worker-1.lab" || !slices.Equal(csr.Subject.Organization, []string{"system:nodes"}) {
			t.Fatalf("accepted subject %q", csr.Subject)
		}
		if len(csr.DNSNames)+len(csr.EmailAddresses)+len(csr.URIs) > 0 {
			t.Fatalf("accepted names %v %v %v", csr.DNSNames, csr.EmailAddresses, csr.URIs)
		}
		var ips []netip.Addr
		for _, ip := range csr.IPAddresses {
			a, ok := netip.AddrFromSlice(ip)
			if !ok {
				t.Fatalf("accepted IP SAN %x that is no address", []byte(ip))
			}
			ips = append(ips, a.Unmap())
		}
		slices.SortFunc(ips, netip.Addr.Compare)
		if !slices.Equal(ips, csrInstance.Addresses) {
			t.Fatalf("accepted IP SANs %v, instance has %v", ips, csrInstance.Addresses)
		}
	})
}

// fixedInstance knows the one instance csrInstance, at its first address.
type fixedInstance struct{}

func (fixedInstance) InstanceByAddress(_ context.Context, a netip.Addr) (*metadata.Instance, error) {
	if a != csrInstance.Addresses[0] {
		return nil, metadata.ErrNotFound
	}
	inst := csrInstance
	return &inst, nil
}

// FuzzHandlers feeds the join service's three calls what arrives on the wire: each fuzzed message is decoded
// as gRPC's codec decodes it and handed to the real handler on a stream from an instance's address, first
// the request, then an activation proof. No fuzzed input carries a TPM whose EK chains to the verifier's
// root, so no call may succeed; every refusal is a gRPC status of the service's own codes, and none carries
// a secret.
func FuzzHandlers(f *testing.F) {
	seed := func(m *berthv1.JoinClientMessage) []byte {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		return b
	}
	key, err := pki.NewKey()
	if err != nil {
		f.Fatal(err)
	}
	csr, err := x509.CreateCertificateRequest(rand.Reader, honestCSRTemplate(), key)
	if err != nil {
		f.Fatal(err)
	}
	ev := &berthv1.Evidence{EkCertificate: []byte("ek"), AkPublic: []byte("ak"), Quote: []byte("q"), QuoteSignature: []byte("s"),
		Pcrs: map[uint32][]byte{7: make([]byte, 32)}}
	disk := "0b2c5c36-7f1e-4a5e-9d8b-1f0e6a2b3c4d"
	proof := seed(&berthv1.JoinClientMessage{Msg: &berthv1.JoinClientMessage_Proof{Proof: &berthv1.ActivationProof{Secret: make([]byte, 32)}}})
	for call, m := range []*berthv1.JoinClientMessage{
		{Msg: &berthv1.JoinClientMessage_Join{Join: &berthv1.JoinRequest{Evidence: ev, DiskUuid: disk, KubeletCsr: csr, Role: "worker", NodeName: csrInstance.Name}}},
		{Msg: &berthv1.JoinClientMessage_Rejoin{Rejoin: &berthv1.RejoinRequest{Evidence: ev, DiskUuid: disk, Role: "worker", NodeName: csrInstance.Name}}},
		{Msg: &berthv1.JoinClientMessage_Renew{Renew: &berthv1.RenewRequest{Evidence: ev, DiskUuid: disk, KubeletCsr: csr, Role: "worker", NodeName: csrInstance.Name}}},
	} {
		f.Add(uint8(call), seed(m), proof)
	}

	cfg := validConfig(f)
	cfg.Instances = fixedInstance{}
	cfg.Policy = policy.NewStore(&policy.Policy{Images: []policy.Image{{Name: "zero", Roles: []metadata.Role{metadata.RoleWorker},
		PCRs: map[int][]byte{7: make([]byte, 32)}}}})
	cfg.Timeout = time.Second
	srv, err := New(cfg)
	if err != nil {
		f.Fatal(err)
	}
	ctx := rpctest.PeerContext(f, csrInstance.Addresses[0])
	codesAllowed := []codes.Code{codes.InvalidArgument, codes.PermissionDenied, codes.Unauthenticated, codes.FailedPrecondition,
		codes.Canceled, codes.DeadlineExceeded}

	f.Fuzz(func(t *testing.T, call uint8, request, proof []byte) {
		var in []*berthv1.JoinClientMessage
		for _, wire := range [][]byte{request, proof} {
			m := &berthv1.JoinClientMessage{}
			if proto.Unmarshal(wire, m) != nil {
				break
			}
			in = append(in, m)
		}
		st := &rpctest.Stream[berthv1.JoinClientMessage, berthv1.JoinServerMessage]{Ctx: ctx, In: in}
		var err error
		switch call % 3 {
		case 0:
			err = srv.IssueJoinTicket(st)
		case 1:
			err = srv.IssueRejoinTicket(st)
		default:
			err = srv.RenewKubeletCertificate(st)
		}
		if err == nil {
			t.Fatalf("call %d succeeded on fuzzed input; it sent %v", call%3, st.Out)
		}
		s, ok := status.FromError(err)
		if !ok || !slices.Contains(codesAllowed, s.Code()) {
			t.Fatalf("call %d ended with %v, not a status of the service's own codes", call%3, err)
		}
		for _, secret := range [][]byte{cfg.MasterSecret, cfg.Salt} {
			if strings.Contains(s.Message(), hex.EncodeToString(secret)) || bytes.Contains([]byte(s.Message()), secret) {
				t.Fatalf("the refusal %q carries a secret", s.Message())
			}
		}
		for _, out := range st.Out {
			if out.GetChallenge() == nil {
				t.Fatalf("call %d sent %v before attestation", call%3, out)
			}
		}
	})
}
