package joinservice

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rsa"
	"crypto/x509"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/berthlabs/berth/internal/metadata"
)

const (
	nodeUserPrefix = "system:node:"
	nodesGroup     = "system:nodes"
	// kubeletCertValidity matches what the kubelet's own certificate rotation would ask for.
	kubeletCertValidity = 365 * 24 * time.Hour
	maxCSRSize          = 4 << 10
	minRSABits          = 2048
	maxRSABits          = 4096
)

// parseCSR parses a kubelet CSR and checks its key type, which costs nothing; its signature, which costs
// CPU, is checked by checkCSR once the node has attested.
func parseCSR(der []byte) (*x509.CertificateRequest, error) {
	if len(der) == 0 || len(der) > maxCSRSize {
		return nil, fmt.Errorf("kubelet CSR of %d bytes", len(der))
	}
	csr, err := x509.ParseCertificateRequest(der)
	if err != nil {
		return nil, fmt.Errorf("parsing kubelet CSR: %w", err)
	}
	if err := checkCSRKey(csr.PublicKey); err != nil {
		return nil, fmt.Errorf("kubelet CSR key: %w", err)
	}
	return csr, nil
}

// checkCSRKey accepts the keys a kubelet client certificate is made with: ECDSA P-256 (what the agent and
// the kubelet's own rotation generate) or P-384, and RSA of 2048 to 4096 bits for an operator's own
// tooling. Nothing else: the cost of verifying an RSA signature grows with the square of the key size or
// more (a 15,000-bit key costs tens of milliseconds a request), and no larger key makes a node safer.
func checkCSRKey(key any) error {
	switch k := key.(type) {
	case *ecdsa.PublicKey:
		if k.Curve != elliptic.P256() && k.Curve != elliptic.P384() {
			return fmt.Errorf("ECDSA on %s, want P-256 or P-384", k.Curve.Params().Name)
		}
	case *rsa.PublicKey:
		if n := k.N.BitLen(); n < minRSABits || n > maxRSABits {
			return fmt.Errorf("RSA key of %d bits, want %d to %d", n, minRSABits, maxRSABits)
		}
	default:
		return fmt.Errorf("%T, want ECDSA P-256 or P-384, or RSA", key)
	}
	return nil
}

// checkCSR accepts exactly what the kubelet of inst may hold: a CSR signed by its key, CN system:node:<name>,
// O system:nodes, the record's IP addresses and no other name of any kind. The certificate is built from the
// record, not from the CSR; the check is there so that a node asking for more is refused and logged instead
// of silently cut down.
func checkCSR(csr *x509.CertificateRequest, inst *metadata.Instance) error {
	if err := csr.CheckSignature(); err != nil {
		return fmt.Errorf("signature: %w", err)
	}
	var errs []error
	if want := nodeUserPrefix + inst.Name; csr.Subject.CommonName != want {
		errs = append(errs, fmt.Errorf("CN %q, want %q", csr.Subject.CommonName, want))
	}
	if !slices.Equal(csr.Subject.Organization, []string{nodesGroup}) {
		errs = append(errs, fmt.Errorf("O %q, want [%q]", csr.Subject.Organization, nodesGroup))
	}
	if len(csr.DNSNames)+len(csr.EmailAddresses)+len(csr.URIs) > 0 {
		errs = append(errs, fmt.Errorf("DNS/email/URI names %v %v %v, want none", csr.DNSNames, csr.EmailAddresses, csr.URIs))
	}
	got := make([]netip.Addr, 0, len(csr.IPAddresses))
	for _, ip := range csr.IPAddresses {
		a, _ := netip.AddrFromSlice(ip)
		got = append(got, a.Unmap())
	}
	want := slices.Clone(inst.Addresses)
	slices.SortFunc(got, netip.Addr.Compare)
	slices.SortFunc(want, netip.Addr.Compare)
	if !slices.Equal(got, want) {
		errs = append(errs, fmt.Errorf("IP SANs %v, want %v", got, want))
	}
	if s := csr.Subject; len(s.OrganizationalUnit)+len(s.Country)+len(s.Locality)+len(s.Province)+len(s.StreetAddress)+len(s.PostalCode) > 0 || s.SerialNumber != "" {
		errs = append(errs, fmt.Errorf("subject %q has attributes beyond CN and O", s.String()))
	}
	return errors.Join(errs...)
}
