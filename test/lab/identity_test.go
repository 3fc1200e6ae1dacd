package lab

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"os"
	"regexp"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// bootstrapTokenPattern is the form of a kubeadm bootstrap token.
var bootstrapTokenPattern = regexp.MustCompile(`\b[a-z0-9]{6}\.[a-z0-9]{16}\b`)

// checkNodeIdentityOnlyFromJoinService is root on the joined worker w trying to become the node victim
// through the API: with the bootstrap token its join ticket carried, and with its kubelet's own client
// certificate, it asks for a client certificate for victim's name; neither CSR is approved. Meanwhile a CSR
// for w's own name with w's own credentials, what the kubelet's certificate rotation sends, is approved and
// signed: rotation of existing nodes still works.
func checkNodeIdentityOnlyFromJoinService(ctx context.Context, t *testing.T, l *Lab, w *Node, victim string) {
	t.Helper()
	admin, err := clientcmd.BuildConfigFromFlags("", l.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	adminClient, err := kubernetes.NewForConfig(admin)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := adminClient.RbacV1().ClusterRoleBindings().Get(ctx, "kubeadm:node-autoapprove-bootstrap", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("kubeadm's auto-approval of bootstrap tokens' node CSRs: %v, want it removed", err)
	}
	if _, err := adminClient.RbacV1().ClusterRoleBindings().Get(ctx, "kubeadm:node-autoapprove-certificate-rotation", metav1.GetOptions{}); err != nil {
		t.Errorf("kubeadm's auto-approval of nodes' own renewals: %v, want it kept", err)
	}

	joinConfig, err := os.ReadFile(w.path("fs/var/lib/berth/kubeadm-join.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	token := bootstrapTokenPattern.FindString(string(joinConfig))
	if token == "" {
		t.Fatalf("%s's kubeadm join configuration holds no bootstrap token", w.Name)
	}
	certPath, err := w.kubeletCertPath()
	if err != nil {
		t.Fatal(err)
	}
	base := rest.Config{Host: admin.Host, TLSClientConfig: rest.TLSClientConfig{CAData: admin.CAData, CAFile: admin.CAFile}}
	withToken, withKubelet := base, base
	withToken.BearerToken = token
	withKubelet.CertFile, withKubelet.KeyFile = certPath, certPath

	type attempt struct {
		what string
		cfg  *rest.Config
		node string
	}
	foreign := []attempt{
		{"the bootstrap token of " + w.Name + "'s ticket", &withToken, victim},
		{w.Name + "'s kubelet credentials", &withKubelet, victim},
	}
	own := attempt{w.Name + "'s kubelet credentials, its own name", &withKubelet, w.Name}
	created := map[string]string{}
	for _, a := range append(foreign, own) {
		name, err := createNodeCSR(ctx, a.cfg, a.node)
		switch {
		case apierrors.IsForbidden(err) && a.node != w.Name:
			t.Logf("%s: a CSR for %s was refused outright: %v", a.what, a.node, err)
			continue
		case err != nil:
			t.Fatalf("%s: creating a CSR for %s: %v", a.what, a.node, err)
		}
		created[a.what] = name
		t.Cleanup(func() {
			adminClient.CertificatesV1().CertificateSigningRequests().Delete(context.Background(), name, metav1.DeleteOptions{})
		})
	}

	// The approver decides on each CSR as it arrives: once the one created last is signed, it has had the
	// others at least as long. Past a further moment's margin none of them may be approved.
	var signed *certificatesv1.CertificateSigningRequest
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(500 * time.Millisecond) {
		signed, err = adminClient.CertificatesV1().CertificateSigningRequests().Get(ctx, created[own.what], metav1.GetOptions{})
		if err == nil && len(signed.Status.Certificate) > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: the CSR was not signed in 2 minutes (%v, %+v): kubelet certificate rotation is broken", own.what, err, signed)
		}
	}
	cert, err := x509.ParseCertificate(firstPEMBlock(t, signed.Status.Certificate))
	if err != nil || cert.Subject.CommonName != "system:node:"+w.Name {
		t.Fatalf("%s: signed certificate %v, %v", own.what, cert, err)
	}
	time.Sleep(2 * time.Second)
	for _, a := range foreign {
		name, ok := created[a.what]
		if !ok {
			continue
		}
		csr, err := adminClient.CertificatesV1().CertificateSigningRequests().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range csr.Status.Conditions {
			if c.Type == certificatesv1.CertificateApproved {
				t.Errorf("%s: a CSR for node %s was approved (%s: %s): anyone with it can become that node", a.what, victim, c.Reason, c.Message)
			}
		}
		if len(csr.Status.Certificate) > 0 {
			t.Errorf("%s: a certificate for node %s was issued", a.what, victim)
		}
	}
}

// createNodeCSR asks, as cfg's user, for a kubelet client certificate for node, as the kubelet asks.
func createNodeCSR(ctx context.Context, cfg *rest.Config, node string) (string, error) {
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return "", err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return "", err
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		Subject: pkix.Name{CommonName: "system:node:" + node, Organization: []string{"system:nodes"}},
	}, key)
	if err != nil {
		return "", err
	}
	csr := &certificatesv1.CertificateSigningRequest{
		ObjectMeta: metav1.ObjectMeta{GenerateName: fmt.Sprintf("berthlab-%s-", node)},
		Spec: certificatesv1.CertificateSigningRequestSpec{
			Request:    pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der}),
			SignerName: certificatesv1.KubeAPIServerClientKubeletSignerName,
			Usages:     []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageClientAuth},
		},
	}
	created, err := client.CertificatesV1().CertificateSigningRequests().Create(ctx, csr, metav1.CreateOptions{})
	if err != nil {
		return "", err
	}
	return created.Name, nil
}

func firstPEMBlock(t *testing.T, data []byte) []byte {
	t.Helper()
	b, _ := pem.Decode(data)
	if b == nil {
		t.Fatalf("no PEM block in %q", data)
	}
	return b.Bytes
}
