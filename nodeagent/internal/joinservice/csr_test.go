package joinservice

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
)

// csrInstance is the instance record the CSR tests check against.
var csrInstance = metadata.Instance{
	Name:      "worker-1.lab",
	Role:      metadata.RoleWorker,
	Addresses: []netip.Addr{netip.MustParseAddr("10.0.0.5"), netip.MustParseAddr("fd00::5")},
}

func csrKey(t testing.TB) *ecdsa.PrivateKey {
	t.Helper()
	k, err := pki.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// honestCSRTemplate is what the kubelet of csrInstance asks for.
func honestCSRTemplate() *x509.CertificateRequest {
	return &x509.CertificateRequest{
		Subject:     pkix.Name{CommonName: "system:node:worker-1.lab", Organization: []string{"system:nodes"}},
		IPAddresses: []net.IP{net.ParseIP("10.0.0.5"), net.ParseIP("fd00::5")},
	}
}

func createCSR(t testing.TB, key crypto.Signer, tmpl *x509.CertificateRequest) []byte {
	t.Helper()
	der, err := x509.CreateCertificateRequest(rand.Reader, tmpl, key)
	if err != nil {
		t.Fatal(err)
	}
	return der
}

// sanWithRawIPs is a subjectAltName extension carrying IP addresses exactly as given: crypto/x509 writes an
// IPv4 address as 4 bytes, so a 16-byte IPv4-mapped SAN must be built by hand.
func sanWithRawIPs(t testing.TB, ips ...[]byte) pkix.Extension {
	t.Helper()
	names := make([]asn1.RawValue, len(ips))
	for i, ip := range ips {
		names[i] = asn1.RawValue{Tag: 7, Class: asn1.ClassContextSpecific, Bytes: ip}
	}
	v, err := asn1.Marshal(names)
	if err != nil {
		t.Fatal(err)
	}
	return pkix.Extension{Id: asn1.ObjectIdentifier{2, 5, 29, 17}, Value: v}
}

func TestCheckCSR(t *testing.T) {
	key := csrKey(t)
	tests := []struct {
		name   string
		mutate func(*x509.CertificateRequest)
		// wantErr are substrings the error must contain, each naming one deviation; none means accepted.
		wantErr []string
	}{
		{name: "exact", mutate: func(*x509.CertificateRequest) {}},
		{name: "IP SANs in another order", mutate: func(c *x509.CertificateRequest) {
			c.IPAddresses = []net.IP{net.ParseIP("fd00::5"), net.ParseIP("10.0.0.5")}
		}},
		{name: "CN of another node", mutate: func(c *x509.CertificateRequest) { c.Subject.CommonName = "system:node:cp-0.lab" },
			wantErr: []string{`CN "system:node:cp-0.lab"`, `want "system:node:worker-1.lab"`}},
		{name: "CN without node prefix", mutate: func(c *x509.CertificateRequest) { c.Subject.CommonName = "worker-1.lab" },
			wantErr: []string{`CN "worker-1.lab"`}},
		{name: "CN of an admin", mutate: func(c *x509.CertificateRequest) { c.Subject.CommonName = "kubernetes-admin" },
			wantErr: []string{`CN "kubernetes-admin"`}},
		{name: "O system:masters", mutate: func(c *x509.CertificateRequest) { c.Subject.Organization = []string{"system:masters"} },
			wantErr: []string{`O ["system:masters"]`}},
		{name: "no O", mutate: func(c *x509.CertificateRequest) { c.Subject.Organization = nil },
			wantErr: []string{"O []"}},
		{name: "extra O", mutate: func(c *x509.CertificateRequest) {
			c.Subject.Organization = []string{"system:nodes", "system:masters"}
		}, wantErr: []string{`O ["system:nodes" "system:masters"]`}},
		{name: "OU", mutate: func(c *x509.CertificateRequest) { c.Subject.OrganizationalUnit = []string{"ops"} },
			wantErr: []string{"beyond CN and O", "OU=ops"}},
		{name: "country", mutate: func(c *x509.CertificateRequest) { c.Subject.Country = []string{"DE"} },
			wantErr: []string{"beyond CN and O", "C=DE"}},
		{name: "subject serial number", mutate: func(c *x509.CertificateRequest) { c.Subject.SerialNumber = "42" },
			wantErr: []string{"beyond CN and O"}},
		{name: "DNS SAN", mutate: func(c *x509.CertificateRequest) { c.DNSNames = []string{"kubernetes.default"} },
			wantErr: []string{"DNS/email/URI", "kubernetes.default"}},
		{name: "email SAN", mutate: func(c *x509.CertificateRequest) { c.EmailAddresses = []string{"eve@example.com"} },
			wantErr: []string{"DNS/email/URI", "eve@example.com"}},
		{name: "URI SAN", mutate: func(c *x509.CertificateRequest) {
			c.URIs = []*url.URL{{Scheme: "spiffe", Host: "cluster", Path: "/ns/kube-system/sa/admin"}}
		}, wantErr: []string{"DNS/email/URI", "spiffe://cluster/ns/kube-system/sa/admin"}},
		{name: "missing IP", mutate: func(c *x509.CertificateRequest) { c.IPAddresses = []net.IP{net.ParseIP("10.0.0.5")} },
			wantErr: []string{"IP SANs [10.0.0.5]", "want [10.0.0.5 fd00::5]"}},
		{name: "no IP", mutate: func(c *x509.CertificateRequest) { c.IPAddresses = nil },
			wantErr: []string{"IP SANs []"}},
		{name: "extra IP", mutate: func(c *x509.CertificateRequest) {
			c.IPAddresses = append(c.IPAddresses, net.ParseIP("10.0.0.1"))
		}, wantErr: []string{"IP SANs [10.0.0.1 10.0.0.5 fd00::5]"}},
		{name: "same IP twice", mutate: func(c *x509.CertificateRequest) {
			c.IPAddresses = append(c.IPAddresses, net.ParseIP("10.0.0.5"))
		}, wantErr: []string{"IP SANs [10.0.0.5 10.0.0.5 fd00::5]"}},
		{name: "IP of another node", mutate: func(c *x509.CertificateRequest) {
			c.IPAddresses = []net.IP{net.ParseIP("10.0.0.6"), net.ParseIP("fd00::5")}
		}, wantErr: []string{"IP SANs [10.0.0.6 fd00::5]"}},
		{name: "everything wrong at once", mutate: func(c *x509.CertificateRequest) {
			c.Subject = pkix.Name{CommonName: "admin", Organization: []string{"system:masters"}, OrganizationalUnit: []string{"x"}}
			c.DNSNames = []string{"evil.example.com"}
			c.IPAddresses = nil
		}, wantErr: []string{`CN "admin"`, `O ["system:masters"]`, "evil.example.com", "IP SANs []", "beyond CN and O"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tmpl := honestCSRTemplate()
			tt.mutate(tmpl)
			csr, err := parseCSR(createCSR(t, key, tmpl))
			if err != nil {
				t.Fatalf("parseCSR: %v", err)
			}
			err = checkCSR(csr, &csrInstance)
			if len(tt.wantErr) == 0 {
				if err != nil {
					t.Fatalf("checkCSR refused an honest CSR: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatal("checkCSR accepted the CSR")
			}
			for _, want := range tt.wantErr {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not contain %q", err, want)
				}
			}
		})
	}
}

func TestCheckCSRAcceptsIPv4MappedSAN(t *testing.T) {
	mapped := netip.MustParseAddr("::ffff:10.0.0.5").As16()
	v6 := netip.MustParseAddr("fd00::5").As16()
	tmpl := honestCSRTemplate()
	tmpl.IPAddresses = nil
	tmpl.ExtraExtensions = []pkix.Extension{sanWithRawIPs(t, mapped[:], v6[:])}
	csr, err := parseCSR(createCSR(t, csrKey(t), tmpl))
	if err != nil {
		t.Fatal(err)
	}
	if len(csr.IPAddresses) != 2 || len(csr.IPAddresses[0]) != net.IPv6len || csr.IPAddresses[0].To4() == nil {
		t.Fatalf("CSR IP SANs %#v, want the 16-byte IPv4-mapped form first", csr.IPAddresses)
	}
	if err := checkCSR(csr, &csrInstance); err != nil {
		t.Errorf("checkCSR refused the IPv4-mapped form of the instance's address: %v", err)
	}

	wrong := netip.MustParseAddr("::ffff:10.0.0.6").As16()
	tmpl.ExtraExtensions = []pkix.Extension{sanWithRawIPs(t, wrong[:], v6[:])}
	if csr, err = parseCSR(createCSR(t, csrKey(t), tmpl)); err != nil {
		t.Fatal(err)
	}
	if err := checkCSR(csr, &csrInstance); err == nil || !strings.Contains(err.Error(), "IP SANs [10.0.0.6 fd00::5]") {
		t.Errorf("checkCSR of the IPv4-mapped form of another address: %v", err)
	}
}

func TestCheckCSRNamesOnlyTheDeviation(t *testing.T) {
	tmpl := honestCSRTemplate()
	tmpl.DNSNames = []string{"evil.example.com"}
	csr, err := parseCSR(createCSR(t, csrKey(t), tmpl))
	if err != nil {
		t.Fatal(err)
	}
	err = checkCSR(csr, &csrInstance)
	if err == nil {
		t.Fatal("checkCSR accepted a DNS SAN")
	}
	for _, unexpected := range []string{"CN ", "O [", "IP SANs", "beyond CN and O"} {
		if strings.Contains(err.Error(), unexpected) {
			t.Errorf("error %q blames %q, which is right", err, unexpected)
		}
	}
}

func TestParseCSR(t *testing.T) {
	key := csrKey(t)
	honest := createCSR(t, key, honestCSRTemplate())

	big := honestCSRTemplate()
	for i := range 200 {
		big.DNSNames = append(big.DNSNames, fmt.Sprintf("name-%03d.example.com", i))
	}
	bigDER := createCSR(t, key, big)
	if len(bigDER) <= maxCSRSize {
		t.Fatalf("oversized CSR is only %d bytes", len(bigDER))
	}

	tests := []struct {
		name    string
		der     []byte
		wantErr string
	}{
		{name: "honest", der: honest},
		{name: "empty", der: nil, wantErr: "CSR of 0 bytes"},
		{name: "one byte over the bound", der: make([]byte, maxCSRSize+1), wantErr: fmt.Sprintf("CSR of %d bytes", maxCSRSize+1)},
		{name: "valid but oversized", der: bigDER, wantErr: fmt.Sprintf("CSR of %d bytes", len(bigDER))},
		{name: "garbage", der: []byte("not a CSR"), wantErr: "parsing kubelet CSR"},
		{name: "truncated", der: honest[:len(honest)/2], wantErr: "parsing kubelet CSR"},
		{name: "certificate instead of CSR", der: selfSignedCert(t), wantErr: "parsing kubelet CSR"},
		{name: "RSA key of 1024 bits", der: createCSR(t, rsaKey(t, 1024), honestCSRTemplate()), wantErr: "RSA key of 1024 bits, want 2048 to 4096"},
		{name: "RSA key of 4104 bits", der: createCSR(t, rsaKey(t, 4104), honestCSRTemplate()), wantErr: "RSA key of 4104 bits, want 2048 to 4096"},
		{name: "ECDSA on P-224", der: createCSR(t, ecKey(t, elliptic.P224()), honestCSRTemplate()), wantErr: "ECDSA on P-224"},
		{name: "Ed25519", der: createCSR(t, ed25519Key(t), honestCSRTemplate()), wantErr: "ed25519.PublicKey, want ECDSA"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			csr, err := parseCSR(tt.der)
			if tt.wantErr == "" {
				if err != nil {
					t.Fatal(err)
				}
				if csr.Subject.CommonName != "system:node:worker-1.lab" {
					t.Errorf("CN %q", csr.Subject.CommonName)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("parseCSR = %v, %v; want an error containing %q", csr, err, tt.wantErr)
			}
		})
	}
}

// TestCSRKeysAccepted are the keys a kubelet certificate may have, each in a CSR that checkCSR accepts.
func TestCSRKeysAccepted(t *testing.T) {
	for name, key := range map[string]crypto.Signer{
		"ECDSA P-256": ecKey(t, elliptic.P256()), "ECDSA P-384": ecKey(t, elliptic.P384()),
		"RSA 2048": rsaKey(t, 2048), "RSA 4096": rsaKey(t, 4096),
	} {
		csr, err := parseCSR(createCSR(t, key, honestCSRTemplate()))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if err := checkCSR(csr, &csrInstance); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
	}
}

// TestCheckCSRChecksTheSignature: a CSR whose signature does not verify is refused once the node has
// attested (parseCSR does not spend the verification on a stranger).
func TestCheckCSRChecksTheSignature(t *testing.T) {
	der := createCSR(t, csrKey(t), honestCSRTemplate())
	// The signature is the CSR's last field; flipping its last byte keeps the DER well formed.
	der[len(der)-1] ^= 0x01
	csr, err := parseCSR(der)
	if err != nil {
		t.Fatalf("parseCSR checked more than the key: %v", err)
	}
	if err := checkCSR(csr, &csrInstance); err == nil || !strings.Contains(err.Error(), "signature") {
		t.Fatalf("checkCSR of a CSR with a bad signature: %v", err)
	}
}

func ecKey(t testing.TB, c elliptic.Curve) crypto.Signer {
	t.Helper()
	k, err := ecdsa.GenerateKey(c, rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func rsaKey(t testing.TB, bits int) crypto.Signer {
	t.Helper()
	k, err := rsa.GenerateKey(rand.Reader, bits)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func ed25519Key(t testing.TB) crypto.Signer {
	t.Helper()
	_, k, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func selfSignedCert(t *testing.T) []byte {
	t.Helper()
	ca, err := pki.NewCA("not-a-csr", time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	return ca.Cert.Raw
}
