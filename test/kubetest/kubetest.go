// Package kubetest runs a real etcd and kube-apiserver on loopback for tests, from the binaries that
// scripts/build-k8s.sh builds from Kubernetes' own Go modules, and hands out kubeconfigs for the admin
// and for any other identity the cluster CA certifies.
//
// The API server authorizes with Node,RBAC and admits with NodeRestriction, as a production control
// plane does, so that it can serve as an external control plane (not made by kubeadm) for a real kubelet:
// the kubelet's certificate (CN system:node:<name>, O system:nodes) lets it register its own Node and no
// other. With Options.ControllerManager it also runs kube-controller-manager, without a cluster-signing
// key, since in the setup modelled the CA key lives in a separate signer.
package kubetest

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"sigs.k8s.io/yaml"

	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/repotest"
)

// startTimeout bounds how long a server may take to become ready; generous, as the machine is shared.
const startTimeout = 2 * time.Minute

var loopback = netip.AddrFrom4([4]byte{127, 0, 0, 1})

// Options changes what StartWith runs; the zero value is what Start runs.
type Options struct {
	// Address is the IPv4 address kube-apiserver binds to, advertises and names in its serving
	// certificate (besides 127.0.0.1 and localhost); 127.0.0.1 when not set. etcd stays on 127.0.0.1.
	Address netip.Addr
	// CA, key included, is the cluster CA instead of a fresh one: it issues the serving, admin and client
	// certificates, and the API server accepts client certificates it signed.
	CA *pki.CA
	// ControllerManager also runs kube-controller-manager and waits until its controllers run.
	ControllerManager bool
}

// APIServer is a running API server with its etcd.
type APIServer struct {
	URL        string     // https://<Address>:<port>
	Address    netip.Addr // the address kube-apiserver binds to and advertises
	Kubeconfig []byte     // admin (system:masters)
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
	return StartWith(t, Options{})
}

// StartWith runs etcd, kube-apiserver and, if asked, kube-controller-manager until the test ends.
func StartWith(t testing.TB, o Options) *APIServer {
	t.Helper()
	addr := o.Address
	if !addr.IsValid() {
		addr = loopback
	}
	if !addr.Is4() {
		t.Fatalf("kubetest: address %s is not IPv4 (the service range is 10.96.0.0/16)", addr)
	}
	now := time.Now()
	ca := o.CA
	if ca == nil {
		var err error
		if ca, err = pki.NewCA("kubetest-ca", now, 24*time.Hour); err != nil {
			t.Fatal(err)
		}
	} else if ca.Cert == nil || ca.Key == nil {
		t.Fatal("kubetest: Options.CA needs both its certificate and its key")
	}

	bin := kubeBin(t)
	dir := t.TempDir()
	etcdClient, etcdPeer, apiPort := FreePort(t), FreePort(t), freePort(t, addr)
	write := func(name string, data []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, data, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	ips := []net.IP{net.IPv4(127, 0, 0, 1)}
	if addr != loopback {
		ips = append(ips, net.IP(addr.AsSlice()))
	}
	serving, servingKey := issue(t, ca, func(key any) (*x509.Certificate, error) {
		return ca.IssueServer(key, []string{"localhost"}, ips, now, time.Hour)
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
	caFile, saKeyFile := write("ca.crt", ca.CertPEM()), write("sa.key", saKeyPEM)

	start(t, dir, "etcd", filepath.Join(bin, "etcd"),
		"--data-dir", filepath.Join(dir, "etcd"), "--name", "kubetest",
		"--listen-client-urls", fmt.Sprintf("http://127.0.0.1:%d", etcdClient),
		"--advertise-client-urls", fmt.Sprintf("http://127.0.0.1:%d", etcdClient),
		"--listen-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", etcdPeer),
		"--initial-advertise-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", etcdPeer),
		"--initial-cluster", fmt.Sprintf("kubetest=http://127.0.0.1:%d", etcdPeer))
	apiserver := start(t, dir, "kube-apiserver", filepath.Join(bin, "kube-apiserver"),
		"--etcd-servers", fmt.Sprintf("http://127.0.0.1:%d", etcdClient),
		"--bind-address", addr.String(), "--advertise-address", addr.String(), "--secure-port", fmt.Sprint(apiPort),
		"--tls-cert-file", write("serving.crt", pki.EncodeCertPEM(serving)), "--tls-private-key-file", write("serving.key", servingKey),
		"--client-ca-file", caFile,
		"--service-account-issuer", "https://kubernetes.default.svc",
		"--service-account-key-file", write("sa.pub", pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: saPub})),
		"--service-account-signing-key-file", saKeyFile,
		"--service-cluster-ip-range", "10.96.0.0/16",
		"--authorization-mode", "Node,RBAC", "--enable-admission-plugins", "NodeRestriction",
		"--cert-dir", filepath.Join(dir, "apiserver-certs"))

	s := &APIServer{
		URL:       "https://" + netip.AddrPortFrom(addr, uint16(apiPort)).String(),
		Address:   addr,
		CA:        ca,
		t:         t,
		apiserver: apiserver,
	}
	admin, adminKey := issue(t, ca, func(key any) (*x509.Certificate, error) {
		return ca.IssueClient(pki.ClientTemplate{CommonName: "kubetest-admin", Organization: []string{"system:masters"}}, key, now, time.Hour)
	})
	if s.Kubeconfig, err = kubeconfig(s.URL, ca, "admin", pki.EncodeCertPEM(admin), adminKey); err != nil {
		t.Fatal(err)
	}
	rc, err := clientcmd.RESTConfigFromKubeConfig(s.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	if s.Client, err = kubernetes.NewForConfig(rc); err != nil {
		t.Fatal(err)
	}
	readyz := readyzProbe(t, s.URL, ca.Cert, pki.EncodeCertPEM(admin), adminKey)
	s.ready = func() { waitUntil(t, s.apiserver, "kube-apiserver ready at "+s.URL, readyz) }
	s.ready()

	if o.ControllerManager {
		s.startControllerManager(t, bin, dir, write, caFile, saKeyFile)
	}
	return s
}

// startControllerManager runs kube-controller-manager with the default controllers and waits until
// they run. It gets the service-account signing key (for the legacy token controller) but no cluster
// signing key, so it signs no CSR.
func (s *APIServer) startControllerManager(t testing.TB, bin, dir string, write func(string, []byte) string, caFile, saKeyFile string) {
	t.Helper()
	kcm := start(t, dir, "kube-controller-manager", filepath.Join(bin, "kube-controller-manager"),
		"--kubeconfig", write("controller-manager.kubeconfig", s.ClientKubeconfig(t, "system:kube-controller-manager")),
		"--service-account-private-key-file", saKeyFile,
		"--use-service-account-credentials",
		"--root-ca-file", caFile,
		"--leader-elect=false",
		"--bind-address", "127.0.0.1", "--secure-port", fmt.Sprint(FreePort(t)))
	// The serviceaccount controller makes "default" in each namespace, the root-ca publisher puts
	// kube-root-ca.crt in each: both there means the controllers run, not just the process.
	waitUntil(t, kcm, "kube-controller-manager running its controllers", func() (bool, error) {
		ctx := context.Background()
		if _, err := s.Client.CoreV1().ServiceAccounts("default").Get(ctx, "default", metav1.GetOptions{}); err != nil {
			return false, err
		}
		if _, err := s.Client.CoreV1().ConfigMaps("default").Get(ctx, "kube-root-ca.crt", metav1.GetOptions{}); err != nil {
			return false, err
		}
		return true, nil
	})
}

// ClientKubeconfig is a kubeconfig for user in groups, with a client certificate the cluster CA issues
// for an hour, for tests that run a component with only the rights it has in production.
func (s *APIServer) ClientKubeconfig(t testing.TB, user string, groups ...string) []byte {
	t.Helper()
	cert, key := issue(t, s.CA, func(pub any) (*x509.Certificate, error) {
		return s.CA.IssueClient(pki.ClientTemplate{CommonName: user, Organization: groups}, pub, time.Now(), time.Hour)
	})
	kc, err := kubeconfig(s.URL, s.CA, user, pki.EncodeCertPEM(cert), key)
	if err != nil {
		t.Fatal(err)
	}
	return kc
}

// RestartAPIServer kills kube-apiserver (SIGKILL, as a crash would), starts it again on the same etcd and
// port, and waits until it is ready. It returns when the server was down and is ready again.
func (s *APIServer) RestartAPIServer() {
	s.t.Helper()
	s.apiserver.kill()
	s.apiserver.run(s.t)
	s.ready()
}

func kubeconfig(server string, ca *pki.CA, user string, certPEM, keyPEM []byte) ([]byte, error) {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["kubetest"] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: ca.CertPEM()}
	cfg.AuthInfos[user] = &clientcmdapi.AuthInfo{ClientCertificateData: certPEM, ClientKeyData: keyPEM}
	cfg.Contexts["kubetest"] = &clientcmdapi.Context{Cluster: "kubetest", AuthInfo: user}
	cfg.CurrentContext = "kubetest"
	kc, err := clientcmd.Write(*cfg)
	if err != nil {
		return nil, fmt.Errorf("writing kubeconfig for %q: %w", user, err)
	}
	return kc, nil
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
	exited         chan struct{} // closed once the process has exited and its log is closed
}

// start runs a server process; it is stopped when the test ends, in reverse order of starting, so the
// controller manager stops before the API server and the API server before etcd (the other way round it
// waits 30 s).
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
	exited := make(chan struct{})
	go func() {
		cmd.Wait()
		log.Close()
		close(exited)
	}()
	p.cmd, p.exited = cmd, exited
}

func (p *process) kill() {
	if p.cmd == nil {
		return
	}
	p.cmd.Process.Kill()
	<-p.exited
	p.cmd = nil
}

// tail is the end of the process's log, for failure messages.
func (p *process) tail() string {
	out, err := os.ReadFile(p.log)
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	lines := strings.Split(strings.TrimRight(string(out), "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-30):], "\n")
}

// waitUntil polls done until it reports true; it fails the test with the tail of p's log if p exits
// first or startTimeout passes.
func waitUntil(t testing.TB, p *process, what string, done func() (bool, error)) {
	t.Helper()
	deadline := time.Now().Add(startTimeout)
	for {
		ok, err := done()
		if ok {
			return
		}
		select {
		case <-p.exited:
			t.Fatalf("waiting for %s: %s exited (%v); last error: %v\n%s", what, p.name, p.cmd.ProcessState, err, p.tail())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("waiting for %s: not after %s; last error: %v\n%s", what, startTimeout, err, p.tail())
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// readyzProbe reports whether the API server at url answers /readyz with 200 to the admin.
func readyzProbe(t testing.TB, url string, ca *x509.Certificate, certPEM, keyPEM []byte) func() (bool, error) {
	t.Helper()
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca)
	client := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: roots, Certificates: []tls.Certificate{pair}}}}
	return func() (bool, error) {
		resp, err := client.Get(url + "/readyz")
		if err != nil {
			return false, err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return false, fmt.Errorf("/readyz: %s", resp.Status)
		}
		return true, nil
	}
}

// FreePort is a TCP port free on 127.0.0.1 now, for a server the test starts next.
func FreePort(t testing.TB) int {
	t.Helper()
	return freePort(t, loopback)
}

func freePort(t testing.TB, addr netip.Addr) int {
	t.Helper()
	l, err := net.Listen("tcp", netip.AddrPortFrom(addr, 0).String())
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

// CreateRBAC creates the Roles, RoleBindings, ClusterRoles and ClusterRoleBindings of manifest, YAML
// documents separated by "---" lines, as kubectl create -f would.
func (s *APIServer) CreateRBAC(t testing.TB, manifest []byte) {
	t.Helper()
	ctx := context.Background()
	rbac := s.Client.RbacV1()
	for doc := range strings.SplitSeq(string(manifest), "\n---\n") {
		var head struct {
			metav1.TypeMeta `json:",inline"`
			Metadata        metav1.ObjectMeta `json:"metadata"`
		}
		if err := yaml.Unmarshal([]byte(doc), &head); err != nil {
			t.Fatalf("kubetest: a manifest document does not parse: %v\n%s", err, doc)
		}
		ns := head.Metadata.Namespace
		var err error
		switch head.Kind {
		case "Role":
			err = createAs(ctx, doc, rbac.Roles(ns).Create)
		case "RoleBinding":
			err = createAs(ctx, doc, rbac.RoleBindings(ns).Create)
		case "ClusterRole":
			err = createAs(ctx, doc, rbac.ClusterRoles().Create)
		case "ClusterRoleBinding":
			err = createAs(ctx, doc, rbac.ClusterRoleBindings().Create)
		default:
			t.Fatalf("kubetest: CreateRBAC takes RBAC objects, not %q", head.Kind)
		}
		if err != nil {
			t.Fatalf("kubetest: creating %s %s: %v", head.Kind, head.Metadata.Name, err)
		}
	}
}

// createAs decodes doc into a T, refusing fields T does not have, and creates it with create.
func createAs[T any](ctx context.Context, doc string, create func(context.Context, *T, metav1.CreateOptions) (*T, error)) error {
	obj := new(T)
	if err := yaml.UnmarshalStrict([]byte(doc), obj); err != nil {
		return err
	}
	_, err := create(ctx, obj, metav1.CreateOptions{})
	return err
}
