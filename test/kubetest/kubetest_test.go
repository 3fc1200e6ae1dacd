package kubetest

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"net/netip"
	"net/url"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/repotest"
)

func TestStart(t *testing.T) {
	s := Start(t)
	ns, err := s.Client.CoreV1().Namespaces().Get(context.Background(), "kube-system", metav1.GetOptions{})
	if err != nil || ns.Name != "kube-system" {
		t.Fatalf("kube-system namespace: %v, %v", ns, err)
	}
	v, err := s.Client.Discovery().ServerVersion()
	if err != nil || v.GitVersion != repotest.KubernetesVersion {
		t.Fatalf("server version %v, %v", v, err)
	}

	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "survives", Namespace: "default"}}
	if _, err := s.Client.CoreV1().ConfigMaps("default").Create(context.Background(), cm, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	s.RestartAPIServer()
	if _, err := s.Client.CoreV1().ConfigMaps("default").Get(context.Background(), "survives", metav1.GetOptions{}); err != nil {
		t.Errorf("after the restart: %v", err)
	}
}

func TestStartWithExternalControlPlane(t *testing.T) {
	ca, err := pki.NewCA("lab-ca", time.Now(), 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	addr := netip.MustParseAddr("127.0.0.2")
	s := StartWith(t, Options{Address: addr, CA: ca, ControllerManager: true})

	u, err := url.Parse(s.URL)
	if err != nil {
		t.Fatal(err)
	}
	if u.Hostname() != "127.0.0.2" || s.Address != addr || s.CA != ca {
		t.Fatalf("URL %s, Address %s, given CA kept %v: want 127.0.0.2 and the given CA", s.URL, s.Address, s.CA == ca)
	}

	roots := x509.NewCertPool()
	roots.AddCert(ca.Cert)
	conn, err := tls.Dial("tcp", u.Host, &tls.Config{RootCAs: roots, ServerName: "127.0.0.2"})
	if err != nil {
		t.Fatalf("serving certificate against the given CA for 127.0.0.2: %v", err)
	}
	chain := conn.ConnectionState().VerifiedChains[0]
	conn.Close()
	if !chain[len(chain)-1].Equal(ca.Cert) {
		t.Errorf("serving certificate chains to %s, not the given CA", chain[len(chain)-1].Subject)
	}

	ctx := context.Background()
	if _, err := s.Client.CoreV1().ServiceAccounts("default").Get(ctx, "default", metav1.GetOptions{}); err != nil {
		t.Errorf("default ServiceAccount the controller manager makes: %v", err)
	}
	root, err := s.Client.CoreV1().ConfigMaps("default").Get(ctx, "kube-root-ca.crt", metav1.GetOptions{})
	if err != nil || root.Data["ca.crt"] != string(ca.CertPEM()) {
		t.Errorf("kube-root-ca.crt the controller manager publishes: %v, %v", root, err)
	}

	rc, err := clientcmd.RESTConfigFromKubeConfig(s.ClientKubeconfig(t, "system:node:n1", "system:nodes"))
	if err != nil {
		t.Fatal(err)
	}
	node, err := kubernetes.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name      string
		forbidden bool
	}{
		{name: "n1"},
		{name: "n2", forbidden: true},
	}
	for _, tt := range tests {
		_, err := node.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: tt.name}}, metav1.CreateOptions{})
		if tt.forbidden && !apierrors.IsForbidden(err) || !tt.forbidden && err != nil {
			t.Errorf("system:node:n1 creating Node %s: %v, want forbidden %v", tt.name, err, tt.forbidden)
		}
	}
}
