package tlstest

import (
	"crypto/tls"
	"crypto/x509"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
)

// TestServerCertificate serves with the certificate and reaches the server trusting only the CA: by the
// address it was made for, and not by another name.
func TestServerCertificate(t *testing.T) {
	cert, caPEM, err := ServerCertificate("127.0.0.1", "tlstest CA")
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	srv.TLS = &tls.Config{Certificates: []tls.Certificate{cert}}
	srv.StartTLS()
	defer srv.Close()
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		t.Fatal("the CA is not PEM")
	}
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	resp, err := client.Get(srv.URL)
	if err != nil {
		t.Fatalf("GET by the certificate's address: %v", err)
	}
	resp.Body.Close()
	_, port, _ := net.SplitHostPort(srv.Listener.Addr().String())
	if resp, err := client.Get("https://localhost:" + port); err == nil {
		resp.Body.Close()
		t.Error("GET by a name the certificate does not hold succeeded")
	}
}
