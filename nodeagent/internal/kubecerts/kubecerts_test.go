package kubecerts

import (
	"encoding/pem"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
)

// certPEM is a certificate that expires at notAfter, in PEM.
func certPEM(t *testing.T, notAfter time.Time) []byte {
	t.Helper()
	ca, err := pki.NewCA("test", notAfter.Add(-time.Hour), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	return ca.CertPEM()
}

func kubeconfig(t *testing.T, user *clientcmdapi.AuthInfo) []byte {
	t.Helper()
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["c"] = &clientcmdapi.Cluster{Server: "https://10.0.0.1:6443"}
	cfg.AuthInfos["u"] = user
	cfg.Contexts["x"] = &clientcmdapi.Context{Cluster: "c", AuthInfo: "u"}
	cfg.CurrentContext = "x"
	data, err := clientcmd.Write(*cfg)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// TestRead: a certificate is read from a PEM file (a key before it, as in the kubelet's client file) or a
// kubeconfig (inline, or in a file it names relative to itself); anything else is an error that says why,
// and a missing file is fs.ErrNotExist.
func TestRead(t *testing.T) {
	dir := t.TempDir()
	end := time.Date(2027, 11, 28, 10, 0, 0, 0, time.UTC)
	write := func(name string, data []byte) string {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	write("client.pem", certPEM(t, end.Add(2*time.Hour)))
	keyFirst := append(pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: []byte("not read")}), certPEM(t, end.Add(time.Hour))...)
	for path, want := range map[string]time.Time{
		write("apiserver.crt", certPEM(t, end)):                                                                             end,
		write("kubelet-client-current.pem", keyFirst):                                                                       end.Add(time.Hour),
		write("kubelet.conf", kubeconfig(t, &clientcmdapi.AuthInfo{ClientCertificate: "client.pem"})):                       end.Add(2 * time.Hour),
		write("admin.conf", kubeconfig(t, &clientcmdapi.AuthInfo{ClientCertificateData: certPEM(t, end.Add(3*time.Hour))})): end.Add(3 * time.Hour),
	} {
		cert, err := Read(path)
		if err != nil || !cert.NotAfter.Equal(want) {
			t.Errorf("%s: %v, %v; want a certificate ending %v", filepath.Base(path), cert, err, want)
		}
	}
	for path, want := range map[string]string{
		write("garbage.crt", []byte("neither PEM nor YAML: {")):                       "neither PEM nor a kubeconfig",
		write("token.conf", kubeconfig(t, &clientcmdapi.AuthInfo{Token: "x"})):        "has no client certificate",
		write("key-only.pem", pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY"})): "no PEM certificate",
	} {
		if _, err := Read(path); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want an error saying %q", filepath.Base(path), err, want)
		}
	}
	if _, err := Read(filepath.Join(dir, "absent.crt")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("absent file: %v, want fs.ErrNotExist", err)
	}
}

// TestFiles: names are unique, CAs are never kubeadm's to renew, and the kubelet's files are there.
func TestFiles(t *testing.T) {
	seen := map[string]bool{}
	var renewed int
	for _, f := range Files(nodestate.DefaultPaths) {
		if seen[f.Name] {
			t.Errorf("%s twice", f.Name)
		}
		seen[f.Name] = true
		if f.CA && f.Kubeadm {
			t.Errorf("%s: a CA marked as renewed by kubeadm", f.Name)
		}
		if f.Kubeadm {
			renewed++
		}
	}
	if renewed != 11 {
		t.Errorf("%d certificates kubeadm renews, want the 11 of `kubeadm certs renew all`", renewed)
	}
	if !seen["kubelet-client"] || !seen["kubelet-serving"] {
		t.Errorf("the kubelet's certificates are missing: %v", seen)
	}
}
