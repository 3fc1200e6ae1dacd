package kubetest

import (
	"context"
	"testing"

	corev1 "k8s.io/api/core/v1"
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

	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "survives", Namespace: "default"}}
	if _, err := s.Client.CoreV1().ConfigMaps("default").Create(context.Background(), cm, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	s.RestartAPIServer()
	if _, err := s.Client.CoreV1().ConfigMaps("default").Get(context.Background(), "survives", metav1.GetOptions{}); err != nil {
		t.Errorf("after the restart: %v", err)
	}
}
