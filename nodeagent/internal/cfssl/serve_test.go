package cfssl

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/berthlabs/berth/test/cfssltest"
)

// caCSR returns a CSR that asks for a CA certificate, which the kubelet profile must refuse.
func caCSR(t testing.TB) []byte {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	bc, err := asn1.Marshal(struct {
		IsCA       bool `asn1:"optional"`
		MaxPathLen int  `asn1:"optional,default:-1"`
	}{IsCA: true, MaxPathLen: -1})
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		Subject:         pkix.Name{CommonName: "node"},
		ExtraExtensions: []pkix.Extension{{Id: asn1.ObjectIdentifier{2, 5, 29, 19}, Critical: true, Value: bc}},
	}, key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der})
}

func TestCFSSLServe(t *testing.T) {
	srv := cfssltest.Start(t)
	key, err := ParseAuthKey(srv.AuthKeyHex)
	if err != nil {
		t.Fatal(err)
	}
	// The node asks for more than it may have; the join service's subject wins.
	csrPEM, csrKey := newCSR(t, pkix.Name{CommonName: "system:node:impostor", Organization: []string{"system:masters"}})
	req := Request{CSR: csrPEM, Subject: Subject{CommonName: "system:node:worker-1", Organization: []string{"system:nodes"}}}
	signer := &Signer{URL: srv.URL, Profile: srv.Profile, AuthKey: key}

	t.Run("signs", func(t *testing.T) {
		cert, err := signer.Sign(context.Background(), req)
		if err != nil {
			t.Fatalf("Sign: %v\ncfssl log:\n%s", err, srv.Log())
		}
		if err := cert.CheckSignatureFrom(srv.CA); err != nil || !bytes.Equal(cert.RawIssuer, srv.CA.RawSubject) {
			t.Errorf("certificate issued by %q is not signed by the CFSSL CA %q: %v", cert.Issuer, srv.CA.Subject, err)
		}
		if cert.Subject.CommonName != "system:node:worker-1" || !slices.Equal(cert.Subject.Organization, []string{"system:nodes"}) {
			t.Errorf("subject %q, want CN=system:node:worker-1, O=system:nodes", cert.Subject)
		}
		if !csrKey.PublicKey.Equal(cert.PublicKey) {
			t.Error("certificate key is not the CSR's")
		}
		if !slices.Equal(cert.ExtKeyUsage, []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}) || cert.NotAfter.Sub(cert.NotBefore) != 24*time.Hour {
			t.Errorf("usages %v, validity %v; want client auth for 24h as the kubelet profile says", cert.ExtKeyUsage, cert.NotAfter.Sub(cert.NotBefore))
		}
		got, ok := srv.Recorded(t, cert.SerialNumber)
		want := cfssltest.Record{CommonName: "system:node:worker-1", Status: "good", AuthorityKeyID: hex.EncodeToString(cert.AuthorityKeyId)}
		if !ok || got != want {
			t.Errorf("certificate database row for serial %s is %+v (found: %t), want %+v", cert.SerialNumber, got, ok, want)
		}
	})

	t.Run("wrong auth key", func(t *testing.T) {
		wrong := make([]byte, len(key))
		if _, err := rand.Read(wrong); err != nil {
			t.Fatal(err)
		}
		s := *signer
		s.AuthKey = wrong
		_, err = s.Sign(context.Background(), req)
		if !errors.Is(err, ErrAuthentication) || !strings.Contains(err.Error(), `"invalid token"`) {
			t.Fatalf("Sign with a wrong key: %v, want the authentication error with CFSSL's \"invalid token\"", err)
		}
		t.Logf("as an operator sees it: %v", err)
		assertNoSecrets(t, err.Error(), wrong, csrPEM)
		assertNoSecrets(t, err.Error(), key, csrPEM)
	})

	t.Run("policy refusal", func(t *testing.T) {
		_, err := signer.Sign(context.Background(), Request{CSR: caCSR(t), Subject: req.Subject})
		var e *Error
		// 5300 is CFSSL's policy error category (5000) with reason invalid request (300).
		if !errors.Is(err, ErrRefused) || !errors.As(err, &e) || e.Code != 5300 {
			t.Fatalf("Sign of a CA CSR: %v, want CFSSL's policy error 5300", err)
		}
		t.Logf("as an operator sees it: %v", err)
	})

	t.Run("unauthenticated endpoints disabled", func(t *testing.T) {
		for _, ep := range []string{"sign", "newcert"} {
			resp, err := http.Post(srv.URL+"/api/v1/cfssl/"+ep, "application/json", strings.NewReader(`{}`))
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusNotFound {
				t.Errorf("POST /api/v1/cfssl/%s answered %s, want 404 with -disable", ep, resp.Status)
			}
		}
	})

	t.Run("stopped", func(t *testing.T) {
		srv.Stop()
		_, err := signer.Sign(context.Background(), req)
		want := "CFSSL at " + srv.URL + " is unreachable: "
		if !errors.Is(err, ErrUnreachable) || !strings.HasPrefix(err.Error(), want) {
			t.Fatalf("Sign with cfssl stopped: %v, want %q…", err, want)
		}
		t.Logf("as an operator sees it: %v", err)
	})

	t.Run("restarted", func(t *testing.T) {
		srv.Restart(t)
		cert, err := signer.Sign(context.Background(), req)
		if err != nil {
			t.Fatalf("Sign after restart: %v\ncfssl log:\n%s", err, srv.Log())
		}
		if rec, ok := srv.Recorded(t, cert.SerialNumber); !ok || rec.Status != "good" {
			t.Errorf("after restart the database has %+v (found %v)", rec, ok)
		}
	})
}
