package certrenew

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/yaml"
)

// RenewedAnnotation marks a control-plane static pod with the start of the renewal that restarted it. The
// kubelet names a static pod by a hash of its manifest, so a changed annotation is a new pod: the component
// starts again and reads its renewed certificates and kubeconfig. The API server would reload its serving
// certificate by itself, but not its clients' to etcd and the kubelets; the controller manager and the
// scheduler read their kubeconfigs only at their start. etcd reads its certificates at each connection and
// is not restarted, which on a cluster of two control-plane nodes would cost etcd its quorum.
const RenewedAnnotation = "berth.dev/certificates-renewed"

// components are the static pods restarted after a renewal.
var components = []string{"kube-apiserver", "kube-controller-manager", "kube-scheduler"}

// restartStaticPods marks each component's manifest in dir with stamp and returns the components it marked.
func restartStaticPods(dir, stamp string) ([]string, error) {
	var restarted []string
	for _, c := range components {
		path := filepath.Join(dir, c+".yaml")
		data, err := os.ReadFile(path)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return restarted, fmt.Errorf("reading the static pod manifest: %w", err)
		}
		var pod corev1.Pod
		if err := yaml.Unmarshal(data, &pod); err != nil {
			return restarted, fmt.Errorf("%s: %w", path, err)
		}
		if pod.Annotations == nil {
			pod.Annotations = map[string]string{}
		}
		pod.Annotations[RenewedAnnotation] = stamp
		out, err := yaml.Marshal(&pod)
		if err != nil {
			return restarted, fmt.Errorf("%s: %w", path, err)
		}
		// Written beside and renamed over, so the kubelet never reads half a manifest; it skips dot files.
		tmp := filepath.Join(dir, "."+c+".yaml.berth")
		if err := os.WriteFile(tmp, out, 0o600); err != nil {
			return restarted, fmt.Errorf("writing the static pod manifest: %w", err)
		}
		if err := os.Rename(tmp, path); err != nil {
			return restarted, fmt.Errorf("writing the static pod manifest: %w", err)
		}
		restarted = append(restarted, c)
	}
	if len(restarted) == 0 {
		return nil, fmt.Errorf("no control-plane static pod manifest in %s", dir)
	}
	return restarted, nil
}

// waitRestarted waits until the mirror pod of each component on node carries stamp and is ready: the kubelet
// started the new pod, and the component answers its probes with its renewed certificates.
func waitRestarted(ctx context.Context, client kubernetes.Interface, node string, restarted []string, stamp string, log *slog.Logger) error {
	pending := slices.Clone(restarted)
	var last error
	for {
		pending = slices.DeleteFunc(pending, func(c string) bool {
			pod, err := client.CoreV1().Pods(metav1.NamespaceSystem).Get(ctx, c+"-"+node, metav1.GetOptions{})
			if err != nil {
				// The API server itself is among those restarting.
				last = err
				return false
			}
			return pod.Annotations[RenewedAnnotation] == stamp && ready(pod)
		})
		if len(pending) == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for %v to restart with the renewed certificates (last error: %v): %w", pending, last, ctx.Err())
		case <-time.After(2 * time.Second):
		}
		log.Debug("waiting for the control-plane components", "pending", pending)
	}
}

func ready(pod *corev1.Pod) bool {
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}
