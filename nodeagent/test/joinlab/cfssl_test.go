package joinlab

import (
	"context"
	"crypto/rand"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"net"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/nodeagent/internal/cfssl"
	"github.com/berthlabs/berth/nodeagent/internal/joinclient"
	"github.com/berthlabs/berth/nodeagent/internal/joinservice"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
	"github.com/berthlabs/berth/test/cfssltest"
)

// swappableSigner lets the test change the join service's CFSSL settings while nodes retry.
type swappableSigner struct{ signer atomic.Pointer[cfssl.Signer] }

func (s *swappableSigner) SignKubelet(ctx context.Context, csr *x509.CertificateRequest, node string, ips []net.IP) (*x509.Certificate, error) {
	return joinservice.CFSSLSigner{Signer: s.signer.Load()}.SignKubelet(ctx, csr, node, ips)
}

// TestJoinThroughCFSSL: a join service whose kubelet certificates come from a real `cfssl serve`. With a
// wrong auth key the node gets no ticket, the operator's log says CFSSL refused authentication, the node
// is told only to retry, and its disk keeps its initial key; once the key is right the same join goes
// through, and the kubelet certificate is CFSSL's (issuer, serial in its database, the service's names). A
// CFSSL that is down is likewise logged as unreachable while the node retries with its disk unchanged.
func TestJoinThroughCFSSL(t *testing.T) {
	srv := cfssltest.Start(t)
	wrong := make([]byte, len(srv.AuthKey))
	rand.Read(wrong)
	signer := &swappableSigner{}
	signer.signer.Store(&cfssl.Signer{URL: srv.URL, Profile: srv.Profile, AuthKey: wrong})
	// CFSSL holds the cluster CA's key: the service has only its certificate.
	lab := New(t, WithKubeletSigner(signer), WithKubernetesCA(&pki.CA{Cert: srv.CA}))
	node := lab.AddNode("worker-1", metadata.RoleWorker)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	prepared, err := node.Disk.Prepare(ctx)
	if err != nil {
		t.Fatal(err)
	}
	joined := make(chan error, 1)
	go func() {
		_, err := lab.JoinClient(node, &Kubeadm{}, &nodestate.Lock{}).Join(ctx, prepared)
		joined <- err
	}()
	waitForLog(t, lab, "refused authentication")
	if opensWith(t, node.Volume.Path(), lab.DiskKey(prepared.UUID)) || !opensWith(t, node.Volume.Path(), prepared.InitialKey) {
		t.Fatal("the disk was rekeyed although no ticket was issued")
	}
	if logs := lab.Logs.String(); !strings.Contains(logs, "join service failed issuing join ticket; retry later") || strings.Contains(logs, hex.EncodeToString(wrong)) {
		t.Error(lab.Logs.Logf("the node was not told to retry, or the auth key was logged"))
	}

	signer.signer.Store(&cfssl.Signer{URL: srv.URL, Profile: srv.Profile, AuthKey: srv.AuthKey})
	if err := <-joined; err != nil {
		t.Fatal(lab.Logs.Logf("join after the key was fixed: %v", err))
	}
	if !opensWith(t, node.Volume.Path(), lab.DiskKey(prepared.UUID)) {
		t.Error("the disk does not open with its derived key after the join")
	}
	cert := readKubeletCert(t, node)
	roots := x509.NewCertPool()
	roots.AddCert(srv.CA)
	if _, err := cert.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		t.Errorf("the kubelet certificate does not chain to CFSSL's CA: %v", err)
	}
	if rec, ok := srv.Recorded(t, cert.SerialNumber); !ok || rec.Status != "good" || rec.CommonName != "system:node:worker-1" {
		t.Errorf("CFSSL's database has %+v (found %v) for serial %s", rec, ok, cert.SerialNumber.Text(16))
	}
	if len(cert.IPAddresses) != 1 || !cert.IPAddresses[0].Equal(net.IP(node.Addr.AsSlice())) || cert.Subject.Organization[0] != "system:nodes" {
		t.Errorf("certificate names: O %v, IPs %v", cert.Subject.Organization, cert.IPAddresses)
	}

	// A CFSSL that signs with another CA than the cluster's is caught before any ticket leaves.
	otherCA := New(t, WithKubeletSigner(signer))
	misfit := otherCA.AddNode("worker-9", metadata.RoleWorker)
	if err := tryJoin(t, ctx, otherCA, misfit); err == nil {
		t.Fatal("a node joined with a kubelet certificate from another CA than the ticket's")
	}
	if !strings.Contains(otherCA.Logs.String(), "is not signed by the Kubernetes CA") {
		t.Error(otherCA.Logs.Logf("the log does not say the signer's CA is not the cluster's"))
	}

	srv.Stop()
	down := lab.AddNode("worker-2", metadata.RoleWorker)
	if err := tryJoin(t, ctx, lab, down); err == nil {
		t.Fatal("a node joined while CFSSL was down")
	}
	if !strings.Contains(lab.Logs.String(), "is unreachable") {
		t.Error(lab.Logs.Logf("the log does not say CFSSL is unreachable"))
	}
}

// tryJoin joins n for a few seconds and checks that a join that got no ticket left its disk as it was.
func tryJoin(t *testing.T, ctx context.Context, lab *Lab, n *Node) error {
	t.Helper()
	prepared, err := n.Disk.Prepare(ctx)
	if err != nil {
		t.Fatal(err)
	}
	short, stop := context.WithTimeout(ctx, 5*time.Second)
	defer stop()
	_, err = lab.JoinClient(n, &Kubeadm{}, &nodestate.Lock{}).Join(short, prepared)
	if err != nil && !opensWith(t, n.Volume.Path(), prepared.InitialKey) {
		t.Errorf("%s: the disk lost its initial key in a join that failed", n.Name)
	}
	return err
}

func waitForLog(t *testing.T, lab *Lab, text string) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !strings.Contains(lab.Logs.String(), text) {
		if time.Now().After(deadline) {
			t.Fatal(lab.Logs.Logf("no %q in the log", text))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func readKubeletCert(t *testing.T, n *Node) *x509.Certificate {
	t.Helper()
	data, err := os.ReadFile(joinclient.KubeletCertPath(n.Paths))
	if err != nil {
		t.Fatal(err)
	}
	block, _ := pem.Decode(data)
	if block == nil || block.Type != "CERTIFICATE" {
		t.Fatalf("kubelet certificate file starts with %v", block)
	}
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	return cert
}
