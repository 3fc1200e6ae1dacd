package joinserver

import (
	"crypto/tls"
	"fmt"
	"log/slog"
	"net"
	"os"
	"time"

	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/nodeagent/internal/cfssl"
	"github.com/berthlabs/berth/nodeagent/internal/joinservice"
)

// CFSSLConfig names a CFSSL remote signer (`cfssl serve`) and the signing profile for kubelet client
// certificates.
type CFSSLConfig struct {
	// URL is CFSSL's base URL, such as http://10.0.0.5:8888.
	URL string `json:"url"`
	// Profile is the signing profile; its auth_key is the one in AuthKeyFile.
	Profile string `json:"profile"`
	// AuthKeyFile holds the profile's HMAC key in hexadecimal, as CFSSL's config has it.
	AuthKeyFile string `json:"authKeyFile"`
	// Label picks the signer of a CFSSL with several; empty for one.
	Label string `json:"label,omitempty"`
}

// KubeletSigning is the Kubernetes CA (certificate file, and key file unless c configures a CFSSL) and,
// with a CFSSL, the signer of kubelet certificates; then the CA's key is not read, and need not be on
// this machine.
func KubeletSigning(certFile, keyFile string, c *CFSSLConfig, log *slog.Logger) (*pki.CA, joinservice.KubeletSigner, error) {
	certPEM, err := os.ReadFile(certFile)
	if err != nil {
		return nil, nil, fmt.Errorf("Kubernetes CA: %w", err)
	}
	if c == nil {
		key, err := os.ReadFile(keyFile)
		if err != nil {
			return nil, nil, fmt.Errorf("Kubernetes CA: %w (configure cfssl to sign kubelet certificates without it)", err)
		}
		ca, err := pki.ParseCA(certPEM, key)
		if err != nil {
			return nil, nil, fmt.Errorf("Kubernetes CA: %w", err)
		}
		return ca, nil, nil
	}
	cert, err := pki.ParseCertPEM(certPEM)
	if err != nil {
		return nil, nil, fmt.Errorf("Kubernetes CA %s: %w", certFile, err)
	}
	hexKey, err := os.ReadFile(c.AuthKeyFile)
	if err != nil {
		return nil, nil, fmt.Errorf("CFSSL auth key: %w", err)
	}
	key, err := cfssl.ParseAuthKey(string(hexKey))
	if err != nil {
		return nil, nil, fmt.Errorf("CFSSL auth key %s: %w", c.AuthKeyFile, err)
	}
	signer := &cfssl.Signer{URL: c.URL, Profile: c.Profile, AuthKey: key, Label: c.Label,
		Logger: log.With("component", "cfssl")}
	return &pki.CA{Cert: cert}, joinservice.CFSSLSigner{Signer: signer}, nil
}

// serverCert issues the join service's certificate, with the join CA in the chain so that nodes holding
// only the CA's pin can verify it.
func serverCert(ca *pki.CA, names []string, ips []net.IP) (tls.Certificate, error) {
	key, err := pki.NewKey()
	if err != nil {
		return tls.Certificate{}, err
	}
	now := time.Now()
	leaf, err := ca.IssueServer(key.Public(), names, ips, now, min(serverCertValidity, ca.Cert.NotAfter.Sub(now)))
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.Certificate{Certificate: [][]byte{leaf.Raw, ca.Cert.Raw}, PrivateKey: key, Leaf: leaf}, nil
}
