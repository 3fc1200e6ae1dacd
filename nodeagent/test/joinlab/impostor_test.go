package joinlab

import (
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/rpc"
)

// impostor is a join service with a certificate from a CA other than the pinned one, and a metadata
// service that sends nodes to it: what a node meets on a network someone else controls.
type impostor struct {
	berthv1.UnimplementedJoinServiceServer
	lab   *Lab
	addr  string
	calls atomic.Int32
}

func newImpostor(t *testing.T, lab *Lab) *impostor {
	t.Helper()
	ca, err := pki.NewCA("not-the-join-ca", time.Now(), 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	im := &impostor{lab: lab, addr: lis.Addr().String()}
	srv := grpc.NewServer(rpc.ServerOptions(lab.ServerCert(ca))...)
	berthv1.RegisterJoinServiceServer(srv, im)
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	return im
}

func (im *impostor) IssueJoinTicket(berthv1.JoinService_IssueJoinTicketServer) error {
	im.calls.Add(1)
	return nil
}

func (im *impostor) requests() int { return int(im.calls.Load()) }

// metadataFor serves n's record with the real join CA pin but the impostor as the only join endpoint.
func (im *impostor) metadataFor(n *Node) *metadata.Client {
	return metadataPointingTo(im.lab, n, im.addr)
}

// metadataPointingTo serves n's record with the lab's join CA pin and addr as the only join endpoint.
func metadataPointingTo(lab *Lab, n *Node, addr string) *metadata.Client {
	doc := &metadata.Document{
		UserData: metadata.UserData{ClusterName: "lab", JoinEndpoints: []string{addr}, JoinPort: 1,
			JoinCAPin: pki.SPKIPin(lab.JoinCA.Cert)},
		Instances: []metadata.Instance{{Name: n.Name, Role: n.Role, Addresses: []netip.Addr{n.Addr}}},
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		lab.t.Fatal(err)
	}
	hs := &http.Server{Handler: metadata.NewServer(doc, slog.New(slog.DiscardHandler)), ReadHeaderTimeout: time.Second}
	go hs.Serve(lis)
	lab.t.Cleanup(func() { hs.Close() })
	return &metadata.Client{BaseURL: "http://" + lis.Addr().String(), LocalAddr: n.Addr}
}
