package joinservice

import (
	"bytes"
	"context"
	"crypto/x509"
	"encoding/hex"
	"net/netip"
	"strings"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes/fake"

	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/keys"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/policy"
)

type nilPolicy struct{}

func (nilPolicy) Load() *policy.Policy { return nil }

type noInstances struct{}

func (noInstances) InstanceByAddress(context.Context, netip.Addr) (*metadata.Instance, error) {
	return nil, metadata.ErrNotFound
}

func secret(b byte) []byte { return bytes.Repeat([]byte{b}, 32) }

func validConfig(t testing.TB) Config {
	t.Helper()
	ca, err := pki.NewCA("kubernetes", time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	client := fake.NewClientset()
	return Config{
		Verifier:          attest.NewVerifier(attest.NewCertChain(x509.NewCertPool(), nil, nil)),
		Policy:            nilPolicy{},
		Instances:         noInstances{},
		Tokens:            &KubeTokens{Client: client},
		Disks:             &KubeDisks{Client: client},
		MasterSecret:      secret(1),
		Salt:              secret(2),
		KubernetesCA:      ca,
		APIServerEndpoint: "10.0.0.1:6443",
	}
}

func TestNewRefusesIncompleteConfig(t *testing.T) {
	tests := []struct {
		name    string
		mutate  func(*Config)
		wantErr string
	}{
		{name: "no verifier", mutate: func(c *Config) { c.Verifier = nil }, wantErr: "verifier"},
		{name: "no policy", mutate: func(c *Config) { c.Policy = nil }, wantErr: "policy"},
		{name: "no instances", mutate: func(c *Config) { c.Instances = nil }, wantErr: "instances"},
		{name: "no tokens", mutate: func(c *Config) { c.Tokens = nil }, wantErr: "tokens"},
		{name: "no disks", mutate: func(c *Config) { c.Disks = nil }, wantErr: "disks"},
		{name: "no Kubernetes CA", mutate: func(c *Config) { c.KubernetesCA = nil }, wantErr: "Kubernetes CA is required"},
		{name: "no API server endpoint", mutate: func(c *Config) { c.APIServerEndpoint = "" }, wantErr: "API server endpoint is required"},
		{name: "no master secret", mutate: func(c *Config) { c.MasterSecret = nil }, wantErr: "master secret"},
		{name: "short master secret", mutate: func(c *Config) { c.MasterSecret = []byte("short") }, wantErr: "master secret"},
		{name: "no salt", mutate: func(c *Config) { c.Salt = nil }, wantErr: "salt"},
		{name: "Kubernetes CA with another key", mutate: func(c *Config) {
			other, err := pki.NewKey()
			if err != nil {
				t.Fatal(err)
			}
			c.KubernetesCA = &pki.CA{Cert: c.KubernetesCA.Cert, Key: other}
		}, wantErr: "key is not the one its certificate names"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := validConfig(t)
			tt.mutate(&cfg)
			s, err := New(cfg)
			if err == nil {
				t.Fatalf("New = %v, want an error", s)
			}
			if !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("error %q does not contain %q", err, tt.wantErr)
			}
			if strings.Contains(err.Error(), hex.EncodeToString(secret(1))) || strings.Contains(err.Error(), "\x01\x01\x01") {
				t.Errorf("error %q carries the master secret", err)
			}
		})
	}
}

func TestNewDefaults(t *testing.T) {
	cfg := validConfig(t)
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if s.cfg.TokenTTL != 10*time.Minute || s.cfg.Timeout != 30*time.Second || s.cfg.Clock == nil || s.cfg.Logger == nil {
		t.Errorf("defaults: TokenTTL %v, Timeout %v, Clock set %v, Logger set %v",
			s.cfg.TokenTTL, s.cfg.Timeout, s.cfg.Clock != nil, s.cfg.Logger != nil)
	}
	if cap(s.workers) != DefaultWorkers() {
		t.Errorf("%d workers, want DefaultWorkers() = %d", cap(s.workers), DefaultWorkers())
	}
	if want := pki.SPKIPin(cfg.KubernetesCA.Cert); len(s.caPins) != 1 || s.caPins[0] != want {
		t.Errorf("CA pins %v, want [%s]", s.caPins, want)
	}
	if want, _ := keys.ClusterIDOf(cfg.MasterSecret, cfg.Salt); s.clusterID != want {
		t.Errorf("cluster ID %q, want %q", s.clusterID, want)
	}

	cfg.TokenTTL, cfg.Timeout, cfg.Workers = 3*time.Minute, 5*time.Second, 3
	s, err = New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if s.cfg.TokenTTL != 3*time.Minute || s.cfg.Timeout != 5*time.Second || cap(s.workers) != 3 {
		t.Errorf("configured TokenTTL %v, Timeout %v and 3 workers were replaced (%d workers)", s.cfg.TokenTTL, s.cfg.Timeout, cap(s.workers))
	}
}
