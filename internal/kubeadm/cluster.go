package kubeadm

import (
	"context"
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/yaml"
)

// APIServerPodSelector selects the mirror pods of the kube-apiserver static pods kubeadm writes, in
// kube-system.
const APIServerPodSelector = "component=kube-apiserver,tier=control-plane"

// APIServerReleases reads, per node, the release of each API server kubeadm deployed: the tag of its
// kube-apiserver image, which kubeadm tags with the release. It is the only place each API server's own
// release shows; a request to the cluster's endpoint reaches any one. A pod whose image names no release
// (a digest, a tag of another form) is left out.
func APIServerReleases(ctx context.Context, kube kubernetes.Interface) (map[string]string, error) {
	pods, err := kube.CoreV1().Pods(metav1.NamespaceSystem).List(ctx, metav1.ListOptions{LabelSelector: APIServerPodSelector})
	if err != nil {
		return nil, fmt.Errorf("listing the kube-apiserver pods: %w", err)
	}
	out := make(map[string]string, len(pods.Items))
	for _, p := range pods.Items {
		if v := apiServerRelease(&p); v != "" {
			out[podNode(&p)] = v
		}
	}
	return out, nil
}

// podNode is the node a mirror pod runs on, or the pod's name if the pod does not say.
func podNode(p *corev1.Pod) string {
	if p.Spec.NodeName != "" {
		return p.Spec.NodeName
	}
	return p.Name
}

// apiServerRelease is the release in the tag of pod's kube-apiserver image; empty when it has none.
func apiServerRelease(pod *corev1.Pod) string {
	for _, c := range pod.Spec.Containers {
		if c.Name != "kube-apiserver" {
			continue
		}
		name := c.Image[strings.LastIndex(c.Image, "/")+1:]
		if _, tag, ok := strings.Cut(name, ":"); ok && IsRelease(tag) {
			return tag
		}
	}
	return ""
}

// ConfigMap is where kubeadm keeps the cluster's configuration, in kube-system.
const ConfigMap = "kubeadm-config"

// ClusterRelease reads the cluster's release from kubeadm's ClusterConfiguration: the one `kubeadm init`
// deployed, raised by each `kubeadm upgrade apply`, and the one `kubeadm join --control-plane` deploys.
// found is false when the cluster has no kubeadm configuration, such as an external control plane.
func ClusterRelease(ctx context.Context, kube kubernetes.Interface) (release string, found bool, err error) {
	cm, err := kube.CoreV1().ConfigMaps(metav1.NamespaceSystem).Get(ctx, ConfigMap, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return "", false, nil
	}
	if err != nil {
		return "", false, fmt.Errorf("reading kube-system/%s: %w", ConfigMap, err)
	}
	var cfg struct {
		KubernetesVersion string `json:"kubernetesVersion"`
	}
	if err := yaml.Unmarshal([]byte(cm.Data["ClusterConfiguration"]), &cfg); err != nil {
		return "", false, fmt.Errorf("kube-system/%s: ClusterConfiguration: %w", ConfigMap, err)
	}
	if !IsRelease(cfg.KubernetesVersion) {
		return "", false, fmt.Errorf("kube-system/%s: ClusterConfiguration names %q, not a release", ConfigMap, cfg.KubernetesVersion)
	}
	return cfg.KubernetesVersion, true, nil
}
