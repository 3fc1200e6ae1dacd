// Package cfssltest runs a real CFSSL remote signer (`cfssl serve`) on loopback for tests, built by
// scripts/build-cfssl.sh at the version pinned in test/cfssltools, so that the CFSSL client and the join
// service are tested against the signer that operators run and not against a fake of its API. Each server
// gets a fresh CA, a sqlite certificate database made from cfssl's own migrations, a "kubelet" profile
// behind an auth key, and every unauthenticated endpoint disabled, as a signer for the join service must be
// set up.
package cfssltest

import (
	"cmp"
	"crypto/rand"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/repotest"
	"github.com/berthlabs/berth/test/clustertest"
)

// Server is a running cfssl serve on 127.0.0.1.
type Server struct {
	URL        string            // http://127.0.0.1:<port>
	Profile    string            // "kubelet": client auth, 24h unless Options say otherwise
	AuthKey    []byte            // the kubelet profile's key
	AuthKeyHex string            // the same key as cfssl's config and an operator write it
	CA         *x509.Certificate // the CA it signs with
	DB         string            // the sqlite certificate database

	log     *clustertest.SafeBuffer
	bin     string
	args    []string
	mu      sync.Mutex
	process *os.Process
	exited  chan struct{}
}

// Options change what StartWith runs; the zero value is what Start runs.
type Options struct {
	// CA, key included, is the CA cfssl signs with instead of a fresh one: a test's cluster CA, whose API
	// server accepts the kubelet certificates cfssl signs.
	CA *pki.CA
	// KubeletExpiry and KubeletBackdate are the kubelet profile's certificate lifetime and how far before
	// the signing its certificates start, in cfssl's duration syntax; "24h" and cfssl's default (5m) if empty.
	KubeletExpiry, KubeletBackdate string
}

// unauthenticatedEndpoints are the cfssl serve endpoints that sign, revoke or write the database without
// an auth key, or fetch from the network: a signer for the join service must serve none of them.
var unauthenticatedEndpoints = []string{
	"sign", "newcert", "newkey", "init_ca", "revoke", "certadd", "gencrl", "crl", "ocspsign",
	"bundle", "scan", "scaninfo", "certinfo", "info",
}

// Start runs cfssl serve with a fresh CA, a sqlite certificate database and the kubelet profile; the
// default profile requires another key, so no request signs without the kubelet key. It is stopped when
// the test ends.
func Start(t testing.TB) *Server {
	t.Helper()
	return StartWith(t, Options{})
}

// StartWith is Start with options.
func StartWith(t testing.TB, o Options) *Server {
	t.Helper()
	bin := binary(t)
	dir := t.TempDir()
	keyHex := randomKeyHex(t)
	key, err := hex.DecodeString(keyHex)
	if err != nil {
		t.Fatal(err)
	}
	s := &Server{
		Profile:    "kubelet",
		AuthKey:    key,
		AuthKeyHex: keyHex,
		CA:         writeCA(t, dir, o.CA),
		DB:         filepath.Join(dir, "certs.db"),
		log:        &clustertest.SafeBuffer{},
		bin:        bin,
	}

	sqlite(t, s.DB, schema(t))
	dbConfig, err := json.Marshal(map[string]string{"driver": "sqlite3", "data_source": s.DB})
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(dir, "db.json"), dbConfig)
	config := fmt.Sprintf(`{
  "signing": {
    "default": {"expiry": "1h", "usages": ["digital signature"], "auth_key": "default"},
    "profiles": {
      %q: {"expiry": %q, "backdate": %q, "usages": ["digital signature", "key encipherment", "client auth"], "auth_key": "kubelet"}
    }
  },
  "auth_keys": {
    "default": {"type": "standard", "key": %q},
    "kubelet": {"type": "standard", "key": %q}
  }
}`, s.Profile, cmp.Or(o.KubeletExpiry, "24h"), o.KubeletBackdate, randomKeyHex(t), keyHex)
	writeFile(t, filepath.Join(dir, "config.json"), []byte(config))

	// cfssl takes a port, not a listener: reserve a free one and release it just before.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	s.URL = "http://127.0.0.1:" + strconv.Itoa(port)

	s.args = []string{"serve", "-address", "127.0.0.1", "-port", strconv.Itoa(port),
		"-ca", filepath.Join(dir, "ca.pem"), "-ca-key", filepath.Join(dir, "ca-key.pem"),
		"-config", filepath.Join(dir, "config.json"), "-db-config", filepath.Join(dir, "db.json"),
		"-disable", strings.Join(unauthenticatedEndpoints, ",")}
	t.Cleanup(s.Stop)
	s.run(t)
	return s
}

// Restart starts cfssl serve again on the same address, CA, configuration and database after Stop.
func (s *Server) Restart(t testing.TB) {
	t.Helper()
	s.Stop()
	s.run(t)
}

// run starts cfssl serve and waits until it answers; a cfssl that exits or never answers fails the test.
func (s *Server) run(t testing.TB) {
	t.Helper()
	cmd := exec.Command(s.bin, s.args...)
	cmd.Stdout, cmd.Stderr = s.log, s.log
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting cfssl serve: %v", err)
	}
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(exited)
	}()
	s.mu.Lock()
	s.process, s.exited = cmd.Process, exited
	s.mu.Unlock()

	deadline := time.Now().Add(20 * time.Second)
	for {
		resp, err := http.Get(s.URL + "/api/v1/cfssl/health")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		select {
		case <-exited:
			t.Fatalf("cfssl serve exited before it was ready:\n%s", s.log)
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("cfssl serve did not answer on %s within 20s:\n%s", s.URL, s.log)
		}
	}
}

// Stop kills cfssl serve and waits until it has exited, for tests of a signer that is down; stopping
// again does nothing.
func (s *Server) Stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.process == nil {
		return
	}
	_ = s.process.Kill()
	<-s.exited
	s.process = nil
}

// Log is what cfssl has logged so far, for failure messages.
func (s *Server) Log() string { return s.log.String() }

// Record is a certificate's row in the certificate database.
type Record struct {
	CommonName     string
	Status         string // "good", "revoked"
	AuthorityKeyID string // hex, as CFSSL writes it
}

// Recorded returns the database row of the certificate with this serial, and whether there is one.
func (s *Server) Recorded(t testing.TB, serial *big.Int) (Record, bool) {
	t.Helper()
	// CFSSL records the serial in decimal; big.Int's decimal form is digits only, safe to quote in SQL.
	out := sqlite(t, s.DB, fmt.Sprintf(".mode json\nSELECT common_name, status, authority_key_identifier FROM certificates WHERE serial_number = '%s';", serial))
	if out == "" {
		return Record{}, false
	}
	var rows []struct {
		CommonName     string `json:"common_name"`
		Status         string `json:"status"`
		AuthorityKeyID string `json:"authority_key_identifier"`
	}
	if err := json.Unmarshal([]byte(out), &rows); err != nil {
		t.Fatalf("sqlite3 printed no JSON rows for serial %s: %v\n%s", serial, err, out)
	}
	if len(rows) != 1 {
		t.Fatalf("certificate database has %d rows for serial %s, want at most one (the test CA is the only issuer)", len(rows), serial)
	}
	return Record(rows[0]), true
}

// binary returns the cfssl binary of $BERTH_CFSSL_BIN (a bin directory) or else of
// scripts/build-cfssl.sh, which builds it on first use.
func binary(t testing.TB) string {
	t.Helper()
	dir := repotest.BinDir(t, "BERTH_CFSSL_BIN", "build-cfssl.sh", "it needs go, gcc for cfssl's sqlite driver, and the Go module proxy or cache")
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

// schema returns the SQL that creates cfssl's sqlite certificate database: the "Up" parts of the
// migrations of the cfssl version pinned in test/cfssltools, in order.
func schema(t testing.TB) string {
	t.Helper()
	gobin := lookTool(t, "go", "the Go toolchain is needed to find cfssl's module")
	cmd := exec.Command(gobin, "mod", "download", "-json", "github.com/cloudflare/cfssl")
	cmd.Dir = filepath.Join(repotest.Root(t), "test", "cfssltools")
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

// sqlite runs statements with the sqlite3 CLI and returns its output.
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

// writeCA writes ca, or a fresh CA if nil, as cfssl serve reads it (PEM certificate, PKCS#8 key) and
// returns its certificate.
func writeCA(t testing.TB, dir string, ca *pki.CA) *x509.Certificate {
	t.Helper()
	if ca == nil {
		var err error
		if ca, err = pki.NewCA("Berth test kubelet CA", time.Now(), 48*time.Hour); err != nil {
			t.Fatal(err)
		}
	}
	key, err := ca.KeyPEM()
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(dir, "ca.pem"), ca.CertPEM())
	writeFile(t, filepath.Join(dir, "ca-key.pem"), key)
	return ca.Cert
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
