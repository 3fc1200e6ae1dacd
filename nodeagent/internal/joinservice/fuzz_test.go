package joinservice

import (
	"net/netip"
	"slices"
	"testing"
)

// FuzzCheckCSR feeds arbitrary bytes to the CSR checks a joining node's request goes through. They must never
// panic, and whatever they accept must be exactly the kubelet identity of the instance record.
func FuzzCheckCSR(f *testing.F) {
	f.Fuzz(func(t *testing.T, data []byte) {
		csr, err := parseCSR(data)
		if err != nil {
			if csr != nil {
				t.Fatalf("parseCSR returned a CSR with the error %v", err)
			}
			return
		}
		if err := checkCSR(csr, &csrInstance); err != nil {
			return
		}
		if csr.Subject.CommonName != "system:node:worker-1.lab" || !slices.Equal(csr.Subject.Organization, []string{"system:nodes"}) {
			t.Fatalf("accepted subject %q", csr.Subject)
		}
		if len(csr.DNSNames)+len(csr.EmailAddresses)+len(csr.URIs) > 0 {
			t.Fatalf("accepted names %v %v %v", csr.DNSNames, csr.EmailAddresses, csr.URIs)
		}
		var ips []netip.Addr
		for _, ip := range csr.IPAddresses {
			a, ok := netip.AddrFromSlice(ip)
			if !ok {
				t.Fatalf("accepted IP SAN %x that is no address", []byte(ip))
			}
			ips = append(ips, a.Unmap())
		}
		slices.SortFunc(ips, netip.Addr.Compare)
		if !slices.Equal(ips, csrInstance.Addresses) {
			t.Fatalf("accepted IP SANs %v, instance has %v", ips, csrInstance.Addresses)
		}
	})
}
