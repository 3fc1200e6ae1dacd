package pki

import (
	"bytes"
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"k8s.io/kubernetes/cmd/kubeadm/app/util/pubkeypin"
)

var t0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

const (
	caValidity   = 10 * 365 * 24 * time.Hour
	leafValidity = 24 * time.Hour
	joinName     = "join.berth.internal"
)

func mustCA(t *testing.T, cn string) *CA {
	t.Helper()
	ca, err := NewCA(cn, t0, caValidity)
	if err != nil {
		t.Fatalf("NewCA(%q): %v", cn, err)
	}
	return ca
}

func mustKey(t *testing.T) *ecdsa.PrivateKey {
	t.Helper()
	k, err := NewKey()
	if err != nil {
		t.Fatalf("NewKey: %v", err)
	}
	return k
}

func mustServer(t *testing.T, ca *CA, key *ecdsa.PrivateKey) *x509.Certificate {
	t.Helper()
	c, err := ca.IssueServer(key.Public(), []string{joinName}, []net.IP{net.ParseIP("127.0.0.1")}, t0, leafValidity)
	if err != nil {
		t.Fatalf("IssueServer: %v", err)
	}
	return c
}

func TestNewCA(t *testing.T) {
	ca := mustCA(t, "berth join CA")
	c := ca.Cert
	if !c.IsCA || !c.BasicConstraintsValid || c.MaxPathLen != 0 || !c.MaxPathLenZero {
		t.Fatalf("CA constraints: IsCA %v, valid %v, MaxPathLen %d, zero %v", c.IsCA, c.BasicConstraintsValid, c.MaxPathLen, c.MaxPathLenZero)
	}
	if c.KeyUsage&x509.KeyUsageCertSign == 0 {
		t.Fatal("CA lacks certSign key usage")
	}
	if c.Subject.CommonName != "berth join CA" {
		t.Fatalf("CN = %q", c.Subject.CommonName)
	}
	if err := c.CheckSignatureFrom(c); err != nil {
		t.Fatalf("CA is not self-signed: %v", err)
	}
	if c.PublicKeyAlgorithm != x509.ECDSA || c.PublicKey.(*ecdsa.PublicKey).Curve != elliptic.P256() {
		t.Fatalf("CA key is %v, want ECDSA P-256", c.PublicKeyAlgorithm)
	}
	if !c.NotBefore.Before(t0) || !c.NotAfter.Equal(t0.Add(caValidity)) {
		t.Fatalf("validity %v .. %v, want from before %v to %v", c.NotBefore, c.NotAfter, t0, t0.Add(caValidity))
	}
	if len(c.SubjectKeyId) == 0 {
		t.Fatal("CA has no subject key id")
	}
}

func TestSerialNumbers(t *testing.T) {
	ca := mustCA(t, "serials")
	key := mustKey(t)
	limit := new(big.Int).Add(new(big.Int).Lsh(big.NewInt(1), 128), big.NewInt(1))
	seen := map[string]bool{ca.Cert.SerialNumber.String(): true}
	for range 20 {
		c := mustServer(t, ca, key)
		s := c.SerialNumber
		if s.Sign() <= 0 || s.Cmp(limit) > 0 {
			t.Fatalf("serial %v out of (0, 2^128+1]", s)
		}
		if seen[s.String()] {
			t.Fatalf("serial %v repeated", s)
		}
		seen[s.String()] = true
	}
}

func TestNewCARefusals(t *testing.T) {
	tests := []struct {
		name     string
		cn       string
		now      time.Time
		validity time.Duration
		wantErr  string
	}{
		{"empty name", "", t0, time.Hour, "empty common name"},
		{"zero validity", "x", t0, 0, "validity 0s is not positive"},
		{"negative validity", "x", t0, -time.Hour, "not positive"},
		{"zero time", "x", time.Time{}, time.Hour, "current time is zero"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := NewCA(tt.cn, tt.now, tt.validity)
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("NewCA error = %v, want one containing %q", err, tt.wantErr)
			}
		})
	}
}

func TestCAPEMRoundTrip(t *testing.T) {
	ca := mustCA(t, "round trip")
	keyPEM, err := ca.KeyPEM()
	if err != nil {
		t.Fatalf("KeyPEM: %v", err)
	}
	if !bytes.HasPrefix(keyPEM, []byte("-----BEGIN PRIVATE KEY-----\n")) {
		t.Fatalf("key PEM does not start with a PKCS#8 header: %.40q", keyPEM)
	}
	if !bytes.HasPrefix(ca.CertPEM(), []byte("-----BEGIN CERTIFICATE-----\n")) {
		t.Fatal("cert PEM does not start with a certificate header")
	}
	got, err := ParseCA(ca.CertPEM(), keyPEM)
	if err != nil {
		t.Fatalf("ParseCA: %v", err)
	}
	if !bytes.Equal(got.Cert.Raw, ca.Cert.Raw) {
		t.Fatal("parsed certificate differs")
	}
	// The parsed key must be able to issue certificates that chain to the original.
	leaf := mustServer(t, got, mustKey(t))
	if err := leaf.CheckSignatureFrom(ca.Cert); err != nil {
		t.Fatalf("certificate issued by the parsed CA: %v", err)
	}
}

func TestParseCARefusals(t *testing.T) {
	ca := mustCA(t, "real")
	other := mustCA(t, "other")
	leafKey := mustKey(t)
	leaf := mustServer(t, ca, leafKey)
	caKeyPEM := mustKeyPEM(t, ca.Key)
	leafKeyPEM := mustKeyPEM(t, leafKey)
	sec1, err := x509.MarshalECPrivateKey(ca.Key.(*ecdsa.PrivateKey))
	if err != nil {
		t.Fatal(err)
	}
	sec1PEM := pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: sec1})

	tests := []struct {
		name    string
		cert    []byte
		key     []byte
		wantErr string
	}{
		{"key of another CA", ca.CertPEM(), mustKeyPEM(t, other.Key), "private key does not belong to the certificate"},
		{"leaf certificate", EncodeCertPEM(leaf), leafKeyPEM, "is not a CA certificate"},
		{"SEC1 key", ca.CertPEM(), sec1PEM, `PEM block is "EC PRIVATE KEY", want "PRIVATE KEY"`},
		{"key in cert slot", caKeyPEM, caKeyPEM, `PEM block is "PRIVATE KEY", want "CERTIFICATE"`},
		{"no PEM", []byte("not pem"), caKeyPEM, "no PEM block"},
		{"empty key", ca.CertPEM(), nil, "no PEM block"},
		{"two certificates", append(ca.CertPEM(), other.CertPEM()...), caKeyPEM, "more than one PEM block"},
		{"garbage DER", pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: []byte{1, 2, 3}}), caKeyPEM, "parsing certificate"},
		{"garbage key DER", ca.CertPEM(), pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: []byte{0x30, 0}}), "parsing private key"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseCA(tt.cert, tt.key)
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("ParseCA error = %v, want one containing %q", err, tt.wantErr)
			}
		})
	}
}

// mustKeyPEM encodes without EncodeKeyPEM, so that ParseCA is tested against independent input.
func mustKeyPEM(t *testing.T, k crypto.Signer) []byte {
	t.Helper()
	p, err := x509.MarshalPKCS8PrivateKey(k)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: p})
}

func TestKeyPEM(t *testing.T) {
	key := mustKey(t)
	p, err := EncodeKeyPEM(key)
	if err != nil {
		t.Fatalf("EncodeKeyPEM: %v", err)
	}
	got, err := ParseKeyPEM(p)
	if err != nil {
		t.Fatalf("ParseKeyPEM: %v", err)
	}
	if !got.(*ecdsa.PrivateKey).Equal(key) {
		t.Fatal("parsed key differs")
	}
	if _, err := EncodeKeyPEM(nil); err == nil {
		t.Fatal("EncodeKeyPEM(nil) succeeded")
	}

	_, edKey, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	p, err = EncodeKeyPEM(edKey)
	if err != nil {
		t.Fatalf("EncodeKeyPEM(ed25519): %v", err)
	}
	if _, err := ParseKeyPEM(p); err != nil {
		t.Fatalf("ParseKeyPEM(ed25519): %v", err)
	}
}

func TestCertPEM(t *testing.T) {
	ca := mustCA(t, "pem")
	got, err := ParseCertPEM(EncodeCertPEM(ca.Cert))
	if err != nil {
		t.Fatalf("ParseCertPEM: %v", err)
	}
	if !got.Equal(ca.Cert) {
		t.Fatal("round trip changed the certificate")
	}
	if _, err := ParseCertPEM(nil); err == nil || !strings.Contains(err.Error(), "no PEM block") {
		t.Fatalf("ParseCertPEM(nil) = %v", err)
	}
}

// checkOpenSSL fails the test when openssl is missing: it is the independent implementation the
// certificates are checked against.
func checkOpenSSL(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("openssl"); err != nil {
		t.Fatal("openssl not found: install it (apt-get install openssl); it is the independent check of pins and chains")
	}
}

func openssl(t *testing.T, stdin []byte, args ...string) []byte {
	t.Helper()
	cmd := exec.Command("openssl", args...)
	cmd.Stdin = bytes.NewReader(stdin)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("openssl %s: %v: %s", strings.Join(args, " "), err, stderr.String())
	}
	return out
}

func TestSPKIPinMatchesKubeadmAndOpenSSL(t *testing.T) {
	checkOpenSSL(t)
	ca := mustCA(t, "pin")
	pin := SPKIPin(ca.Cert)

	if want := pubkeypin.Hash(ca.Cert); pin != want {
		t.Fatalf("SPKIPin = %q, kubeadm's pubkeypin.Hash = %q", pin, want)
	}

	// The recipe of the kubeadm documentation, with pkey for an EC key.
	pubPEM := openssl(t, ca.CertPEM(), "x509", "-pubkey", "-noout")
	der := openssl(t, pubPEM, "pkey", "-pubin", "-outform", "der")
	dgst := strings.TrimSpace(string(openssl(t, der, "dgst", "-sha256", "-hex")))
	hexSum := dgst[strings.LastIndex(dgst, " ")+1:]
	if want := "sha256:" + hexSum; pin != want {
		t.Fatalf("SPKIPin = %q, openssl gives %q", pin, want)
	}

	spki, err := x509.MarshalPKIXPublicKey(ca.Key.Public())
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(spki)
	if want := "sha256:" + hex.EncodeToString(sum[:]); pin != want {
		t.Fatalf("SPKIPin = %q, hash of marshalled key = %q", pin, want)
	}

	set := pubkeypin.NewSet()
	if err := set.Allow(pin); err != nil {
		t.Fatalf("kubeadm refuses the pin: %v", err)
	}
	if err := set.CheckAny([]*x509.Certificate{ca.Cert}); err != nil {
		t.Fatalf("kubeadm's pin check refuses the CA: %v", err)
	}
}

func TestParsePin(t *testing.T) {
	good := "sha256:" + strings.Repeat("0123456789abcdef", 4)
	tests := []struct {
		name    string
		pin     string
		wantErr string
	}{
		{"good", good, ""},
		{"empty", "", "want the form sha256:"},
		{"no prefix", strings.Repeat("0123456789abcdef", 4), "want the form sha256:"},
		{"other algorithm", "sha1:" + strings.Repeat("ab", 20), "want the form sha256:"},
		{"uppercase prefix", "SHA256:" + strings.Repeat("0123456789abcdef", 4), "want the form sha256:"},
		{"uppercase hex", "sha256:" + strings.Repeat("0123456789ABCDEF", 4), "'A' is not a lowercase hex digit"},
		{"short", good[:len(good)-1], "63 hex digits, want 64"},
		{"long", good + "0", "65 hex digits, want 64"},
		{"non-hex", good[:len(good)-1] + "g", "'g' is not a lowercase hex digit"},
		{"space", good[:len(good)-1] + " ", "' ' is not a lowercase hex digit"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sum, err := ParsePin(tt.pin)
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("ParsePin: %v", err)
				}
				if hex.EncodeToString(sum) != tt.pin[len("sha256:"):] || len(sum) != 32 {
					t.Fatalf("ParsePin = %x", sum)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("ParsePin error = %v, want one containing %q", err, tt.wantErr)
			}
		})
	}
	if _, err := ParsePin(strings.Repeat("x", 5000)); err == nil || len(err.Error()) > 200 {
		t.Fatalf("a long wrong pin must give a short error, got %d bytes", len(err.Error()))
	}
}

func TestPinMatches(t *testing.T) {
	ca := mustCA(t, "a")
	other := mustCA(t, "b")
	pin := SPKIPin(ca.Cert)
	tests := []struct {
		name string
		pin  string
		cert *x509.Certificate
		want bool
	}{
		{"own pin", pin, ca.Cert, true},
		{"other CA", pin, other.Cert, false},
		{"malformed", pin[:20], ca.Cert, false},
		{"uppercase form of the right hash", "sha256:" + strings.ToUpper(pin[7:]), ca.Cert, false},
		{"nil cert", pin, nil, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := PinMatches(tt.pin, tt.cert); got != tt.want {
				t.Fatalf("PinMatches = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestIssueServer(t *testing.T) {
	ca := mustCA(t, "join CA")
	key := mustKey(t)
	ip := net.ParseIP("10.0.0.7")
	c, err := ca.IssueServer(key.Public(), []string{joinName, "other.example"}, []net.IP{ip}, t0, leafValidity)
	if err != nil {
		t.Fatalf("IssueServer: %v", err)
	}
	if c.IsCA {
		t.Fatal("server certificate is a CA")
	}
	if len(c.ExtKeyUsage) != 1 || c.ExtKeyUsage[0] != x509.ExtKeyUsageServerAuth || c.KeyUsage != x509.KeyUsageDigitalSignature {
		t.Fatalf("usages: ext %v, key %v", c.ExtKeyUsage, c.KeyUsage)
	}
	if c.Subject.CommonName != joinName || len(c.DNSNames) != 2 || !c.IPAddresses[0].Equal(ip) {
		t.Fatalf("names: CN %q, DNS %v, IP %v", c.Subject.CommonName, c.DNSNames, c.IPAddresses)
	}
	if !c.NotAfter.Equal(t0.Add(leafValidity)) {
		t.Fatalf("NotAfter = %v", c.NotAfter)
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca.Cert)
	for _, name := range []string{joinName, "other.example", "10.0.0.7"} {
		if _, err := c.Verify(x509.VerifyOptions{DNSName: name, Roots: roots, CurrentTime: t0, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
			t.Fatalf("verify for %q: %v", name, err)
		}
	}
	if _, err := c.Verify(x509.VerifyOptions{Roots: roots, CurrentTime: t0, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err == nil {
		t.Fatal("server certificate verifies for client auth")
	}

	byIP, err := ca.IssueServer(key.Public(), nil, []net.IP{ip}, t0, leafValidity)
	if err != nil {
		t.Fatalf("IssueServer with IP only: %v", err)
	}
	if byIP.Subject.CommonName != "10.0.0.7" {
		t.Fatalf("CN = %q, want the IP", byIP.Subject.CommonName)
	}
}

func TestIssueRefusals(t *testing.T) {
	ca := mustCA(t, "join CA")
	key := mustKey(t).Public()
	names := []string{joinName}
	tests := []struct {
		name    string
		ca      *CA
		key     any
		names   []string
		now     time.Time
		valid   time.Duration
		wantErr string
	}{
		{"no names", ca, key, nil, t0, time.Hour, "no DNS name or IP address"},
		{"nil key", ca, nil, names, t0, time.Hour, "no public key"},
		{"zero validity", ca, key, names, t0, 0, "not positive"},
		{"outlives CA", ca, key, names, t0, caValidity + time.Hour, "after CA \"join CA\" expires"},
		{"empty CA", &CA{}, key, names, t0, time.Hour, "CA has no certificate or key"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := tt.ca.IssueServer(tt.key, tt.names, nil, tt.now, tt.valid)
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("IssueServer error = %v, want one containing %q", err, tt.wantErr)
			}
		})
	}
	if _, err := ca.IssueClient(ClientTemplate{}, key, t0, time.Hour); err == nil || !strings.Contains(err.Error(), "empty common name") {
		t.Fatalf("IssueClient without CN: %v", err)
	}
}

func TestIssueClient(t *testing.T) {
	ca := mustCA(t, "kubernetes")
	key := mustKey(t)
	ip := net.ParseIP("10.0.0.8")
	c, err := ca.IssueClient(ClientTemplate{
		CommonName:   "system:node:worker-1",
		Organization: []string{"system:nodes"},
		IPAddresses:  []net.IP{ip},
		DNSNames:     []string{"worker-1"},
	}, key.Public(), t0, leafValidity)
	if err != nil {
		t.Fatalf("IssueClient: %v", err)
	}
	if c.Subject.CommonName != "system:node:worker-1" || len(c.Subject.Organization) != 1 || c.Subject.Organization[0] != "system:nodes" {
		t.Fatalf("subject %v", c.Subject)
	}
	if len(c.ExtKeyUsage) != 1 || c.ExtKeyUsage[0] != x509.ExtKeyUsageClientAuth || c.KeyUsage != x509.KeyUsageDigitalSignature {
		t.Fatalf("usages: ext %v, key %v", c.ExtKeyUsage, c.KeyUsage)
	}
	if !c.IPAddresses[0].Equal(ip) || c.DNSNames[0] != "worker-1" {
		t.Fatalf("SANs %v %v", c.IPAddresses, c.DNSNames)
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca.Cert)
	if _, err := c.Verify(x509.VerifyOptions{Roots: roots, CurrentTime: t0, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		t.Fatalf("verify as client: %v", err)
	}
	if _, err := c.Verify(x509.VerifyOptions{Roots: roots, CurrentTime: t0}); err == nil {
		t.Fatal("client certificate verifies for server auth")
	}
}

// TestChainVerifiesWithOpenSSL checks the issued chain with an independent X.509 implementation.
func TestChainVerifiesWithOpenSSL(t *testing.T) {
	checkOpenSSL(t)
	ca, err := NewCA("openssl check", time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	key := mustKey(t)
	server, err := ca.IssueServer(key.Public(), []string{joinName}, nil, time.Now(), 30*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	client, err := ca.IssueClient(ClientTemplate{CommonName: "admin", Organization: []string{"system:masters"}}, key.Public(), time.Now(), 30*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	write := func(name string, data []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, data, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	caFile := write("ca.pem", ca.CertPEM())
	serverFile := write("server.pem", EncodeCertPEM(server))
	clientFile := write("client.pem", EncodeCertPEM(client))
	keyPEM, err := ca.KeyPEM()
	if err != nil {
		t.Fatal(err)
	}
	openssl(t, nil, "pkey", "-in", write("ca-key.pem", keyPEM), "-noout")
	openssl(t, nil, "verify", "-CAfile", caFile, "-purpose", "sslserver", "-verify_hostname", joinName, serverFile)
	openssl(t, nil, "verify", "-CAfile", caFile, "-purpose", "sslclient", clientFile)

	cmd := exec.Command("openssl", "verify", "-CAfile", caFile, "-purpose", "sslserver", clientFile)
	if out, err := cmd.CombinedOutput(); err == nil {
		t.Fatalf("openssl accepts the client certificate as a server certificate: %s", out)
	}
}

type chainFixture struct {
	ca     *CA
	pin    string
	leaf   *x509.Certificate
	client *x509.Certificate
}

func newChainFixture(t *testing.T) chainFixture {
	t.Helper()
	ca := mustCA(t, "berth join CA")
	key := mustKey(t)
	client, err := ca.IssueClient(ClientTemplate{CommonName: joinName, DNSNames: []string{joinName}}, key.Public(), t0, leafValidity)
	if err != nil {
		t.Fatal(err)
	}
	return chainFixture{ca: ca, pin: SPKIPin(ca.Cert), leaf: mustServer(t, ca, key), client: client}
}

func TestVerifyPinnedChainAccepts(t *testing.T) {
	f := newChainFixture(t)
	unrelated := mustCA(t, "unrelated")
	tests := []struct {
		name       string
		chain      [][]byte
		serverName string
		now        time.Time
	}{
		{"leaf and CA", [][]byte{f.leaf.Raw, f.ca.Cert.Raw}, joinName, t0},
		{"by IP", [][]byte{f.leaf.Raw, f.ca.Cert.Raw}, "127.0.0.1", t0},
		{"CA after an unrelated certificate", [][]byte{f.leaf.Raw, unrelated.Cert.Raw, f.ca.Cert.Raw}, joinName, t0},
		{"within clock skew before issue", [][]byte{f.leaf.Raw, f.ca.Cert.Raw}, joinName, t0.Add(-time.Minute)},
		{"last second", [][]byte{f.leaf.Raw, f.ca.Cert.Raw}, joinName, f.leaf.NotAfter},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := VerifyPinnedChain(f.pin, tt.chain, tt.serverName, tt.now); err != nil {
				t.Fatalf("VerifyPinnedChain: %v", err)
			}
		})
	}
}

func TestVerifyPinnedChainRefuses(t *testing.T) {
	f := newChainFixture(t)

	// A CA the node did not pin, with a valid leaf of its own.
	wrong := mustCA(t, "berth join CA")
	wrongLeaf := mustServer(t, wrong, mustKey(t))

	// An attacker's CA with the same name as the pinned one signs a leaf, and sends it with the
	// genuine CA certificate: the pin matches, the signature does not.
	forged := mustServer(t, wrong, mustKey(t))

	// A leaf whose signed content (the subject's common name) was changed after signing.
	tampered := bytes.Clone(f.leaf.Raw)
	i := bytes.Index(tampered, []byte(joinName))
	if i < 0 {
		t.Fatal("name not found in leaf DER")
	}
	tampered[i+3] = 'm'

	// A pinned key that is not a CA: the leaf itself.
	leafPin := SPKIPin(f.leaf)

	tests := []struct {
		name       string
		pin        string
		chain      [][]byte
		serverName string
		now        time.Time
		wantErr    string
		check      func(error) bool
	}{
		{
			name: "wrong CA", pin: f.pin, chain: [][]byte{wrongLeaf.Raw, wrong.Cert.Raw}, serverName: joinName, now: t0,
			wantErr: "join service certificate is not signed by the pinned join CA (pin " + f.pin + "): the service sent CA certificates with pins " + SPKIPin(wrong.Cert),
		},
		{
			name: "no CA sent", pin: f.pin, chain: [][]byte{f.leaf.Raw}, serverName: joinName, now: t0,
			wantErr: "not signed by the pinned join CA (pin " + f.pin + "): the service sent no CA certificate",
		},
		{
			name: "forged leaf with genuine CA", pin: f.pin, chain: [][]byte{forged.Raw, f.ca.Cert.Raw}, serverName: joinName, now: t0,
			wantErr: "does not verify against the pinned join CA",
			check:   func(err error) bool { return errors.As(err, new(x509.UnknownAuthorityError)) },
		},
		{
			name: "tampered leaf", pin: f.pin, chain: [][]byte{tampered, f.ca.Cert.Raw}, serverName: joinName, now: t0,
			wantErr: "does not verify against the pinned join CA",
			check:   func(err error) bool { return errors.As(err, new(x509.UnknownAuthorityError)) },
		},
		{
			name: "expired leaf", pin: f.pin, chain: [][]byte{f.leaf.Raw, f.ca.Cert.Raw}, serverName: joinName, now: f.leaf.NotAfter.Add(time.Second),
			wantErr: "expired",
			check: func(err error) bool {
				var inv x509.CertificateInvalidError
				return errors.As(err, &inv) && inv.Reason == x509.Expired
			},
		},
		{
			name: "not yet valid", pin: f.pin, chain: [][]byte{f.leaf.Raw, f.ca.Cert.Raw}, serverName: joinName, now: t0.Add(-time.Hour),
			wantErr: "not yet valid",
		},
		{
			name: "no server name still checks the CA", pin: f.pin, chain: [][]byte{forged.Raw, f.ca.Cert.Raw}, serverName: "", now: t0,
			wantErr: "does not verify against the pinned join CA",
		},
		{
			name: "wrong server name", pin: f.pin, chain: [][]byte{f.leaf.Raw, f.ca.Cert.Raw}, serverName: "evil.example", now: t0,
			wantErr: "evil.example",
			check:   func(err error) bool { return errors.As(err, new(x509.HostnameError)) },
		},
		{
			name: "client certificate as server", pin: f.pin, chain: [][]byte{f.client.Raw, f.ca.Cert.Raw}, serverName: joinName, now: t0,
			wantErr: "does not verify against the pinned join CA",
			check: func(err error) bool {
				var inv x509.CertificateInvalidError
				return errors.As(err, &inv) && inv.Reason == x509.IncompatibleUsage
			},
		},
		{
			name: "pinned key is not a CA", pin: leafPin, chain: [][]byte{f.leaf.Raw, f.leaf.Raw}, serverName: joinName, now: t0,
			wantErr: "is not a CA certificate",
		},
		{
			name: "malformed pin", pin: "sha256:abc", chain: [][]byte{f.leaf.Raw, f.ca.Cert.Raw}, serverName: joinName, now: t0,
			wantErr: "hash has 3 hex digits",
		},
		{
			name: "empty pin", pin: "", chain: [][]byte{f.leaf.Raw, f.ca.Cert.Raw}, serverName: joinName, now: t0,
			wantErr: "want the form sha256:",
		},
		{
			name: "no certificates", pin: f.pin, chain: nil, serverName: joinName, now: t0,
			wantErr: "presented no certificate",
		},
		{
			name: "garbage certificate", pin: f.pin, chain: [][]byte{f.leaf.Raw, {0x30, 0x03, 1, 2, 3}}, serverName: joinName, now: t0,
			wantErr: "parsing certificate 1 of the chain",
		},
	}
	if err := VerifyPinnedChain(f.pin, [][]byte{f.leaf.Raw, f.ca.Cert.Raw}, "", t0); err != nil {
		t.Errorf("without a server name the genuine chain must verify: %v", err)
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := VerifyPinnedChain(tt.pin, tt.chain, tt.serverName, tt.now)
			if err == nil {
				t.Fatal("VerifyPinnedChain accepted the chain")
			}
			if !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("error %q does not contain %q", err, tt.wantErr)
			}
			if tt.check != nil && !tt.check(err) {
				t.Fatalf("error %q has the wrong type", err)
			}
		})
	}
}

// TestVerifyPinnedChainOverTLS runs a real TLS 1.3 handshake on loopback with the join service's
// setup: the server sends its certificate and the CA, the client knows only the pin.
func TestVerifyPinnedChainOverTLS(t *testing.T) {
	now := time.Now()
	ca, err := NewCA("berth join CA", now, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	key := mustKey(t)
	leaf, err := ca.IssueServer(key.Public(), []string{joinName}, []net.IP{net.ParseIP("127.0.0.1")}, now, 30*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{{Certificate: [][]byte{leaf.Raw, ca.Cert.Raw}, PrivateKey: key, Leaf: leaf}},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_ = c.(*tls.Conn).Handshake()
			c.Close()
		}
	}()

	dial := func(pin string) error {
		cfg := &tls.Config{
			MinVersion: tls.VersionTLS13,
			ServerName: joinName,
			// Verification is replaced, not skipped: VerifyPeerCertificate checks the chain against the pin.
			InsecureSkipVerify: true,
			VerifyPeerCertificate: func(raw [][]byte, _ [][]*x509.Certificate) error {
				return VerifyPinnedChain(pin, raw, joinName, time.Now())
			},
		}
		d := tls.Dialer{Config: cfg}
		c, err := d.DialContext(context.Background(), "tcp", ln.Addr().String())
		if err != nil {
			return err
		}
		return c.Close()
	}
	if err := dial(SPKIPin(ca.Cert)); err != nil {
		t.Fatalf("handshake with the right pin: %v", err)
	}
	other := mustCA(t, "other")
	err = dial(SPKIPin(other.Cert))
	if err == nil || !strings.Contains(err.Error(), "not signed by the pinned join CA") {
		t.Fatalf("handshake with a wrong pin: %v", err)
	}
}
