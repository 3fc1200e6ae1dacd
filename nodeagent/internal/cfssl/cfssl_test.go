package cfssl

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/pki"
)

const testKeyHex = "0123456789abcdef0123456789abcdef"

// testCA signs certificates for the fake CFSSL.
type testCA struct {
	cert *x509.Certificate
	key  crypto.Signer
}

func newTestCA(t testing.TB) *testCA {
	t.Helper()
	ca, err := pki.NewCA("test CA", time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	return &testCA{cert: ca.Cert, key: ca.Key}
}

// issue returns a PEM certificate for pub with the given subject and hosts, IP addresses and DNS names
// sorted as CFSSL sorts them.
func (ca *testCA) issue(t testing.TB, pub crypto.PublicKey, subject pkix.Name, hosts []string) string {
	t.Helper()
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()),
		Subject:      subject,
		NotBefore:    time.Now().Add(-time.Minute),
		NotAfter:     time.Now().Add(time.Hour),
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, pub, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	return string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
}

// newCSR returns a PEM CSR with subject and its key.
func newCSR(t testing.TB, subject pkix.Name) ([]byte, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{Subject: subject}, key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der}), key
}

// received is a request as the fake CFSSL decoded it.
type received struct {
	Hosts   []string `json:"hosts"`
	CSR     string   `json:"certificate_request"`
	Subject struct {
		CN    string              `json:"CN"`
		Names []map[string]string `json:"names"`
	} `json:"subject"`
	Profile string `json:"profile"`
	Label   string `json:"label"`
}

// decodeAuthRequest reads a request the way CFSSL's authsign handler does and reports whether its token
// verifies under key.
func decodeAuthRequest(t testing.TB, r *http.Request, key []byte) (received, bool) {
	t.Helper()
	var outer struct {
		Token   string `json:"token"`
		Request string `json:"request"`
	}
	if err := json.NewDecoder(r.Body).Decode(&outer); err != nil {
		t.Errorf("decoding authenticated request: %v", err)
	}
	token, err := base64.StdEncoding.DecodeString(outer.Token)
	if err != nil {
		t.Errorf("token is not base64: %v", err)
	}
	inner, err := base64.StdEncoding.DecodeString(outer.Request)
	if err != nil {
		t.Errorf("request is not base64: %v", err)
	}
	var in received
	if err := json.Unmarshal(inner, &in); err != nil {
		t.Errorf("decoding sign request: %v", err)
	}
	mac := hmac.New(sha256.New, key)
	mac.Write(inner)
	return in, hmac.Equal(mac.Sum(nil), token)
}

func writeEnvelope(w http.ResponseWriter, status int, success bool, result any, code int, message string) {
	env := map[string]any{"success": success, "result": result, "errors": []any{}, "messages": []any{}}
	if !success {
		env["errors"] = []any{map[string]any{"code": code, "message": message}}
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(env)
}

// subjectOf is the subject the fake CFSSL applies, as CFSSL applies a request's subject override.
func subjectOf(in received) pkix.Name {
	name := pkix.Name{CommonName: in.Subject.CN}
	for _, n := range in.Subject.Names {
		name.Organization = append(name.Organization, n["O"])
	}
	return name
}

func TestSignWireFormat(t *testing.T) {
	key, err := ParseAuthKey(testKeyHex)
	if err != nil {
		t.Fatal(err)
	}
	ca := newTestCA(t)
	csrPEM, csrKey := newCSR(t, pkix.Name{CommonName: "from-the-node"})
	otherKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	subject := Subject{CommonName: "system:node:worker-1", Organization: []string{"system:nodes"}}

	// sign answers as CFSSL does when the token verifies, with the certificate the case makes.
	sign := func(issue func(t *testing.T, in received) string) func(t *testing.T, w http.ResponseWriter, r *http.Request) {
		return func(t *testing.T, w http.ResponseWriter, r *http.Request) {
			in, ok := decodeAuthRequest(t, r, key)
			if !ok {
				writeEnvelope(w, http.StatusBadRequest, false, nil, 400, "invalid token")
				return
			}
			writeEnvelope(w, http.StatusOK, true, map[string]string{"certificate": issue(t, in)}, 0, "")
		}
	}
	good := func(t *testing.T, in received) string {
		return ca.issue(t, &csrKey.PublicKey, subjectOf(in), in.Hosts)
	}

	tests := []struct {
		name    string
		authKey []byte
		timeout time.Duration
		handler func(t *testing.T, w http.ResponseWriter, r *http.Request)
		wantErr error
		wantMsg string
	}{
		{
			name: "success",
			handler: func(t *testing.T, w http.ResponseWriter, r *http.Request) {
				if r.Method != http.MethodPost || r.URL.Path != "/api/v1/cfssl/authsign" {
					t.Errorf("request %s %s, want POST /api/v1/cfssl/authsign", r.Method, r.URL.Path)
				}
				if ct := r.Header.Get("Content-Type"); ct != "application/json" {
					t.Errorf("Content-Type %q, want application/json", ct)
				}
				sign(good)(t, w, r)
			},
		},
		{
			name:    "wrong auth key",
			authKey: []byte("another key of sixteen bytes or more"),
			handler: sign(good),
			wantErr: ErrAuthentication,
			wantMsg: `refused authentication (code 400: "invalid token"): check that profile "kubelet" exists`,
		},
		{
			name: "policy error",
			handler: func(t *testing.T, w http.ResponseWriter, r *http.Request) {
				writeEnvelope(w, http.StatusBadRequest, false, nil, 5200, "Invalid or unknown policy")
			},
			wantErr: ErrRefused,
			wantMsg: `refused to sign (code 5200: "Invalid or unknown policy")`,
		},
		{
			name: "non-JSON body",
			handler: func(t *testing.T, w http.ResponseWriter, r *http.Request) {
				w.WriteHeader(http.StatusBadGateway)
				io.WriteString(w, "<html>bad gateway</html>")
			},
			wantErr: ErrMalformedResponse,
			wantMsg: `malformed response (HTTP 502): not CFSSL's JSON envelope`,
		},
		{
			name: "oversized body",
			handler: func(t *testing.T, w http.ResponseWriter, r *http.Request) {
				io.WriteString(w, `{"success":true,"result":{"certificate":"`+strings.Repeat("A", 2<<20)+`"}}`)
			},
			wantErr: ErrMalformedResponse,
			wantMsg: "exceeds 1048576 bytes",
		},
		{
			name: "failure without errors",
			handler: func(t *testing.T, w http.ResponseWriter, r *http.Request) {
				io.WriteString(w, `{"success":false,"result":null,"errors":[]}`)
			},
			wantErr: ErrMalformedResponse,
			wantMsg: "success is false but no error is given",
		},
		{
			name: "certificate not PEM",
			handler: func(t *testing.T, w http.ResponseWriter, r *http.Request) {
				writeEnvelope(w, http.StatusOK, true, map[string]string{"certificate": "not a certificate"}, 0, "")
			},
			wantErr: ErrMalformedResponse,
			wantMsg: "not a PEM CERTIFICATE",
		},
		{
			name: "certificate for another key",
			handler: sign(func(t *testing.T, in received) string {
				return ca.issue(t, &otherKey.PublicKey, subjectOf(in), in.Hosts)
			}),
			wantErr: ErrCertificateMismatch,
			wantMsg: "its public key is not the CSR's",
		},
		{
			name: "certificate with another organization",
			handler: sign(func(t *testing.T, in received) string {
				return ca.issue(t, &csrKey.PublicKey, pkix.Name{CommonName: in.Subject.CN, Organization: []string{"system:masters"}}, in.Hosts)
			}),
			wantErr: ErrCertificateMismatch,
			wantMsg: `its organizations are ["system:masters"]`,
		},
		{
			name: "certificate with an unrequested name",
			handler: sign(func(t *testing.T, in received) string {
				return ca.issue(t, &csrKey.PublicKey, subjectOf(in), append(in.Hosts, "kubernetes.default"))
			}),
			wantErr: ErrCertificateMismatch,
			wantMsg: `it names "kubernetes.default"`,
		},
		{
			name:    "timeout",
			timeout: 100 * time.Millisecond,
			handler: func(t *testing.T, w http.ResponseWriter, r *http.Request) {
				// With the body read, the server notices the client hanging up.
				_, _ = io.Copy(io.Discard, r.Body)
				<-r.Context().Done()
			},
			wantErr: ErrUnreachable,
			wantMsg: "is unreachable: no answer before the deadline",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { tt.handler(t, w, r) }))
			defer srv.Close()
			authKey := key
			if tt.authKey != nil {
				authKey = tt.authKey
			}
			s := &Signer{URL: srv.URL, Profile: "kubelet", AuthKey: authKey, Timeout: tt.timeout}
			cert, err := s.Sign(context.Background(), Request{CSR: csrPEM, Hosts: []string{"worker-1", "10.0.0.7"}, Subject: subject})
			if tt.wantErr == nil {
				if err != nil {
					t.Fatalf("Sign: %v", err)
				}
				if cert.Subject.CommonName != subject.CommonName || !slices.Equal(cert.Subject.Organization, subject.Organization) {
					t.Errorf("subject %v, want CN %q O %q", cert.Subject, subject.CommonName, subject.Organization)
				}
				if !slices.Equal(cert.DNSNames, []string{"worker-1"}) || len(cert.IPAddresses) != 1 || cert.IPAddresses[0].String() != "10.0.0.7" {
					t.Errorf("names %v %v, want worker-1 and 10.0.0.7", cert.DNSNames, cert.IPAddresses)
				}
				return
			}
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("Sign error %v, want kind %v", err, tt.wantErr)
			}
			msg := err.Error()
			if !strings.Contains(msg, tt.wantMsg) || !strings.Contains(msg, "CFSSL at "+srv.URL) {
				t.Errorf("error %q, want it to name %s and contain %q", msg, srv.URL, tt.wantMsg)
			}
			assertNoSecrets(t, msg, authKey, csrPEM)
		})
	}
}

// assertNoSecrets fails when msg quotes the auth key (raw, hex or base64) or the CSR.
func assertNoSecrets(t *testing.T, msg string, key, csr []byte) {
	t.Helper()
	block, _ := pem.Decode(csr)
	for _, secret := range []string{
		string(key), hex.EncodeToString(key), base64.StdEncoding.EncodeToString(key),
		base64.StdEncoding.EncodeToString(block.Bytes)[:32],
	} {
		if strings.Contains(msg, secret) {
			t.Errorf("error %q quotes a secret or the CSR", msg)
		}
	}
}

func TestSignRequestFields(t *testing.T) {
	key, err := ParseAuthKey(testKeyHex)
	if err != nil {
		t.Fatal(err)
	}
	ca := newTestCA(t)
	csrPEM, csrKey := newCSR(t, pkix.Name{CommonName: "node", Organization: []string{"system:masters"}})
	var got received
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		in, ok := decodeAuthRequest(t, r, key)
		if !ok {
			t.Error("token does not verify under the auth key")
		}
		got = in
		writeEnvelope(w, http.StatusOK, true, map[string]string{"certificate": ca.issue(t, &csrKey.PublicKey, subjectOf(in), nil)}, 0, "")
	}))
	defer srv.Close()

	s := &Signer{URL: srv.URL + "/", Profile: "kubelet", Label: "primary", AuthKey: key}
	subject := Subject{CommonName: "system:node:w", Organization: []string{"system:nodes", "berth:workers"}}
	if _, err := s.Sign(context.Background(), Request{CSR: csrPEM, Subject: subject}); err != nil {
		t.Fatalf("Sign: %v", err)
	}
	if got.Profile != "kubelet" || got.Label != "primary" || got.CSR != string(csrPEM) {
		t.Errorf("profile %q label %q, CSR sent as is %v; want kubelet, primary, true", got.Profile, got.Label, got.CSR == string(csrPEM))
	}
	// An absent hosts list would let CFSSL copy the CSR's names.
	if got.Hosts == nil || len(got.Hosts) != 0 {
		t.Errorf("hosts %#v, want an empty list", got.Hosts)
	}
	wantNames := []map[string]string{{"O": "system:nodes"}, {"O": "berth:workers"}}
	if got.Subject.CN != "system:node:w" || fmt.Sprint(got.Subject.Names) != fmt.Sprint(wantNames) {
		t.Errorf("subject %+v, want CN system:node:w and names %v", got.Subject, wantNames)
	}
}

func TestSignUnreachable(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	url := "http://" + ln.Addr().String()
	ln.Close()
	csrPEM, _ := newCSR(t, pkix.Name{})
	s := &Signer{URL: url, Profile: "kubelet", AuthKey: []byte(testKeyHex)}
	_, err = s.Sign(context.Background(), Request{CSR: csrPEM, Subject: Subject{CommonName: "system:node:w"}})
	if !errors.Is(err, ErrUnreachable) || !strings.Contains(err.Error(), "CFSSL at "+url+" is unreachable: ") {
		t.Fatalf("Sign error %v, want \"CFSSL at %s is unreachable: …\"", err, url)
	}
}

func TestSignRefusesBadInput(t *testing.T) {
	key := []byte(testKeyHex)
	good, _ := newCSR(t, pkix.Name{CommonName: "node"})
	withOU, _ := newCSR(t, pkix.Name{CommonName: "node", OrganizationalUnit: []string{"ops"}})
	withO, _ := newCSR(t, pkix.Name{CommonName: "node", Organization: []string{"system:masters"}})
	block, _ := pem.Decode(good)
	der := slices.Clone(block.Bytes)
	der[len(der)-1] ^= 0xff // the last byte of the signature
	tampered := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der})
	certPEM := newTestCA(t).issue(t, &newTestCAKey(t).PublicKey, pkix.Name{CommonName: "x"}, nil)
	subject := Subject{CommonName: "system:node:w", Organization: []string{"system:nodes"}}
	tests := []struct {
		name    string
		signer  Signer
		req     Request
		wantMsg string
	}{
		{"no URL", Signer{Profile: "p", AuthKey: key}, Request{CSR: good, Subject: subject}, "want an http:// or https:// URL"},
		{"URL without scheme", Signer{URL: "127.0.0.1:8888", Profile: "p", AuthKey: key}, Request{CSR: good, Subject: subject}, "want an http:// or https:// URL"},
		{"URL that does not parse", Signer{URL: "http://user:pass@[::1", Profile: "p", AuthKey: key}, Request{CSR: good, Subject: subject}, "the URL does not parse"},
		{"URL password redacted", Signer{URL: "ftp://user:pass@cfssl", Profile: "p", AuthKey: key}, Request{CSR: good, Subject: subject}, `"ftp://user:xxxxx@cfssl" is wrong`},
		{"no auth key", Signer{URL: "http://127.0.0.1:1", Profile: "p"}, Request{CSR: good, Subject: subject}, "auth key is required"},
		{"no profile", Signer{URL: "http://127.0.0.1:1", AuthKey: key}, Request{CSR: good, Subject: subject}, "profile is required"},
		{"CSR not PEM", Signer{URL: "http://127.0.0.1:1", Profile: "p", AuthKey: key}, Request{CSR: []byte("csr"), Subject: subject}, "not a PEM CERTIFICATE REQUEST"},
		{"certificate as CSR", Signer{URL: "http://127.0.0.1:1", Profile: "p", AuthKey: key}, Request{CSR: []byte(certPEM), Subject: subject}, "not a PEM CERTIFICATE REQUEST"},
		{"corrupt CSR", Signer{URL: "http://127.0.0.1:1", Profile: "p", AuthKey: key}, Request{CSR: tampered, Subject: subject}, "the CSR's signature does not verify"},
		{"no common name", Signer{URL: "http://127.0.0.1:1", Profile: "p", AuthKey: key}, Request{CSR: good, Subject: Subject{Organization: []string{"o"}}}, "common name is required"},
		{"empty organization", Signer{URL: "http://127.0.0.1:1", Profile: "p", AuthKey: key}, Request{CSR: good, Subject: Subject{CommonName: "n", Organization: []string{""}}}, "empty organization"},
		{"empty host", Signer{URL: "http://127.0.0.1:1", Profile: "p", AuthKey: key}, Request{CSR: good, Hosts: []string{""}, Subject: subject}, "host name is empty"},
		{"CSR with OU", Signer{URL: "http://127.0.0.1:1", Profile: "p", AuthKey: key}, Request{CSR: withOU, Subject: subject}, "has attribute 2.5.4.11"},
		{"CSR organization kept", Signer{URL: "http://127.0.0.1:1", Profile: "p", AuthKey: key}, Request{CSR: withO, Subject: Subject{CommonName: "n"}}, "CFSSL would copy the CSR's"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := tt.signer.Sign(context.Background(), tt.req)
			if err == nil || !strings.Contains(err.Error(), tt.wantMsg) {
				t.Fatalf("Sign error %v, want it to contain %q", err, tt.wantMsg)
			}
			if errors.Is(err, ErrUnreachable) {
				t.Errorf("Sign sent a request it should have refused: %v", err)
			}
			assertNoSecrets(t, err.Error(), key, good)
		})
	}
}

func newTestCAKey(t testing.TB) *ecdsa.PrivateKey {
	t.Helper()
	k, err := pki.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func TestParseAuthKey(t *testing.T) {
	tests := []struct {
		name    string
		in      string
		want    []byte
		wantMsg string
	}{
		{"16 bytes", testKeyHex, []byte{0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef}, ""},
		{"trailing newline", strings.ToUpper(testKeyHex) + "\n", []byte{0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef}, ""},
		{"not hex", "secretsecretsecretsecretsecretse", nil, "not hexadecimal"},
		{"odd length", testKeyHex + "a", nil, "not hexadecimal"},
		{"too short", "00112233", nil, "has 4 bytes, want at least 16"},
		{"empty", "", nil, "has 0 bytes"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseAuthKey(tt.in)
			if tt.wantMsg == "" {
				if err != nil || !slices.Equal(got, tt.want) {
					t.Fatalf("ParseAuthKey = %x, %v; want %x", got, err, tt.want)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantMsg) {
				t.Fatalf("ParseAuthKey error %v, want it to contain %q", err, tt.wantMsg)
			}
			if tt.in != "" && strings.Contains(err.Error(), strings.TrimSpace(tt.in)[:8]) {
				t.Errorf("error %q quotes the key", err)
			}
		})
	}
}
