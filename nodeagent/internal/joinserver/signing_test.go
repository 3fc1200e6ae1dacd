package joinserver

import (
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/nodeagent/internal/joinservice"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
)

// TestKubeletSigning: without cfssl the join service needs the CA's key and says how to do without it;
// with cfssl it reads only the certificate and the auth key, and refuses a key that is not one.
func TestKubeletSigning(t *testing.T) {
	dir := t.TempDir()
	paths := nodestate.Paths{State: filepath.Join(dir, "state"), KubernetesDir: filepath.Join(dir, "k8s"), KubeletDir: filepath.Join(dir, "kubelet")}
	ca, err := pki.NewCA("kubernetes", time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if err := nodestate.WriteFile(filepath.Join(paths.PKIDir(), "ca.crt"), ca.CertPEM(), 0o644); err != nil {
		t.Fatal(err)
	}
	keyFile := filepath.Join(dir, "cfssl-key")
	signing := func(c *CFSSLConfig) (*pki.CA, joinservice.KubeletSigner, error) {
		return KubeletSigning(filepath.Join(paths.PKIDir(), "ca.crt"), filepath.Join(paths.PKIDir(), "ca.key"), c, slog.New(slog.DiscardHandler))
	}

	if _, _, err := signing(nil); err == nil || !strings.Contains(err.Error(), "configure cfssl") {
		t.Errorf("no ca.key and no cfssl: %v, want the way out named", err)
	}

	cfg := &CFSSLConfig{URL: "http://127.0.0.1:8888", Profile: "kubelet", AuthKeyFile: keyFile}
	if err := os.WriteFile(keyFile, []byte("not hex\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, err := signing(cfg); err == nil || !strings.Contains(err.Error(), "not hexadecimal") || strings.Contains(err.Error(), "not hex\n") {
		t.Errorf("a malformed auth key: %v", err)
	}
	if err := os.WriteFile(keyFile, []byte("00112233445566778899aabbccddeeff\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	got, signer, err := signing(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if !got.Cert.Equal(ca.Cert) || got.Key != nil {
		t.Error("with cfssl the CA is its certificate alone")
	}
	s, ok := signer.(joinservice.CFSSLSigner)
	if !ok || s.Signer.URL != cfg.URL || s.Signer.Profile != "kubelet" || len(s.Signer.AuthKey) != 16 {
		t.Errorf("signer %#v, want the configured CFSSL", signer)
	}

	if err := nodestate.WriteFile(filepath.Join(paths.PKIDir(), "ca.key"), mustKeyPEM(t, ca), 0o600); err != nil {
		t.Fatal(err)
	}
	got, signer, err = signing(nil)
	if err != nil || got.Key == nil || signer != nil {
		t.Errorf("with ca.key and no cfssl: CA key %v, signer %v, %v; want the CA's own key", got.Key != nil, signer, err)
	}
}

func mustKeyPEM(t *testing.T, ca *pki.CA) []byte {
	t.Helper()
	key, err := ca.KeyPEM()
	if err != nil {
		t.Fatal(err)
	}
	return key
}
