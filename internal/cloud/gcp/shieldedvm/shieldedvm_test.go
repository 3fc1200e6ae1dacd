package shieldedvm_test

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/cloud/gcp/shieldedvm"
	"github.com/berthlabs/berth/internal/cloud/gcp/shieldedvm/shieldedvmtest"
)

// The real instances that Google's sample certificates (testdata/) belong to.
const (
	sampleProject = "google.com:wuale-gcp-testing"
	sampleZone    = "us-central1-a"
	sampleID      = "218557372616137117" // gce_pca_rsa_ek.pem's
)

func sample(t *testing.T, name string) *x509.Certificate {
	t.Helper()
	data, err := os.ReadFile("testdata/" + name)
	if err != nil {
		t.Fatal(err)
	}
	block, _ := pem.Decode(data)
	if block == nil {
		t.Fatalf("%s: no PEM block", name)
	}
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	return cert
}

func ekOf(t *testing.T, cert *x509.Certificate) attest.EK {
	t.Helper()
	pub, ok := cert.PublicKey.(*rsa.PublicKey)
	if !ok {
		t.Fatalf("certificate key is %T, want RSA", cert.PublicKey)
	}
	return attest.EK{Public: pub, Certificate: cert}
}

func googleTrust(t *testing.T, identity attest.EKPublicSource) *shieldedvm.Trust {
	t.Helper()
	roots, inters, err := shieldedvm.GoogleCAs()
	if err != nil {
		t.Fatal(err)
	}
	return shieldedvm.NewTrust(roots, inters, identity, nil)
}

// ekSource answers one key for every instance and remembers what it was asked.
type ekSource struct {
	key   *rsa.PublicKey
	err   error
	asked []string
}

func (s *ekSource) EKPublic(_ context.Context, id string) (*rsa.PublicKey, error) {
	s.asked = append(s.asked, id)
	return s.key, s.err
}

func instance(id string) string {
	return "projects/" + sampleProject + "/zones/" + sampleZone + "/instances/" + id
}

// TestGoogleSamples checks Google's real roots on real vTPM EK certificates: both hierarchies chain, and
// the instance extension binds them to their instance by id and by name.
func TestGoogleSamples(t *testing.T) {
	ctx := context.Background()
	for file, want := range map[string]struct {
		id   uint64
		name string
	}{
		"gce_pca_rsa_ek.pem": {218557372616137117, "cs-debug-pca"},
		"gce_uca_rsa_ek.pem": {5780156274199835632, "cs-debug"},
	} {
		t.Run(file, func(t *testing.T) {
			cert := sample(t, file)
			info, named, err := shieldedvm.InstanceInfoOf(cert)
			if err != nil || !named {
				t.Fatalf("InstanceInfoOf = %v, %v, %v; want the instance", info, named, err)
			}
			if info.ProjectID != sampleProject || info.Zone != sampleZone || info.InstanceID != want.id || info.InstanceName != want.name || info.ProjectNumber == 0 {
				t.Fatalf("instance info %+v, want %s id %d", info, want.name, want.id)
			}
			id := strconv.FormatUint(want.id, 10)
			trust := googleTrust(t, nil)
			for _, id := range []string{id, want.name} {
				if err := trust.TrustEK(ctx, ekOf(t, cert), instance(id)); err != nil {
					t.Errorf("TrustEK(%s) = %v, want nil", id, err)
				}
			}
			for other, refusal := range map[string]string{
				instance(strconv.FormatUint(want.id+1, 10)):                          "instance id " + id,
				instance("other-node"):                                               `instance name "` + want.name + `"`,
				"projects/other-project/zones/" + sampleZone + "/instances/" + id:    `project "google.com:wuale-gcp-testing"`,
				"projects/" + sampleProject + "/zones/us-central1-b/instances/" + id: `zone "us-central1-a"`,
			} {
				err := trust.TrustEK(ctx, ekOf(t, cert), other)
				if !errors.Is(err, attest.ErrUntrusted) || !strings.Contains(err.Error(), refusal) {
					t.Errorf("TrustEK(%s) = %v, want ErrUntrusted naming %s", other, err, refusal)
				}
			}
		})
	}
}

func TestComputeAPIIdentity(t *testing.T) {
	ctx := context.Background()
	cert := sample(t, "gce_pca_rsa_ek.pem")
	ek := ekOf(t, cert)

	same := &ekSource{key: ek.Public}
	if err := googleTrust(t, same).TrustEK(ctx, ek, instance(sampleID)); err != nil {
		t.Fatalf("TrustEK with the API's key = %v", err)
	}
	if len(same.asked) != 1 || same.asked[0] != instance(sampleID) {
		t.Errorf("the API was asked about %v, want once about the instance", same.asked)
	}

	other, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	err = googleTrust(t, &ekSource{key: &other.PublicKey}).TrustEK(ctx, ek, instance(sampleID))
	if !errors.Is(err, attest.ErrUntrusted) || !strings.Contains(err.Error(), "not the one Compute Engine reports") {
		t.Errorf("TrustEK with another key from the API = %v, want ErrUntrusted", err)
	}

	down := errors.New("compute API down")
	err = googleTrust(t, &ekSource{err: down}).TrustEK(ctx, ek, instance(sampleID))
	if !errors.Is(err, down) || errors.Is(err, attest.ErrUntrusted) {
		t.Errorf("TrustEK with the API failing = %v, want its error, not a refusal", err)
	}

	// The cheap checks come first: a certificate for another instance never costs an API call.
	asked := &ekSource{key: ek.Public}
	if err := googleTrust(t, asked).TrustEK(ctx, ek, instance("1")); err == nil || len(asked.asked) != 0 {
		t.Errorf("TrustEK for another instance = %v after %d API calls, want a refusal before any", err, len(asked.asked))
	}
}

// TestSameShapeCA checks the test CA's certificates the way Google's are checked, and that neither CA
// vouches for the other's keys.
func TestSameShapeCA(t *testing.T) {
	ctx := context.Background()
	ca, err := shieldedvmtest.NewCA()
	if err != nil {
		t.Fatal(err)
	}
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	// An id above 2^63 takes nine bytes in DER, which must survive the round trip.
	info := shieldedvm.InstanceInfo{Zone: "europe-west1-b", ProjectNumber: 123456789012, ProjectID: "berth-lab",
		InstanceID: math.MaxUint64 - 5, InstanceName: "worker-0"}
	cert, err := ca.IssueEK(&key.PublicKey, info)
	if err != nil {
		t.Fatal(err)
	}
	got, named, err := shieldedvm.InstanceInfoOf(cert)
	if err != nil || !named || got != info {
		t.Fatalf("InstanceInfoOf = %+v, %v, %v; want %+v", got, named, err, info)
	}
	ek := attest.EK{Public: &key.PublicKey, Certificate: cert}
	id := "projects/berth-lab/zones/europe-west1-b/instances/worker-0"
	roots, inters := ca.Pools()
	if err := shieldedvm.NewTrust(roots, inters, nil, nil).TrustEK(ctx, ek, id); err != nil {
		t.Errorf("TrustEK by the test CA = %v", err)
	}
	if err := googleTrust(t, nil).TrustEK(ctx, ek, id); !errors.Is(err, attest.ErrUntrusted) || !strings.Contains(err.Error(), "does not chain") {
		t.Errorf("TrustEK of a test-CA certificate by Google's roots = %v, want a chain refusal", err)
	}
	google := sample(t, "gce_pca_rsa_ek.pem")
	if err := shieldedvm.NewTrust(roots, inters, nil, nil).TrustEK(ctx, ekOf(t, google), instance(sampleID)); !errors.Is(err, attest.ErrUntrusted) {
		t.Errorf("TrustEK of Google's certificate by the test CA = %v, want a refusal", err)
	}
}

func TestRefusals(t *testing.T) {
	ctx := context.Background()
	ca, err := shieldedvmtest.NewCA()
	if err != nil {
		t.Fatal(err)
	}
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	roots, inters := ca.Pools()
	id := "projects/berth-lab/zones/europe-west1-b/instances/7"

	// A certificate without the instance extension, as older vTPMs have.
	unnamed, err := ca.IssueEK(&key.PublicKey, shieldedvm.InstanceInfo{})
	if err != nil {
		t.Fatal(err)
	}
	unnamed.Extensions = nil
	if _, named, err := shieldedvm.InstanceInfoOf(unnamed); named || err != nil {
		t.Fatalf("InstanceInfoOf without the extension = %v, %v", named, err)
	}
	malformed := *unnamed
	malformed.Extensions = []pkix.Extension{{Id: []int{1, 3, 6, 1, 4, 1, 11129, 2, 1, 21}, Value: []byte{0x30, 0x03, 0x02, 0x01}}}

	for name, tc := range map[string]struct {
		ek       attest.EK
		id       string
		identity attest.EKPublicSource
		want     string
	}{
		"no certificate":       {attest.EK{Public: &key.PublicKey}, id, nil, "has no EK certificate"},
		"no instance id":       {attest.EK{Public: &key.PublicKey}, "", nil, "vouches only for the vTPM of a known instance"},
		"not an instance path": {attest.EK{Public: &key.PublicKey}, "i-0123456789abcdef0", nil, "is not projects/"},
		"unnamed, no API":      {attest.EK{Public: &key.PublicKey, Certificate: unnamed}, id, nil, "names no instance"},
		"malformed extension":  {attest.EK{Public: &key.PublicKey, Certificate: &malformed}, id, nil, "instance extension is malformed"},
	} {
		t.Run(name, func(t *testing.T) {
			err := shieldedvm.NewTrust(roots, inters, tc.identity, nil).TrustEK(ctx, tc.ek, tc.id)
			if !errors.Is(err, attest.ErrUntrusted) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("TrustEK = %v, want ErrUntrusted saying %q", err, tc.want)
			}
		})
	}

	// The Compute API binds an unnamed certificate to its instance.
	if err := shieldedvm.NewTrust(roots, inters, &ekSource{key: &key.PublicKey}, nil).TrustEK(ctx, attest.EK{Public: &key.PublicKey, Certificate: unnamed}, id); err != nil {
		t.Errorf("TrustEK of an unnamed certificate the API confirms = %v", err)
	}
}

func TestParseInstance(t *testing.T) {
	for _, ok := range []string{
		"projects/berth-lab/zones/europe-west1-b/instances/worker-0",
		"projects/google.com:wuale-gcp-testing/zones/us-central1-a/instances/218557372616137117",
	} {
		inst, err := shieldedvm.ParseInstance(ok)
		if err != nil || inst.String() != ok {
			t.Errorf("ParseInstance(%q) = %v, %v", ok, inst, err)
		}
	}
	for _, bad := range []string{"", "projects/p/zones/z/instances/i", "projects/berth-lab/zones/europe-west1/instances/w",
		"projects/berth-lab/zones/europe-west1-b/instances/Worker", "projects/berth-lab/zones/europe-west1-b/instances/w/x",
		"projects/berth-lab/zones/europe-west1-b/instances/123456789012345678901",
		"projects/berth-lab/zones/europe-west1-b/instances/18446744073709551616"} {
		if _, err := shieldedvm.ParseInstance(bad); err == nil {
			t.Errorf("ParseInstance(%q) = nil error", bad)
		}
	}
}
