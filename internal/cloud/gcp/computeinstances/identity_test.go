package computeinstances

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"math/big"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/time/rate"

	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/cloud/gcp/computeinstances/computetest"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/test/clocktest"
)

// Keys are made once: RSA generation under -race takes long.
var (
	ekRSA   = sync.OnceValue(func() *rsa.PrivateKey { return genRSA(2048) })
	otherEK = sync.OnceValue(func() *rsa.PrivateKey { return genRSA(2048) })
	rsa1k   = sync.OnceValue(func() *rsa.PrivateKey { return genRSA(1024) })
	caKey   = sync.OnceValue(func() *ecdsa.PrivateKey {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			panic(err)
		}
		return k
	})
)

func genRSA(bits int) *rsa.PrivateKey {
	k, err := rsa.GenerateKey(rand.Reader, bits)
	if err != nil {
		panic(err)
	}
	return k
}

func pubPEM(t *testing.T, pub any) string {
	t.Helper()
	s, err := computetest.PublicKeyPEM(pub)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// ekCertPEM is an EK certificate for pub in the shape of Google's (empty subject), from a test CA.
func ekCertPEM(t *testing.T, pub any) string {
	t.Helper()
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(0x1234), Issuer: pkix.Name{CommonName: "test vTPM EK CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageKeyEncipherment,
	}
	ca := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test vTPM EK CA"}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, pub, caKey())
	if err != nil {
		t.Fatal(err)
	}
	return computetest.CertificatePEM(der)
}

// shielded is an instance with a vTPM identity: EK with certificate, AK without.
func shielded(t *testing.T, name string, ip string) computetest.Instance {
	inst := node(name, zoneB, workGroup, ip)
	inst.Identity = &computetest.ShieldedIdentity{
		EKPub: pubPEM(t, &ekRSA().PublicKey), EKCert: ekCertPEM(t, &ekRSA().PublicKey),
		AKPub: pubPEM(t, &otherEK().PublicKey),
	}
	return inst
}

func TestIdentity(t *testing.T) {
	srv := newServer(t)
	put(t, srv, shielded(t, "berth-workers-a", "10.0.2.10"))
	clock := clocktest.New(time.Date(2026, 11, 24, 12, 0, 0, 0, time.UTC))
	l := newLookup(t, srv, func(c *Config) { c.Clock = clock.Now })

	// The record's id is what the EK source takes: the cross-package contract.
	rec, err := lookup(t, l, "10.0.2.10")
	if err != nil {
		t.Fatal(err)
	}
	id, err := l.Identity(t.Context(), rec.ID)
	if err != nil {
		t.Fatal(err)
	}
	if !id.EK.Equal(&ekRSA().PublicKey) {
		t.Error("identity holds another EK than the instance's")
	}
	if id.EKCertificate == nil || !id.EK.Equal(id.EKCertificate.PublicKey) {
		t.Errorf("EK certificate %v, want one for the EK", id.EKCertificate)
	}
	if ak, ok := id.AK.(*rsa.PublicKey); !ok || !ak.Equal(&otherEK().PublicKey) {
		t.Errorf("AK %T, want the instance's", id.AK)
	}
	if id.AKCertificate != nil || id.InstanceID != rec.ID {
		t.Errorf("AK certificate %v, instance id %q", id.AKCertificate, id.InstanceID)
	}
	// Copies: a caller changing its key or certificate changes nothing for the next.
	id.EK.E = 3
	id.EKCertificate.UnhandledCriticalExtensions = nil
	ek, err := l.EKPublic(t.Context(), rec.ID)
	if err != nil {
		t.Fatal(err)
	}
	if !ek.Equal(&ekRSA().PublicKey) {
		t.Error("the cached key was changed through a caller's copy")
	}
	if calls := srv.Calls(computetest.GetShieldedInstanceIdentity); calls != 1 {
		t.Errorf("%d identity calls for two requests, want 1 (cache)", calls)
	}

	// Concurrent requests after expiry share one call.
	clock.Advance(DefaultIdentityCacheTTL)
	var wg sync.WaitGroup
	for range 50 {
		wg.Go(func() {
			if _, err := l.EKPublic(t.Context(), rec.ID); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if calls := srv.Calls(computetest.GetShieldedInstanceIdentity); calls != 2 {
		t.Errorf("%d identity calls after expiry and 50 concurrent requests, want 2", calls)
	}
}

// TestIdentityByNumericID: an instance is asked for by its numeric id, never by its name, which a later
// instance may take.
func TestIdentityByNumericID(t *testing.T) {
	srv := newServer(t)
	put(t, srv, shielded(t, "berth-workers-a", "10.0.2.10"))
	old := idOf(t, srv, zoneB, "berth-workers-a")
	if err := srv.Remove(zoneB, "berth-workers-a"); err != nil {
		t.Fatal(err)
	}
	successor := shielded(t, "berth-workers-a", "10.0.2.10")
	successor.Identity.EKPub, successor.Identity.EKCert = pubPEM(t, &otherEK().PublicKey), ""
	put(t, srv, successor)
	ids := NewIdentities(newTestService(t, srv), testLogger(t))
	if ek, err := ids.EKPublic(t.Context(), old); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("EK of a deleted instance whose name was taken again: %v, %v; want not found", ek != nil, err)
	}
	ek, err := ids.EKPublic(t.Context(), idOf(t, srv, zoneB, "berth-workers-a"))
	if err != nil || !ek.Equal(&otherEK().PublicKey) {
		t.Errorf("EK of the successor: %v", err)
	}
}

// TestCloudEK: the Lookup as attest's EK source refuses a TPM whose EK is not the instance's.
func TestCloudEK(t *testing.T) {
	srv := newServer(t)
	put(t, srv, shielded(t, "berth-workers-a", "10.0.2.10"))
	l := newLookup(t, srv, nil)
	rec, err := lookup(t, l, "10.0.2.10")
	if err != nil {
		t.Fatal(err)
	}
	trust := attest.CloudEK{Cloud: "Compute Engine", Source: l}
	if err := trust.TrustEK(t.Context(), attest.EK{Public: &ekRSA().PublicKey}, rec.ID); err != nil {
		t.Errorf("the instance's own EK: %v", err)
	}
	if err := trust.TrustEK(t.Context(), attest.EK{Public: &otherEK().PublicKey}, rec.ID); !errors.Is(err, attest.ErrUntrusted) {
		t.Errorf("another EK: %v, want ErrUntrusted", err)
	}
}

func TestIdentityRefusals(t *testing.T) {
	srv := newServer(t)
	ecKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		id   *computetest.ShieldedIdentity
		want string
	}{
		{"not a Shielded VM", nil, "not a Shielded VM"},
		{"no EK", &computetest.ShieldedIdentity{AKPub: pubPEM(t, &otherEK().PublicKey)}, "not a Shielded VM"},
		{"not PEM", &computetest.ShieldedIdentity{EKPub: "MIIBIjANBgkqhkiG9w0BAQEFAAOCAQ8AMIIBCgKCAQEA"}, "not PEM"},
		{"certificate as key", &computetest.ShieldedIdentity{EKPub: ekCertPEM(t, &ekRSA().PublicKey)}, `"CERTIFICATE", not "PUBLIC KEY"`},
		{"two blocks", &computetest.ShieldedIdentity{EKPub: pubPEM(t, &ekRSA().PublicKey) + pubPEM(t, &otherEK().PublicKey)}, "more than one PEM block"},
		{"small key", &computetest.ShieldedIdentity{EKPub: pubPEM(t, &rsa1k().PublicKey)}, "RSA-1024"},
		{"ECDSA key", &computetest.ShieldedIdentity{EKPub: pubPEM(t, &ecKey.PublicKey)}, "ECDSA P-256, not RSA"},
		{"garbage SPKI", &computetest.ShieldedIdentity{EKPub: "-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n"}, "not a SubjectPublicKeyInfo"},
		{"huge PEM", &computetest.ShieldedIdentity{EKPub: strings.Repeat("A", maxPEMLen+1)}, "more than"},
		{"certificate of another key", &computetest.ShieldedIdentity{EKPub: pubPEM(t, &ekRSA().PublicKey), EKCert: ekCertPEM(t, &otherEK().PublicKey)}, "certifies another key"},
		{"bad certificate", &computetest.ShieldedIdentity{EKPub: pubPEM(t, &ekRSA().PublicKey), EKCert: "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"}, "not an X.509 certificate"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			inst := node("berth-workers-x", zoneB, workGroup, "10.0.2.10")
			inst.Identity = tc.id
			put(t, srv, inst)
			// A fresh source each: refusals are not cached, but the instance changes between cases.
			ids := NewIdentities(newTestService(t, srv), testLogger(t))
			_, err := ids.EKPublic(t.Context(), idOf(t, srv, zoneB, inst.Name))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("EKPublic: %v, want an error saying %q", err, tc.want)
			}
			if errors.Is(err, metadata.ErrNotFound) {
				t.Errorf("a bad identity reads as 'not found': %v", err)
			}
		})
	}
}

func TestIdentityNotFound(t *testing.T) {
	srv := newServer(t)
	ids := NewIdentities(newTestService(t, srv), testLogger(t))
	_, err := ids.EKPublic(t.Context(), InstanceID(project, zoneB, 4700000000000009999))
	if !errors.Is(err, metadata.ErrNotFound) || !strings.Contains(err.Error(), "no instance 4700000000000009999") {
		t.Errorf("unknown instance: %v, want not found", err)
	}
	var ae *APIError
	if !errors.As(err, &ae) || ae.Code != 404 {
		t.Errorf("unknown instance: %v, want a 404 APIError inside", err)
	}
	// Not cached: the instance may be created later.
	_, _ = ids.EKPublic(t.Context(), InstanceID(project, zoneB, 4700000000000009999))
	if calls := srv.Calls(computetest.GetShieldedInstanceIdentity); calls != 2 {
		t.Errorf("%d calls, want 2: a miss was cached", calls)
	}

	// Ids that are not InstanceID's never reach Compute Engine.
	for _, bad := range []string{"", "i-0123456789abcdef0", "projects/berth-test/zones/europe-west1-b/instances/berth-workers-a"} {
		if _, err := ids.EKPublic(t.Context(), bad); err == nil || !strings.Contains(err.Error(), "numeric") && !strings.Contains(err.Error(), "not projects/") {
			t.Errorf("EKPublic(%q): %v", bad, err)
		}
	}
	if calls := srv.Calls(computetest.GetShieldedInstanceIdentity); calls != 2 {
		t.Errorf("%d calls after malformed ids, want 2", calls)
	}
}

func TestIdentityDenied(t *testing.T) {
	srv := newServer(t)
	put(t, srv, shielded(t, "berth-workers-a", "10.0.2.10"))
	srv.Deny(computetest.GetShieldedInstanceIdentity)
	ids := NewIdentities(newTestService(t, srv), testLogger(t))
	_, err := ids.EKPublic(t.Context(), idOf(t, srv, zoneB, "berth-workers-a"))
	var ae *APIError
	if !errors.As(err, &ae) || !strings.Contains(ae.Hint, "needs IAM permission compute.instances.getShieldedInstanceIdentity") {
		t.Errorf("denied identity: %v, want the permission named", err)
	}
}

func TestIdentityPacing(t *testing.T) {
	srv := newServer(t)
	a, b := shielded(t, "berth-workers-a", "10.0.2.10"), shielded(t, "berth-workers-b", "10.0.2.20")
	put(t, srv, a, b)
	l := newLookup(t, srv, func(c *Config) {
		c.IdentityRate = rate.Every(time.Hour)
		c.Burst = 1
	})
	if _, err := l.EKPublic(t.Context(), idOf(t, srv, zoneB, a.Name)); err != nil {
		t.Fatal(err)
	}
	if _, err := l.EKPublic(t.Context(), idOf(t, srv, zoneB, b.Name)); err == nil || !strings.Contains(err.Error(), "pacing") {
		t.Errorf("identity request beyond the pace: %v, want a pacing failure", err)
	}
	if calls := srv.Calls(computetest.GetShieldedInstanceIdentity); calls != 1 {
		t.Errorf("%d identity calls, want 1", calls)
	}
}
