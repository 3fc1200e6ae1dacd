package joinservice

import (
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
)

func parseCSR(der []byte) (*x509.CertificateRequest, error) {
	if len(der) == 0 || len(der) > maxCSRSize {
		return nil, fmt.Errorf("kubelet CSR of %d bytes", len(der))
	}
	csr, err := x509.ParseCertificateRequest(der)
	if err != nil {
		return nil, fmt.Errorf("parsing kubelet CSR: %w", err)
	}
	if err := csr.CheckSignature(); err != nil {
		return nil, fmt.Errorf("kubelet CSR signature: %w", err)
	}
	return csr, nil
}

// checkCSR accepts exactly what the kubelet of inst may hold: CN system:node:<name>, O system:nodes, the
// record's IP addresses and no other name of any kind. The certificate is built from the record, not from
// the CSR; the check is there so that a node asking for more is refused and logged instead of silently cut down.
func checkCSR(csr *x509.CertificateRequest, inst *metadata.Instance) error {
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
