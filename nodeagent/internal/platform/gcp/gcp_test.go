package gcp

import (
	"context"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/cloud/gcp/shieldedvm"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/nodeagent/internal/platform"
	"github.com/berthlabs/berth/test/gcemetadatatest"
)

// shieldedvmDir holds Google's real vTPM EK CAs (roots/) and real EK certificates (testdata/).
const shieldedvmDir = "../../../../internal/cloud/gcp/shieldedvm"

// pemFile writes Google's CA certificates (DER files of roots/) as one PEM bundle.
func pemFile(t *testing.T, names ...string) string {
	t.Helper()
	var out []byte
	for _, name := range names {
		der, err := os.ReadFile(filepath.Join(shieldedvmDir, "roots", name))
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})...)
	}
	path := filepath.Join(t.TempDir(), "cas.pem")
	if err := os.WriteFile(path, out, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestExtraEKCAs: a real vTPM EK certificate whose intermediate the configured CAs lack is refused, and
// trusted once extraEKCAs adds that intermediate, as an operator would add one Google started issuing from
// before a Berth release carries it. The base is ekCABundle with the cloud host root alone, standing for a
// compiled-in set one intermediate short.
func TestExtraEKCAs(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(shieldedvmDir, "testdata", "gce_uca_rsa_ek.pem"))
	if err != nil {
		t.Fatal(err)
	}
	block, _ := pem.Decode(data)
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	ek := attest.EK{Public: cert.PublicKey.(*rsa.PublicKey), Certificate: cert}
	const instance = "projects/google.com:wuale-gcp-testing/zones/us-central1-a/instances/cs-debug"

	trusts := func(cfg Config) error {
		t.Helper()
		roots, inters, err := cfg.ekCAs()
		if err != nil {
			t.Fatal(err)
		}
		return shieldedvm.NewTrust(roots, inters, nil, nil).TrustEK(context.Background(), ek, instance)
	}
	rootOnly := pemFile(t, "tpm_ek_v1_cloud_host_root.der")
	if err := trusts(Config{EKCABundle: rootOnly}); err == nil {
		t.Fatal("an EK certificate was trusted without its intermediate")
	}
	extra := pemFile(t, "tpm_ek_v1_cloud_host_intermediate_2.der", "tpm_ek_v1_cloud_host_intermediate_3.der")
	if err := trusts(Config{EKCABundle: rootOnly, ExtraEKCAs: extra}); err != nil {
		t.Errorf("with the intermediates added: %v", err)
	}
	// Added to Google's own, extra CAs take nothing away.
	if err := trusts(Config{ExtraEKCAs: pemFile(t, "ek_ak_ca_intermediate_v3.der")}); err != nil {
		t.Errorf("Google's CAs and an extra one: %v", err)
	}
}

func TestExtraEKCAsRefusesGarbage(t *testing.T) {
	empty := filepath.Join(t.TempDir(), "extra.pem")
	if err := os.WriteFile(empty, []byte("not a certificate\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for path, want := range map[string]string{
		empty:                                    "gcp.extraEKCAs " + empty + ": no certificate in the EK CA bundle",
		filepath.Join(t.TempDir(), "absent.pem"): "gcp.extraEKCAs: open ",
	} {
		if _, _, err := (Config{ExtraEKCAs: path}).ekCAs(); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ekCAs with %s = %v, want %q", path, err, want)
		}
	}
}

// TestSharedVPCNeedsNetwork: on a Shared VPC network, which the metadata server names by the host project's
// number only, the join service says what to configure instead of looking nodes up on the wrong network.
func TestSharedVPCNeedsNetwork(t *testing.T) {
	srv := gcemetadatatest.New(t, gcemetadatatest.Example())
	srv.SetFault("instance/network-interfaces/0/network", gcemetadatatest.Fault{Body: []byte("projects/999999999999/networks/shared")})
	self := &metadata.Self{UserData: metadata.UserData{InstanceGroups: map[string]metadata.Role{"europe-west1/prod-workers": metadata.RoleWorker}}}
	var env platform.Env
	_, err := New(Config{MetadataEndpoint: srv.URL}).Records(context.Background(), self, env)
	for _, want := range []string{`network "shared" of project number 999999999999`, "set gcp.network in agent.yaml to projects/<host project id>/global/networks/<name>"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Records = %v, want an error saying %q", err, want)
		}
	}
}
