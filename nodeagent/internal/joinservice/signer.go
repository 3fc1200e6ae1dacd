package joinservice

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"net"
	"time"

	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/nodeagent/internal/cfssl"
)

// caSigner signs with a CA key the service holds: the cluster CA of a cluster Berth initialized.
type caSigner struct {
	ca    *pki.CA
	clock func() time.Time
}

func (s caSigner) SignKubelet(_ context.Context, csr *x509.CertificateRequest, node string, ips []net.IP) (*x509.Certificate, error) {
	now := s.clock()
	return s.ca.IssueClient(pki.ClientTemplate{
		CommonName:   nodeUserPrefix + node,
		Organization: []string{nodesGroup},
		IPAddresses:  ips,
	}, csr.PublicKey, now, min(kubeletCertValidity, s.ca.Cert.NotAfter.Sub(now)))
}

// CFSSLSigner signs kubelet client certificates through a CFSSL remote signer, whose profile sets their
// usages and lifetime and whose database records them; the CA key never reaches the join service. The
// subject and addresses are the service's, whatever the CSR says, and cfssl.Signer checks that the
// certificate carries exactly those and the CSR's key.
type CFSSLSigner struct {
	Signer *cfssl.Signer
}

func (s CFSSLSigner) SignKubelet(ctx context.Context, csr *x509.CertificateRequest, node string, ips []net.IP) (*x509.Certificate, error) {
	hosts := make([]string, len(ips))
	for i, ip := range ips {
		hosts[i] = ip.String()
	}
	return s.Signer.Sign(ctx, cfssl.Request{
		CSR:     pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: csr.Raw}),
		Hosts:   hosts,
		Subject: cfssl.Subject{CommonName: nodeUserPrefix + node, Organization: []string{nodesGroup}},
	})
}
