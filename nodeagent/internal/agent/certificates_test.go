package agent

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
	"time"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
)

// TestAdminCopy: the join service's kubeconfig names admin.conf's certificate and key as files on the state
// disk (which client-go re-reads), and follows a renewal of admin.conf; an admin.conf without inline
// credentials is used as it is.
func TestAdminCopy(t *testing.T) {
	dir := t.TempDir()
	a := &Agent{cfg: &Config{Paths: nodestate.Paths{State: filepath.Join(dir, "state"), KubernetesDir: filepath.Join(dir, "etc")}}}
	if err := os.MkdirAll(a.cfg.Paths.KubernetesDir, 0o700); err != nil {
		t.Fatal(err)
	}
	ca, err := pki.NewCA("kubernetes", time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	writeAdmin := func(user *clientcmdapi.AuthInfo) {
		cfg := clientcmdapi.NewConfig()
		cfg.Clusters["c"] = &clientcmdapi.Cluster{Server: "https://10.0.0.10:6443", CertificateAuthorityData: ca.CertPEM()}
		cfg.AuthInfos["admin"] = user
		cfg.Contexts["admin@c"] = &clientcmdapi.Context{Cluster: "c", AuthInfo: "admin"}
		cfg.CurrentContext = "admin@c"
		if err := clientcmd.WriteToFile(*cfg, a.adminConf()); err != nil {
			t.Fatal(err)
		}
	}
	for _, round := range []string{"first", "renewed"} {
		cert, key := []byte(round+" certificate"), []byte(round+" key")
		writeAdmin(&clientcmdapi.AuthInfo{ClientCertificateData: cert, ClientKeyData: key})
		path, err := a.writeAdminCopy()
		if err != nil {
			t.Fatal(err)
		}
		if filepath.Dir(filepath.Dir(path)) != a.cfg.Paths.State {
			t.Errorf("the copy is at %s, not on the state disk", path)
		}
		cfg, err := clientcmd.LoadFromFile(path)
		if err != nil {
			t.Fatal(err)
		}
		user := cfg.AuthInfos["admin"]
		if len(user.ClientCertificateData) > 0 || len(user.ClientKeyData) > 0 || cfg.Clusters["c"].Server != "https://10.0.0.10:6443" {
			t.Fatalf("%s copy: inline credentials or another server: %+v", round, cfg)
		}
		for file, want := range map[string][]byte{user.ClientCertificate: cert, user.ClientKey: key} {
			if got, err := os.ReadFile(file); err != nil || !bytes.Equal(got, want) {
				t.Errorf("%s copy: %s holds %q (%v), want %q", round, file, got, err, want)
			}
		}
		if info, err := os.Stat(user.ClientKey); err != nil || info.Mode().Perm() != 0o600 {
			t.Errorf("%s copy: the key file's mode: %v, %v", round, info, err)
		}
	}
	writeAdmin(&clientcmdapi.AuthInfo{Token: "abc"})
	if path, err := a.writeAdminCopy(); err != nil || path != a.adminConf() {
		t.Errorf("admin.conf with a token: %q, %v; want admin.conf itself", path, err)
	}
}
