// Package shieldedvmtest is a CA in the shape of Google's vTPM EK CAs, for tests and labs that cannot have
// Google sign their TPMs' keys: a root, an intermediate, and EK certificates that carry Google's instance
// extension.
package shieldedvmtest

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"time"

	"github.com/berthlabs/berth/internal/cloud/gcp/shieldedvm"
)

// CA issues EK certificates as Google's "EK/AK CA Intermediate" does.
type CA struct {
	Root, Intermediate *x509.Certificate
	key                crypto.Signer
	serial             int64
}

// NewCA makes a root and an intermediate named like Google's.
func NewCA() (*CA, error) {
	rootKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	interKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	name := func(cn string) pkix.Name {
		return pkix.Name{Country: []string{"US"}, Organization: []string{"Berth test"}, OrganizationalUnit: []string{"Google Cloud shape"}, CommonName: cn}
	}
	rootTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: name("EK/AK CA Root (test)"),
		NotBefore: now.Add(-time.Hour), NotAfter: now.AddDate(10, 0, 0), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign}
	root, err := sign(rootTmpl, rootTmpl, rootKey.Public(), rootKey)
	if err != nil {
		return nil, err
	}
	interTmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: name("EK/AK CA Intermediate (test)"),
		NotBefore: now.Add(-time.Hour), NotAfter: now.AddDate(10, 0, 0), IsCA: true, BasicConstraintsValid: true,
		MaxPathLenZero: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign}
	inter, err := sign(interTmpl, root, interKey.Public(), rootKey)
	if err != nil {
		return nil, err
	}
	return &CA{Root: root, Intermediate: inter, key: interKey, serial: 100}, nil
}

// Pools returns the CA's root and intermediate as shieldedvm.NewTrust takes them.
func (ca *CA) Pools() (roots, intermediates *x509.CertPool) {
	roots, intermediates = x509.NewCertPool(), x509.NewCertPool()
	roots.AddCert(ca.Root)
	intermediates.AddCert(ca.Intermediate)
	return roots, intermediates
}

// PEM is the root and the intermediate, PEM-encoded, as a CA bundle file holds them.
func (ca *CA) PEM() []byte {
	out := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ca.Root.Raw})
	return append(out, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ca.Intermediate.Raw})...)
}

// IssueEK certifies ek as the vTPM EK of the instance info names, with Google's subject layout (L zone,
// O "Google Compute Engine", OU project id, CN instance id) and instance extension. Not safe for
// concurrent use.
func (ca *CA) IssueEK(ek crypto.PublicKey, info shieldedvm.InstanceInfo) (*x509.Certificate, error) {
	ext, err := info.Extension()
	if err != nil {
		return nil, err
	}
	ca.serial++
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(ca.serial),
		Subject: pkix.Name{Locality: []string{info.Zone}, Organization: []string{"Google Compute Engine"},
			OrganizationalUnit: []string{info.ProjectID}, CommonName: fmt.Sprint(info.InstanceID)},
		NotBefore: now.Add(-time.Hour), NotAfter: now.AddDate(10, 0, 0),
		KeyUsage: x509.KeyUsageKeyEncipherment, BasicConstraintsValid: true,
		ExtraExtensions: []pkix.Extension{ext},
	}
	return sign(tmpl, ca.Intermediate, ek, ca.key)
}

func sign(tmpl, parent *x509.Certificate, pub crypto.PublicKey, key crypto.Signer) (*x509.Certificate, error) {
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, pub, key)
	if err != nil {
		return nil, fmt.Errorf("signing %s: %w", tmpl.Subject.CommonName, err)
	}
	return x509.ParseCertificate(der)
}
