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
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// repoRoot is the repository's root, found from this file's path.
func repoRoot(t testing.TB) string {
	t.Helper()
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		t.Fatal("cannot locate this test's source file to find the repository")
	}
	return filepath.Join(filepath.Dir(file), "..", "..")
}

// cfsslBinary returns the cfssl binary of $BERTH_CFSSL_BIN (a bin directory) or else of
// scripts/build-cfssl.sh, which builds it on first use.
func cfsslBinary(t testing.TB) string {
	t.Helper()
	dir := os.Getenv("BERTH_CFSSL_BIN")
	if dir == "" {
		var stdout, stderr bytes.Buffer
		cmd := exec.Command(filepath.Join(repoRoot(t), "scripts", "build-cfssl.sh"))
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := cmd.Run(); err != nil {
			t.Fatalf("scripts/build-cfssl.sh failed (it needs go, gcc for cfssl's sqlite driver, and the Go module proxy or cache): %v\n%s", err, stderr.String())
		}
		lines := strings.Split(strings.TrimSpace(stdout.String()), "\n")
		dir = lines[len(lines)-1]
	}
	bin := filepath.Join(dir, "cfssl")
	if fi, err := os.Stat(bin); err != nil || fi.Mode()&0o111 == 0 {
		t.Fatalf("cfssl not found as an executable at %s (BERTH_CFSSL_BIN=%q): run scripts/build-cfssl.sh", bin, os.Getenv("BERTH_CFSSL_BIN"))
	}
	return bin
}

func lookTool(t testing.TB, name, hint string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		t.Fatalf("%s not found: %s", name, hint)
	}
	return p
}

// cfsslSchema returns the SQL that creates cfssl's sqlite certificate database: the "Up" parts of the
// migrations of the cfssl version pinned in test/cfssltools, in order.
func cfsslSchema(t testing.TB) string {
	t.Helper()
	gobin := lookTool(t, "go", "the Go toolchain is needed to find cfssl's module")
	cmd := exec.Command(gobin, "mod", "download", "-json", "github.com/cloudflare/cfssl")
	cmd.Dir = filepath.Join(repoRoot(t), "test", "cfssltools")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go mod download github.com/cloudflare/cfssl in test/cfssltools: %v\n%s", err, out)
	}
	var mod struct{ Dir string }
	if err := json.Unmarshal(out, &mod); err != nil || mod.Dir == "" {
		t.Fatalf("go mod download printed no module directory: %v\n%s", err, out)
	}
	files, err := filepath.Glob(filepath.Join(mod.Dir, "certdb", "sqlite", "migrations", "*.sql"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no sqlite migrations in %s: %v", mod.Dir, err)
	}
	slices.Sort(files)
	var sql strings.Builder
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		_, up, ok := strings.Cut(string(b), "-- +goose Up")
		if !ok {
			t.Fatalf("%s has no goose Up section", f)
		}
		up, _, _ = strings.Cut(up, "-- +goose Down")
		sql.WriteString(up)
	}
	return sql.String()
}

// sqlite runs one statement with the sqlite3 CLI and returns its output.
func sqlite(t testing.TB, db, stmt string) string {
	t.Helper()
	cmd := exec.Command(lookTool(t, "sqlite3", "run scripts/install-deps.sh (Debian package sqlite3)"), db)
	cmd.Stdin = strings.NewReader(stmt)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("sqlite3 %s: %v\n%s", db, err, out)
	}
	return strings.TrimSpace(string(out))
}

// writeCA writes a self-signed ECDSA CA as cfssl serve reads it and returns its certificate.
func writeCA(t testing.TB, dir string) *x509.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "Berth test kubelet CA", Organization: []string{"berth-test"}},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(48 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(dir, "ca.pem"), pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
	writeFile(t, filepath.Join(dir, "ca-key.pem"), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}))
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return cert
}

func writeFile(t testing.TB, path string, data []byte) {
	t.Helper()
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
}

func randomKeyHex(t testing.TB) string {
	t.Helper()
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

// unauthenticatedEndpoints are the cfssl serve endpoints that sign, revoke or write the database without
// an auth key, or fetch from the network: a signer for the join service must serve none of them.
var unauthenticatedEndpoints = []string{
	"sign", "newcert", "newkey", "init_ca", "revoke", "certadd", "gencrl", "crl", "ocspsign",
	"bundle", "scan", "scaninfo", "certinfo", "info",
}

// syncBuffer collects cfssl's log for failure messages.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// cfsslServer is a running cfssl serve.
type cfsslServer struct {
	url    string
	db     string
	ca     *x509.Certificate
	keyHex string
	log    *syncBuffer
	stop   func()
}

// startCFSSL runs cfssl serve on 127.0.0.1 with a fresh CA, a sqlite certificate database and a "kubelet"
// profile (client auth, 24h) that requires keyHex; the default profile requires another key, so no request
// signs without authentication.
func startCFSSL(t *testing.T) *cfsslServer {
	t.Helper()
	bin := cfsslBinary(t)
	dir := t.TempDir()
	s := &cfsslServer{ca: writeCA(t, dir), keyHex: randomKeyHex(t), db: filepath.Join(dir, "certs.db"), log: &syncBuffer{}}

	sqlite(t, s.db, cfsslSchema(t))
	dbConfig, err := json.Marshal(map[string]string{"driver": "sqlite3", "data_source": s.db})
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(dir, "db.json"), dbConfig)
	config := fmt.Sprintf(`{
  "signing": {
    "default": {"expiry": "1h", "usages": ["digital signature"], "auth_key": "default"},
    "profiles": {
      "kubelet": {"expiry": "24h", "usages": ["digital signature", "key encipherment", "client auth"], "auth_key": "kubelet"}
    }
  },
  "auth_keys": {
    "default": {"type": "standard", "key": %q},
    "kubelet": {"type": "standard", "key": %q}
  }
}`, randomKeyHex(t), s.keyHex)
	writeFile(t, filepath.Join(dir, "config.json"), []byte(config))

	// cfssl takes a port, not a listener: reserve a free one and release it just before.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	s.url = "http://127.0.0.1:" + strconv.Itoa(port)

	cmd := exec.Command(bin, "serve", "-address", "127.0.0.1", "-port", strconv.Itoa(port),
		"-ca", filepath.Join(dir, "ca.pem"), "-ca-key", filepath.Join(dir, "ca-key.pem"),
		"-config", filepath.Join(dir, "config.json"), "-db-config", filepath.Join(dir, "db.json"),
		"-disable", strings.Join(unauthenticatedEndpoints, ","))
	cmd.Stdout, cmd.Stderr = s.log, s.log
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting cfssl serve: %v", err)
	}
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(exited)
	}()
	var once sync.Once
	s.stop = func() {
		once.Do(func() {
			_ = cmd.Process.Kill()
			<-exited
		})
	}
	t.Cleanup(s.stop)

	// Ready when health answers; a cfssl that exits or never answers fails the test.
	deadline := time.Now().Add(20 * time.Second)
	for {
		resp, err := http.Get(s.url + "/api/v1/cfssl/health")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return s
			}
		}
		select {
		case <-exited:
			t.Fatalf("cfssl serve exited before it was ready:\n%s", s.log)
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("cfssl serve did not answer on %s within 20s:\n%s", s.url, s.log)
		}
	}
}

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
	srv := startCFSSL(t)
	key, err := ParseAuthKey(srv.keyHex)
	if err != nil {
		t.Fatal(err)
	}
	// The node asks for more than it may have; the join service's subject wins.
	csrPEM, csrKey := newCSR(t, pkix.Name{CommonName: "system:node:impostor", Organization: []string{"system:masters"}})
	req := Request{CSR: csrPEM, Subject: Subject{CommonName: "system:node:worker-1", Organization: []string{"system:nodes"}}}
	signer := &Signer{URL: srv.url, Profile: "kubelet", AuthKey: key}

	t.Run("signs", func(t *testing.T) {
		cert, err := signer.Sign(context.Background(), req)
		if err != nil {
			t.Fatalf("Sign: %v\ncfssl log:\n%s", err, srv.log)
		}
		if err := cert.CheckSignatureFrom(srv.ca); err != nil || !bytes.Equal(cert.RawIssuer, srv.ca.RawSubject) {
			t.Errorf("certificate issued by %q is not signed by the CFSSL CA %q: %v", cert.Issuer, srv.ca.Subject, err)
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
		// CFSSL records the serial in decimal and the issuer's key id in hex.
		got := sqlite(t, srv.db, fmt.Sprintf("SELECT common_name, status, authority_key_identifier FROM certificates WHERE serial_number = '%s';", cert.SerialNumber))
		want := "system:node:worker-1|good|" + hex.EncodeToString(cert.AuthorityKeyId)
		if got != want {
			t.Errorf("certificate database row for serial %s is %q, want %q", cert.SerialNumber, got, want)
		}
	})

	t.Run("wrong auth key", func(t *testing.T) {
		wrong, err := ParseAuthKey(randomKeyHex(t))
		if err != nil {
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
			resp, err := http.Post(srv.url+"/api/v1/cfssl/"+ep, "application/json", strings.NewReader(`{}`))
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
		srv.stop()
		_, err := signer.Sign(context.Background(), req)
		want := "CFSSL at " + srv.url + " is unreachable: "
		if !errors.Is(err, ErrUnreachable) || !strings.HasPrefix(err.Error(), want) {
			t.Fatalf("Sign with cfssl stopped: %v, want %q…", err, want)
		}
		t.Logf("as an operator sees it: %v", err)
	})
}
