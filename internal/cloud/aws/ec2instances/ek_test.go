package ec2instances

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"errors"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/cloud/aws/ec2instances/ec2test"
	"github.com/berthlabs/berth/test/clocktest"
)

// Keys are made once: RSA-2048 generation under -race takes long.
var (
	ekRSA = sync.OnceValue(func() *rsa.PublicKey { return genRSA(2048) })
	rsa1k = sync.OnceValue(func() *rsa.PublicKey { return genRSA(1024) })
)

func genRSA(bits int) *rsa.PublicKey {
	k, err := rsa.GenerateKey(rand.Reader, bits)
	if err != nil {
		panic(err)
	}
	return &k.PublicKey
}

func spki(t *testing.T, pub any) []byte {
	t.Helper()
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		t.Fatal(err)
	}
	return der
}

func TestEKPublic(t *testing.T) {
	srv := ec2test.New(t)
	inst := node(1, cpGroup, addrs("10.0.1.10"))
	inst.EK = spki(t, ekRSA())
	srv.Put(inst)
	clock := clocktest.New(time.Date(2026, 11, 24, 12, 0, 0, 0, time.UTC))
	l := newLookup(t, srv, func(c *Config) { c.Clock = clock.Now })

	got, err := l.EKPublic(t.Context(), inst.ID)
	if err != nil {
		t.Fatal(err)
	}
	if !got.Equal(ekRSA()) {
		t.Fatal("EKPublic returned another key than the instance's")
	}
	req := srv.Requests(ec2test.GetInstanceTpmEkPub)[0]
	if req.Get("InstanceId") != inst.ID || req.Get("KeyType") != "rsa-2048" || req.Get("KeyFormat") != "der" {
		t.Errorf("request parameters %v", req)
	}

	// A caller changing its copy changes nothing for the next.
	got.E = 3
	again, err := l.EKPublic(t.Context(), inst.ID)
	if err != nil {
		t.Fatal(err)
	}
	if !again.Equal(ekRSA()) {
		t.Error("the cached key was changed through a caller's copy")
	}
	if calls := srv.Calls(ec2test.GetInstanceTpmEkPub); calls != 1 {
		t.Errorf("%d GetInstanceTpmEkPub calls for two requests, want 1 (cache)", calls)
	}

	// Concurrent requests after expiry share one call.
	clock.Advance(DefaultEKCacheTTL)
	var wg sync.WaitGroup
	for range 50 {
		wg.Go(func() {
			k, err := l.EKPublic(t.Context(), inst.ID)
			if err != nil || !k.Equal(ekRSA()) {
				t.Errorf("concurrent request: %v", err)
			}
		})
	}
	wg.Wait()
	if calls := srv.Calls(ec2test.GetInstanceTpmEkPub); calls != 2 {
		t.Errorf("%d GetInstanceTpmEkPub calls after expiry and 50 concurrent requests, want 2", calls)
	}
}

func TestEKPublicRefusals(t *testing.T) {
	srv := ec2test.New(t)
	ecKey, err := ecdsa.GenerateKey(elliptic.P384(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	ecc := node(2, workGroup, addrs("10.0.2.2"))
	ecc.EK = spki(t, &ecKey.PublicKey)
	small := node(3, workGroup, addrs("10.0.2.3"))
	small.EK = spki(t, rsa1k())
	garbage := node(4, workGroup, addrs("10.0.2.4"))
	garbage.EK = []byte("this is not DER")
	notBase64 := node(5, workGroup, addrs("10.0.2.5"))
	notBase64.EKKeyValue = "!!not base64!!"
	huge := node(6, workGroup, addrs("10.0.2.6"))
	huge.EKKeyValue = strings.Repeat("A", 100000)
	noTPM := node(7, workGroup, addrs("10.0.2.7"))
	srv.Put(ecc, small, garbage, notBase64, huge, noTPM)
	l := newLookup(t, srv, nil)

	for _, tc := range []struct {
		name, id string
		want     []string
	}{
		{"ECC key", ecc.ID, []string{"asked for an RSA key", "ecdsa"}},
		{"RSA-1024", small.ID, []string{"RSA-2048", "1024 bits"}},
		{"not DER", garbage.ID, []string{"not a DER SubjectPublicKeyInfo"}},
		{"not base64", notBase64.ID, []string{"not base64"}},
		{"too long", huge.ID, []string{"more than an RSA-2048 key needs"}},
		{"no NitroTPM", noTPM.ID, []string{ec2test.NoTPMCode, "without NitroTPM"}},
		{"unknown instance", instanceID(99), []string{"InvalidInstanceID.NotFound"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			k, err := l.EKPublic(t.Context(), tc.id)
			if err == nil {
				t.Fatalf("got key %v, want a refusal", k)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %q", err, w)
				}
			}
			if len(err.Error()) > 1000 {
				t.Errorf("error is %d bytes long", len(err.Error()))
			}
		})
	}
	// Refusals are not cached: an answer fixed at EC2 is taken at once.
	before := srv.Calls(ec2test.GetInstanceTpmEkPub)
	noTPM.EK = spki(t, ekRSA())
	srv.Put(noTPM)
	if _, err := l.EKPublic(t.Context(), noTPM.ID); err != nil {
		t.Errorf("after EC2 has the key: %v", err)
	}
	if srv.Calls(ec2test.GetInstanceTpmEkPub) != before+1 {
		t.Error("a refusal was cached")
	}

	// Ids that are no instance id never reach EC2.
	before = srv.Calls(ec2test.GetInstanceTpmEkPub)
	for _, id := range []string{"", "i-", "i-XYZ", "i-0123456789abcdef0\n", "../../etc", "i-0123456789abcdef01", strings.Repeat("i", 10000)} {
		if _, err := l.EKPublic(t.Context(), id); err == nil || !strings.Contains(err.Error(), "not an EC2 instance id") {
			t.Errorf("EKPublic(%.40q): %v", id, err)
		}
	}
	if srv.Calls(ec2test.GetInstanceTpmEkPub) != before {
		t.Error("a malformed instance id reached EC2")
	}
}

func TestEKPublicUnauthorized(t *testing.T) {
	srv := ec2test.New(t)
	inst := node(1, cpGroup, addrs("10.0.1.10"))
	inst.EK = spki(t, ekRSA())
	srv.Put(inst)
	srv.Deny(ec2test.GetInstanceTpmEkPub)
	l := newLookup(t, srv, nil)
	_, err := l.EKPublic(t.Context(), inst.ID)
	var ae *APIError
	if !errors.As(err, &ae) || ae.Code != "UnauthorizedOperation" {
		t.Fatalf("error %v, want an APIError UnauthorizedOperation", err)
	}
	if !strings.Contains(err.Error(), "ec2:GetInstanceTpmEkPub") {
		t.Errorf("error %q does not name the IAM action", err)
	}
	if len(err.Error()) > 1000 {
		t.Errorf("error is %d bytes long: EC2's encoded authorization message was not cut", len(err.Error()))
	}
}

func TestEKPublicThrottled(t *testing.T) {
	srv := ec2test.New(t)
	inst := node(1, cpGroup, addrs("10.0.1.10"))
	inst.EK = spki(t, ekRSA())
	srv.Put(inst)
	l := newLookup(t, srv, nil)
	srv.ThrottleNext(3)
	k, err := l.EKPublic(t.Context(), inst.ID)
	if err != nil {
		t.Fatalf("after 3 throttled calls: %v", err)
	}
	if !k.Equal(ekRSA()) {
		t.Error("wrong key")
	}
	if calls := srv.Calls(ec2test.GetInstanceTpmEkPub); calls != 4 {
		t.Errorf("%d calls, want 3 throttled and 1 answered", calls)
	}
}

func TestEKCacheBounded(t *testing.T) {
	srv := ec2test.New(t)
	var ids []string
	for i := range 5 {
		inst := node(100+i, workGroup, []netip.Addr{addrOf(i)})
		inst.EK = spki(t, ekRSA())
		srv.Put(inst)
		ids = append(ids, inst.ID)
	}
	l := newLookup(t, srv, func(c *Config) { c.EKCacheSize = 3 })
	for _, id := range ids {
		if _, err := l.EKPublic(t.Context(), id); err != nil {
			t.Fatal(err)
		}
	}
	if n := l.EKs.cache.Len(); n > 3 {
		t.Errorf("EK cache holds %d entries, bound is 3", n)
	}
}
