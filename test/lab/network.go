package lab

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"
)

// probePort is where the probe's pods serve, and their Service listens.
const probePort = 8080

// WaitAddons waits until kube-proxy and Flannel run on every node and CoreDNS answers: what a Service
// reached by its name needs.
func (l *Lab) WaitAddons(ctx context.Context) error {
	for _, w := range []struct{ namespace, workload string }{
		{"kube-system", "daemonset/kube-proxy"}, {"kube-flannel", "daemonset/kube-flannel-ds"}, {"kube-system", "deployment/coredns"},
	} {
		if _, err := l.Kubectl(ctx, "-n", w.namespace, "rollout", "status", w.workload, "--timeout=3m"); err != nil {
			pods, _ := l.Kubectl(ctx, "-n", w.namespace, "get", "pods", "-o", "wide")
			return fmt.Errorf("%s: %w\n%s", w.workload, err, pods)
		}
	}
	l.progress("kube-proxy, Flannel and CoreDNS running")
	return nil
}

// ServeProbe runs the Deployment name of the probe image, one replica on each of the nodes named (control-plane
// nodes too), behind a ClusterIP Service of the same name, and waits until every replica is ready: its kubelet
// reached it over its node's pod bridge.
func (l *Lab) ServeProbe(ctx context.Context, name string, nodes []string) error {
	manifest := fmt.Sprintf(`apiVersion: apps/v1
kind: Deployment
metadata: {name: %[1]s, namespace: default}
spec:
  replicas: %[2]d
  selector: {matchLabels: {app: %[1]s}}
  template:
    metadata: {labels: {app: %[1]s}}
    spec:
      affinity:
        nodeAffinity:
          requiredDuringSchedulingIgnoredDuringExecution:
            nodeSelectorTerms:
            - matchExpressions: [{key: kubernetes.io/hostname, operator: In, values: [%[3]s]}]
        podAntiAffinity:
          requiredDuringSchedulingIgnoredDuringExecution:
          - {topologyKey: kubernetes.io/hostname, labelSelector: {matchLabels: {app: %[1]s}}}
      tolerations:
      - {key: node-role.kubernetes.io/control-plane, operator: Exists, effect: NoSchedule}
      containers:
      - name: probe
        image: %[4]s
        imagePullPolicy: Never
        args: [serve, ":%[5]d"]
        ports: [{containerPort: %[5]d}]
        readinessProbe:
          httpGet: {path: /, port: %[5]d}
          periodSeconds: 2
---
apiVersion: v1
kind: Service
metadata: {name: %[1]s, namespace: default}
spec:
  selector: {app: %[1]s}
  ports: [{port: %[5]d, targetPort: %[5]d}]
`, name, len(nodes), strings.Join(nodes, ", "), ProbeImage, probePort)
	if _, err := l.kubectlStdin(ctx, manifest, "apply", "-f", "-"); err != nil {
		return err
	}
	if _, err := l.Kubectl(ctx, "rollout", "status", "deployment/"+name, "--timeout=2m"); err != nil {
		pods, _ := l.Kubectl(ctx, "describe", "pods", "-l", "app="+name)
		return fmt.Errorf("deployment %s: %w\n%s", name, err, pods)
	}
	l.progress("deployment %s: a replica on each of %s, behind Service %s", name, strings.Join(nodes, ", "), name)
	return nil
}

// ProbeReplicas are the pods of the probe's Deployment name, and the nodes they run on.
func (l *Lab) ProbeReplicas(ctx context.Context, name string) (map[string]string, error) {
	out, err := l.Kubectl(ctx, "get", "pods", "-l", "app="+name, "-o", `jsonpath={range .items[*]}{.metadata.name} {.spec.nodeName}{"\n"}{end}`)
	if err != nil {
		return nil, err
	}
	replicas := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		if f := strings.Fields(line); len(f) == 2 {
			replicas[f[0]] = f[1]
		}
	}
	return replicas, nil
}

// FetchProbe runs the pod podName on node that asks the Service service by its name until replicas
// different pods have answered, and returns those pods. The pod stays for inspection if it fails,
// and is deleted if it succeeds.
func (l *Lab) FetchProbe(ctx context.Context, podName, service string, node *Node, replicas int) ([]string, error) {
	url := fmt.Sprintf("http://%s:%d/", service, probePort)
	manifest := fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata: {name: %s, namespace: default}
spec:
  nodeName: %s
  restartPolicy: Never
  tolerations: [{operator: Exists}]
  containers:
  - name: fetch
    image: %s
    imagePullPolicy: Never
    args: [fetch, %q, "%d", 90s]
`, podName, node.Name, ProbeImage, url, replicas)
	if _, err := l.kubectlStdin(ctx, manifest, "apply", "-f", "-"); err != nil {
		return nil, err
	}
	start := time.Now()
	phase := ""
	for deadline := time.Now().Add(2 * time.Minute); phase != "Succeeded"; time.Sleep(time.Second) {
		out, err := l.Kubectl(ctx, "get", "pod", podName, "-o", "jsonpath={.status.phase}")
		phase = strings.TrimSpace(out)
		if phase == "Failed" || time.Now().After(deadline) {
			logs, _ := l.Kubectl(ctx, "logs", podName)
			desc, _ := l.Kubectl(ctx, "describe", "pod", podName)
			return nil, l.nodeFailure(node, "reaching Service "+service, fmt.Errorf("pod %s: phase %q (%v)\n%s\n%s", podName, phase, err, logs, desc))
		}
	}
	logs, err := l.Kubectl(ctx, "logs", podName)
	if err != nil {
		return nil, err
	}
	var answered []string
	for _, line := range strings.Split(logs, "\n") {
		if pod, ok := strings.CutPrefix(line, "answered by "); ok {
			answered = append(answered, pod)
		}
	}
	slices.Sort(answered)
	l.progress("%s: Service %s reached by name, answered by %s in %.1fs", node.Name, service, strings.Join(answered, ", "), time.Since(start).Seconds())
	if _, err := l.Kubectl(ctx, "delete", "pod", podName, "--wait=false"); err != nil {
		return nil, err
	}
	return answered, nil
}
