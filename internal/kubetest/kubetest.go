// Package kubetest runs a real etcd and kube-apiserver on loopback for tests, from the binaries that
// scripts/build-k8s.sh builds from Kubernetes' own Go modules, and hands out an admin kubeconfig.
package kubetest

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/repotest"
)

// APIServer is a running API server with its etcd.
type APIServer struct {
	URL        string
	Kubeconfig []byte // admin (system:masters)
	Client     kubernetes.Interface
	// CA is the cluster's CA, key included, for tests that issue certificates as a control plane does.
	CA *pki.CA

	t         testing.TB
	apiserver *process
	ready     func()
}

// Start runs etcd and kube-apiserver until the test ends.
func Start(t testing.TB) *APIServer {
	t.Helper()
	bin := kubeBin(t)
	dir := t.TempDir()
	etcdClient, etcdPeer, apiPort := FreePort(t), FreePort(t), FreePort(t)

	now := time.Now()
	ca, err := pki.NewCA("kubetest-ca", now, 24*time.Hour)
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
	serving, servingKey := issue(t, ca, func(key any) (*x509.Certificate, error) {
		return ca.IssueServer(key, []string{"localhost"}, []net.IP{net.IPv4(127, 0, 0, 1)}, now, time.Hour)
	})
	admin, adminKey := issue(t, ca, func(key any) (*x509.Certificate, error) {
		return ca.IssueClient(pki.ClientTemplate{CommonName: "kubetest-admin", Organization: []string{"system:masters"}}, key, now, time.Hour)
	})
	saKey, err := pki.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	saKeyPEM, err := pki.EncodeKeyPEM(saKey)
	if err != nil {
		t.Fatal(err)
	}
	saPub, err := x509.MarshalPKIXPublicKey(saKey.Public())
	if err != nil {
		t.Fatal(err)
	}

	start(t, dir, "etcd", filepath.Join(bin, "etcd"),
		"--data-dir", filepath.Join(dir, "etcd"), "--name", "kubetest",
		"--listen-client-urls", fmt.Sprintf("http://127.0.0.1:%d", etcdClient),
		"--advertise-client-urls", fmt.Sprintf("http://127.0.0.1:%d", etcdClient),
		"--listen-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", etcdPeer),
		"--initial-advertise-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", etcdPeer),
		"--initial-cluster", fmt.Sprintf("kubetest=http://127.0.0.1:%d", etcdPeer))
	apiserver := start(t, dir, "kube-apiserver", filepath.Join(bin, "kube-apiserver"),
		"--etcd-servers", fmt.Sprintf("http://127.0.0.1:%d", etcdClient),
		"--bind-address", "127.0.0.1", "--secure-port", fmt.Sprint(apiPort),
		"--tls-cert-file", write("serving.crt", pki.EncodeCertPEM(serving)), "--tls-private-key-file", write("serving.key", servingKey),
		"--client-ca-file", write("ca.crt", ca.CertPEM()),
		"--service-account-issuer", "https://kubernetes.default.svc",
		"--service-account-key-file", write("sa.pub", pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: saPub})),
		"--service-account-signing-key-file", write("sa.key", saKeyPEM),
		"--service-cluster-ip-range", "10.96.0.0/16", "--authorization-mode", "RBAC",
		"--cert-dir", filepath.Join(dir, "apiserver-certs"))

	s := &APIServer{URL: fmt.Sprintf("https://127.0.0.1:%d", apiPort), CA: ca, t: t, apiserver: apiserver}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["kubetest"] = &clientcmdapi.Cluster{Server: s.URL, CertificateAuthorityData: ca.CertPEM()}
	cfg.AuthInfos["admin"] = &clientcmdapi.AuthInfo{ClientCertificateData: pki.EncodeCertPEM(admin), ClientKeyData: adminKey}
	cfg.Contexts["kubetest"] = &clientcmdapi.Context{Cluster: "kubetest", AuthInfo: "admin"}
	cfg.CurrentContext = "kubetest"
	if s.Kubeconfig, err = clientcmd.Write(*cfg); err != nil {
		t.Fatal(err)
	}
	rc, err := clientcmd.RESTConfigFromKubeConfig(s.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	if s.Client, err = kubernetes.NewForConfig(rc); err != nil {
		t.Fatal(err)
	}
	s.ready = func() { waitReady(t, s.URL, ca.Cert, pki.EncodeCertPEM(admin), adminKey, dir) }
	s.ready()
	return s
}

// RestartAPIServer kills kube-apiserver (SIGKILL, as a crash would), starts it again on the same etcd and
// port, and waits until it is ready. It returns when the server was down and is ready again.
func (s *APIServer) RestartAPIServer() {
	s.t.Helper()
	s.apiserver.kill()
	s.apiserver.run(s.t)
	s.ready()
}

func issue(t testing.TB, ca *pki.CA, sign func(key any) (*x509.Certificate, error)) (*x509.Certificate, []byte) {
	t.Helper()
	key, err := pki.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	cert, err := sign(key.Public())
	if err != nil {
		t.Fatal(err)
	}
	keyPEM, err := pki.EncodeKeyPEM(key)
	if err != nil {
		t.Fatal(err)
	}
	return cert, keyPEM
}

// process is a server the test runs, with its output appended to dir/<name>.log.
type process struct {
	name, bin, log string
	args           []string
	cmd            *exec.Cmd
	logFile        *os.File
}

// start runs a server process; it is stopped when the test ends, in reverse order of starting, so the API
// server stops before etcd (the other way round it waits 30 s).
func start(t testing.TB, dir, name, bin string, args ...string) *process {
	t.Helper()
	p := &process{name: name, bin: bin, args: args, log: filepath.Join(dir, name+".log")}
	p.run(t)
	t.Cleanup(p.kill)
	return p
}

func (p *process) run(t testing.TB) {
	t.Helper()
	log, err := os.OpenFile(p.log, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(p.bin, p.args...)
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		log.Close()
		t.Fatalf("starting %s: %v", p.name, err)
	}
	p.cmd, p.logFile = cmd, log
}

func (p *process) kill() {
	if p.cmd == nil {
		return
	}
	p.cmd.Process.Kill()
	p.cmd.Wait()
	p.logFile.Close()
	p.cmd = nil
}

func waitReady(t testing.TB, url string, ca *x509.Certificate, certPEM, keyPEM []byte, dir string) {
	t.Helper()
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca)
	client := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: roots, Certificates: []tls.Certificate{pair}}}}
	deadline := time.Now().Add(60 * time.Second)
	for {
		resp, err := client.Get(url + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		if time.Now().After(deadline) {
			tail, _ := os.ReadFile(filepath.Join(dir, "kube-apiserver.log"))
			lines := strings.Split(string(tail), "\n")
			t.Fatalf("kube-apiserver not ready at %s: %v\n%s", url, err, strings.Join(lines[max(0, len(lines)-20):], "\n"))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// FreePort is a TCP port free on 127.0.0.1 now, for a server the test starts next.
func FreePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// kubeBin is BERTH_KUBE_BIN, or the cache that scripts/build-k8s.sh fills (building it when needed).
func kubeBin(t testing.TB) string {
	t.Helper()
	return repotest.BinDir(t, "BERTH_KUBE_BIN", "build-k8s.sh", "building Kubernetes from its modules")
}
