package kubetest

import (
	"context"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestStart(t *testing.T) {
	s := Start(t)
	ns, err := s.Client.CoreV1().Namespaces().Get(context.Background(), "kube-system", metav1.GetOptions{})
	if err != nil || ns.Name != "kube-system" {
		t.Fatalf("kube-system namespace: %v, %v", ns, err)
	}
	v, err := s.Client.Discovery().ServerVersion()
	if err != nil || v.GitVersion != "v1.36.3" {
		t.Fatalf("server version %v, %v", v, err)
	}
}
