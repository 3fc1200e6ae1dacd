package joinserver

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"

	"github.com/berthlabs/berth/internal/clustersecrets"
	"github.com/berthlabs/berth/nodeagent/internal/telemetry"
)

// serviceConfigTemplate is a valid configuration once DIR is a directory holding the files it names
// (serviceFiles).
const serviceConfigTemplate = `listen: 10.0.0.5:7450
inventoryFile: DIR/inventory.yaml
apiServerEndpoint: 10.0.0.5:6443
kubeconfig: DIR/join-service.kubeconfig
kubernetesCA: DIR/cluster-ca.pem
cfssl: {url: "http://10.0.0.5:8888", profile: kubelet, authKeyFile: DIR/cfssl.key}
rootKeyFile: DIR/root-key
joinCACertificate: DIR/join-ca.pem
ekCABundle: DIR/ek-ca.pem
policyFile: DIR/join-policy.yaml
clusterDNS: [10.96.0.10]
clusterDomain: cluster.local
timeout: 20s
`

var serviceFiles = []string{"inventory.yaml", "join-service.kubeconfig", "cluster-ca.pem", "cfssl.key", "root-key",
	"join-ca.pem", "ek-ca.pem", "join-policy.yaml"}

// validServiceConfig is serviceConfigTemplate with the files it names, empty, in a directory of the test's.
func validServiceConfig(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	for _, name := range serviceFiles {
		if err := os.WriteFile(filepath.Join(dir, name), nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return strings.ReplaceAll(serviceConfigTemplate, "DIR", dir)
}

func TestLoadServiceConfig(t *testing.T) {
	c, err := LoadServiceConfig(writeConfig(t, validServiceConfig(t)))
	if err != nil {
		t.Fatal(err)
	}
	if c.Listen != "10.0.0.5:7450" || c.CFSSL.Profile != "kubelet" || c.Timeout.Duration != 20*time.Second || c.PolicyConfigMap != "berth-join-policy" {
		t.Errorf("loaded %+v", c)
	}
}

func TestLoadServiceConfigRefusals(t *testing.T) {
	validServiceConfig := validServiceConfig(t)
	// Every file that cannot be read is named at once, with the line that names it.
	unreadable := strings.NewReplacer("/root-key", "/absent-root-key", "/ek-ca.pem", "/", "/join-policy.yaml", "/absent-policy.yaml").Replace(validServiceConfig)
	tests := []struct {
		name    string
		content string
		want    []string
	}{
		{"empty", "", []string{"listen is required", "apiServerEndpoint is required", "kubeconfig is required",
			"kubernetesCA is required", "rootKeyFile is required", "joinCACertificate is required", "ekCABundle is required",
			"set exactly one of inventoryFile and metadataURL", "set exactly one of cfssl and kubernetesCAKey"}},
		{"unknown field", validServiceConfig + "bootstrapToken: x\n", []string{`unknown field "bootstrapToken"`}},
		// encoding/json, under sigs.k8s.io/yaml, took any case: policyfile set policyFile.
		{"key in another case", validServiceConfig + "policyfile: /etc/berth/policy.json\n", []string{"policyfile", "policyFile"}},
		{"listen without port", strings.Replace(validServiceConfig, "listen: 10.0.0.5:7450", "listen: 10.0.0.5", 1), []string{`listen "10.0.0.5" is not ip:port`}},
		{"both signers", validServiceConfig + "kubernetesCAKey: /etc/berth/ca.key\n", []string{"set exactly one of cfssl and kubernetesCAKey"}},
		{"both record sources", validServiceConfig + "metadataURL: http://10.0.0.5:7400\n", []string{"set exactly one of inventoryFile and metadataURL"}},
		{"incomplete cfssl", strings.Replace(validServiceConfig, "profile: kubelet, ", "", 1), []string{"cfssl needs url, profile and authKeyFile"}},
		{"DNS not an IP", strings.Replace(validServiceConfig, "[10.96.0.10]", "[kube-dns]", 1), []string{`clusterDNS: "kube-dns" is not an IP address`}},
		{"metadata URL not http and a negative timeout", strings.Replace(strings.Replace(validServiceConfig, "inventoryFile: ", "# ", 1),
			"timeout: 20s", "timeout: -20s\nmetadataURL: 10.0.0.5:7400", 1),
			[]string{`line 14: metadataURL "10.0.0.5:7400" is not an http(s) URL`, "line 13: timeout: -20s is negative"}},
		// Each of these would reach a certificate, a kubelet or a dialer only when a node joins.
		{"names, domain, version and URLs of the wrong form", strings.NewReplacer(
			"apiServerEndpoint: 10.0.0.5:6443", "apiServerEndpoint: 10.0.0.5:0",
			"clusterDomain: cluster.local", "clusterDomain: cluster_local\nserverNames: [join.example, 10.0.0.5, \"not a name\"]\nkubernetesVersion: 1.36\nmetricsListen: localhost",
			`url: "http://10.0.0.5:8888"`, `url: "10.0.0.5:8888"`).Replace(validServiceConfig),
			[]string{`line 3: apiServerEndpoint: "10.0.0.5:0" has port 0`, `line 6: cfssl.url "10.0.0.5:8888" is not an http(s) URL`,
				`line 12: clusterDomain: "cluster_local" is not a DNS name`, `line 13: serverNames: "10.0.0.5" is not a DNS name`,
				`serverNames: "not a name" is not a DNS name`, `line 14: kubernetesVersion: "1.36" is not a release`,
				`line 15: metricsListen: "localhost" is not host:port`}},
		{"files that cannot be read", unreadable, []string{"line 7: rootKeyFile: open ", "absent-root-key: no such file or directory",
			"line 9: ekCABundle: ", "is not a regular file", "line 10: policyFile: open ", "absent-policy.yaml: no such file or directory"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := LoadServiceConfig(writeConfig(t, tt.content))
			if err == nil {
				t.Fatal("configuration accepted")
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
		})
	}
}

// TestServeStandaloneRefusesForeignJoinCA: a join CA certificate that another root key made is named as such
// before the service reaches the API server or listens, and neither key appears in the error.
func TestServeStandaloneRefusesForeignJoinCA(t *testing.T) {
	dir := t.TempDir()
	rootOf := func() ([]byte, *clustersecrets.Secrets) {
		root := make([]byte, 32)
		rand.Read(root)
		s, err := clustersecrets.Derive(root)
		if err != nil {
			t.Fatal(err)
		}
		return root, s
	}
	root, _ := rootOf()
	_, other := rootOf()
	_, otherJoin, err := other.NewCAs(time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	write := func(name string, data []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, data, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	cfg := &ServiceConfig{
		RootKeyFile:       write("root-key", []byte(base64.StdEncoding.EncodeToString(root))),
		JoinCACertificate: write("join-ca.pem", otherJoin.CertPEM()),
	}
	called := false
	kube := func(string) (kubernetes.Interface, error) { called = true; return nil, errors.New("unreachable") }
	err = ServeStandalone(context.Background(), cfg, kube, slog.New(slog.DiscardHandler), telemetry.Build{})
	if !errors.Is(err, clustersecrets.ErrWrongRootKey) {
		t.Fatalf("ServeStandalone: %v, want ErrWrongRootKey", err)
	}
	if called {
		t.Error("the API server was dialled before the secrets were checked")
	}
	if strings.Contains(err.Error(), base64.StdEncoding.EncodeToString(root)) {
		t.Error("the error carries the root key")
	}
}

func TestServiceCertificateIPs(t *testing.T) {
	for _, tt := range []struct {
		name    string
		cfg     ServiceConfig
		want    string
		wantErr string
	}{
		{name: "listen address", cfg: ServiceConfig{Listen: "10.0.0.5:7450"}, want: "[10.0.0.5]"},
		{name: "server addresses win", cfg: ServiceConfig{Listen: "0.0.0.0:7450", ServerAddresses: []string{"10.0.0.6"}}, want: "[10.0.0.6]"},
		{name: "names only", cfg: ServiceConfig{Listen: "0.0.0.0:7450", ServerNames: []string{"join.example"}}, want: "[]"},
		{name: "unspecified listen", cfg: ServiceConfig{Listen: "0.0.0.0:7450"}, wantErr: "set serverAddresses or serverNames"},
		{name: "bad server address", cfg: ServiceConfig{Listen: "10.0.0.5:7450", ServerAddresses: []string{"join"}}, wantErr: "serverAddresses"},
		{name: "bad listen", cfg: ServiceConfig{Listen: "join:7450"}, wantErr: "listen"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ips, err := tt.cfg.certificateIPs()
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %v, want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil || fmt.Sprint(ips) != tt.want {
				t.Errorf("certificateIPs = %v, %v; want %s", ips, err, tt.want)
			}
		})
	}
}

func writeConfig(t *testing.T, content string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "join-service.yaml")
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}
