package podnetwork

import (
	"context"
	"encoding/json"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// Names of Flannel's objects, as upstream's manifest names them, so that upstream's upgrade notes apply.
const (
	flannelNamespace = "kube-flannel"
	flannelName      = "flannel"
	flannelConfig    = "kube-flannel-cfg"
	flannelDaemonSet = "kube-flannel-ds"
	// VXLANPort is where Flannel's VXLAN backend sends pods' packets between nodes (the Linux kernel's
	// port for VXLAN, not IANA's 4789): the one port a platform's firewall must open for it.
	VXLANPort = 8472
)

// cniConfig is the node's CNI configuration Flannel's init container installs: Flannel's plugin hands the
// node's share of the pod subnet to the bridge plugin; portmap serves hostPort.
const cniConfig = `{
  "name": "cbr0",
  "cniVersion": "0.3.1",
  "plugins": [
    {"type": "flannel", "delegate": {"hairpinMode": true, "isDefaultGateway": true}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
`

// netConfig is flanneld's net-conf.json for the cluster's pod ranges.
func netConfig(nets subnets) ([]byte, error) {
	type backend struct {
		Type string `json:"Type"`
	}
	conf := struct {
		Network        string  `json:"Network,omitempty"`
		IPv6Network    string  `json:"IPv6Network,omitempty"`
		EnableIPv4     bool    `json:"EnableIPv4"`
		EnableIPv6     bool    `json:"EnableIPv6"`
		EnableNFTables bool    `json:"EnableNFTables"`
		Backend        backend `json:"Backend"`
	}{EnableIPv4: nets.v4.IsValid(), EnableIPv6: nets.v6.IsValid(), Backend: backend{Type: "vxlan"}}
	if nets.v4.IsValid() {
		conf.Network = nets.v4.String()
	}
	if nets.v6.IsValid() {
		conf.IPv6Network = nets.v6.String()
	}
	return json.MarshalIndent(conf, "", "  ")
}

func installFlannel(ctx context.Context, kube kubernetes.Interface, nets subnets, s Settings) error {
	netConf, err := netConfig(nets)
	if err != nil {
		return err
	}
	labels := map[string]string{"k8s-app": flannelName}
	meta := func(name, namespace string) metav1.ObjectMeta {
		return metav1.ObjectMeta{Name: name, Namespace: namespace, Labels: labels}
	}
	ns := &corev1.Namespace{ObjectMeta: meta(flannelNamespace, "")}
	// flanneld changes the node's links, routes and packet filter: the namespace must admit that.
	ns.Labels = map[string]string{"k8s-app": flannelName, "pod-security.kubernetes.io/enforce": "privileged"}
	if err := put(ctx, kube.CoreV1().Namespaces(), ns, "namespace "+flannelNamespace); err != nil {
		return err
	}
	sa := &corev1.ServiceAccount{ObjectMeta: meta(flannelName, flannelNamespace)}
	if err := put(ctx, kube.CoreV1().ServiceAccounts(flannelNamespace), sa, "service account "+flannelName); err != nil {
		return err
	}
	// With --kube-subnet-mgr flanneld reads each node's podCIDR and writes its own VTEP into its node's
	// annotations; nothing more.
	role := &rbacv1.ClusterRole{ObjectMeta: meta(flannelName, ""), Rules: []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get"}},
		{APIGroups: []string{""}, Resources: []string{"nodes"}, Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{""}, Resources: []string{"nodes/status"}, Verbs: []string{"patch"}},
	}}
	if err := put(ctx, kube.RbacV1().ClusterRoles(), role, "cluster role "+flannelName); err != nil {
		return err
	}
	binding := &rbacv1.ClusterRoleBinding{ObjectMeta: meta(flannelName, ""),
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: flannelName},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: flannelName, Namespace: flannelNamespace}},
	}
	if err := put(ctx, kube.RbacV1().ClusterRoleBindings(), binding, "cluster role binding "+flannelName); err != nil {
		return err
	}
	cm := &corev1.ConfigMap{ObjectMeta: meta(flannelConfig, flannelNamespace),
		Data: map[string]string{"cni-conf.json": cniConfig, "net-conf.json": string(netConf) + "\n"}}
	if err := put(ctx, kube.CoreV1().ConfigMaps(flannelNamespace), cm, "config map "+flannelConfig); err != nil {
		return err
	}
	return put(ctx, kube.AppsV1().DaemonSets(flannelNamespace), flannelDaemonSetOf(s), "daemon set "+flannelDaemonSet)
}

// flannelDaemonSetOf runs flanneld on every node, control-plane nodes included: its init containers put
// Flannel's CNI plugin and the CNI configuration on the node first.
func flannelDaemonSetOf(s Settings) *appsv1.DaemonSet {
	podLabels := map[string]string{"app": flannelName, "tier": "node"}
	hostPath := func(name, path string, t corev1.HostPathType) corev1.Volume {
		return corev1.Volume{Name: name, VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: path, Type: &t}}}
	}
	mount := func(name, path string) corev1.VolumeMount { return corev1.VolumeMount{Name: name, MountPath: path} }
	fromField := func(name, path string) corev1.EnvVar {
		return corev1.EnvVar{Name: name, ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: path}}}
	}
	notPrivileged := false
	return &appsv1.DaemonSet{
		ObjectMeta: metav1.ObjectMeta{Name: flannelDaemonSet, Namespace: flannelNamespace,
			Labels: map[string]string{"k8s-app": flannelName, "app": flannelName, "tier": "node"}},
		Spec: appsv1.DaemonSetSpec{
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": flannelName}},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: podLabels},
				Spec: corev1.PodSpec{
					NodeSelector:       map[string]string{corev1.LabelOSStable: "linux"},
					HostNetwork:        true,
					PriorityClassName:  "system-node-critical",
					ServiceAccountName: flannelName,
					// Every node needs the network, tainted or not: it is what makes a node Ready.
					Tolerations: []corev1.Toleration{{Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule}},
					InitContainers: []corev1.Container{
						{Name: "install-cni-plugin", Image: s.FlannelCNIPluginImage, Command: []string{"cp"},
							Args:         []string{"-f", "/flannel", "/opt/cni/bin/flannel"},
							VolumeMounts: []corev1.VolumeMount{mount("cni-plugin", "/opt/cni/bin")}},
						{Name: "install-cni", Image: s.FlannelImage, Command: []string{"cp"},
							Args:         []string{"-f", "/etc/kube-flannel/cni-conf.json", "/etc/cni/net.d/10-flannel.conflist"},
							VolumeMounts: []corev1.VolumeMount{mount("cni", "/etc/cni/net.d"), mount("flannel-cfg", "/etc/kube-flannel/")}},
					},
					Containers: []corev1.Container{{
						Name: "kube-flannel", Image: s.FlannelImage,
						Command: []string{"/opt/bin/flanneld"}, Args: []string{"--ip-masq", "--kube-subnet-mgr"},
						Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{
							corev1.ResourceCPU: resource.MustParse("100m"), corev1.ResourceMemory: resource.MustParse("50Mi")}},
						SecurityContext: &corev1.SecurityContext{Privileged: &notPrivileged,
							Capabilities: &corev1.Capabilities{Add: []corev1.Capability{"NET_ADMIN", "NET_RAW"}}},
						// flanneld finds its node through its pod.
						Env: []corev1.EnvVar{fromField("POD_NAME", "metadata.name"), fromField("POD_NAMESPACE", "metadata.namespace")},
						VolumeMounts: []corev1.VolumeMount{mount("run", "/run/flannel"), mount("flannel-cfg", "/etc/kube-flannel/"),
							mount("xtables-lock", "/run/xtables.lock")},
					}},
					Volumes: []corev1.Volume{
						hostPath("run", "/run/flannel", corev1.HostPathUnset),
						hostPath("cni-plugin", s.CNIBinDir, corev1.HostPathUnset),
						hostPath("cni", "/etc/cni/net.d", corev1.HostPathUnset),
						{Name: "flannel-cfg", VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{
							LocalObjectReference: corev1.LocalObjectReference{Name: flannelConfig}}}},
						// iptables takes this lock; kube-proxy shares it.
						hostPath("xtables-lock", "/run/xtables.lock", corev1.HostPathFileOrCreate),
					},
				},
			},
		},
	}
}
