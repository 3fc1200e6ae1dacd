package podnetwork

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/kubernetes/fake"
)

func TestInstallFlannel(t *testing.T) {
	ctx := context.Background()
	kube := fake.NewClientset()
	s := Settings{CNIBinDir: "/usr/lib/cni", FlannelCNIPluginImage: "mirror.example/flannel-cni-plugin:v1"}
	// The second install is an init retried after its result was lost: it must overwrite, not fail.
	for range 2 {
		if err := Install(ctx, kube, Flannel, "10.244.0.0/16", s); err != nil {
			t.Fatal(err)
		}
	}
	ds, err := kube.AppsV1().DaemonSets(flannelNamespace).Get(ctx, flannelDaemonSet, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pod := ds.Spec.Template.Spec
	images := map[string]string{}
	for _, c := range append(pod.InitContainers, pod.Containers...) {
		images[c.Name] = c.Image
	}
	want := map[string]string{"install-cni-plugin": "mirror.example/flannel-cni-plugin:v1",
		"install-cni": DefaultFlannelImage, "kube-flannel": DefaultFlannelImage}
	for name, image := range want {
		if images[name] != image {
			t.Errorf("container %s runs %q, want %q", name, images[name], image)
		}
	}
	for _, v := range pod.Volumes {
		if v.Name == "cni-plugin" && v.HostPath.Path != "/usr/lib/cni" {
			t.Errorf("the CNI plugin goes to %s, want the image's /usr/lib/cni", v.HostPath.Path)
		}
	}
	selector, err := metav1.LabelSelectorAsSelector(ds.Spec.Selector)
	if err != nil || !selector.Matches(labels.Set(ds.Spec.Template.Labels)) {
		t.Errorf("the selector %v (%v) does not select the pods' labels %v", ds.Spec.Selector, err, ds.Spec.Template.Labels)
	}
	cm, err := kube.CoreV1().ConfigMaps(flannelNamespace).Get(ctx, flannelConfig, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var cni struct {
		Plugins []struct{ Type string } `json:"plugins"`
	}
	if err := json.Unmarshal([]byte(cm.Data["cni-conf.json"]), &cni); err != nil || len(cni.Plugins) != 2 || cni.Plugins[0].Type != "flannel" {
		t.Errorf("cni-conf.json = %s (%v), want flannel then portmap", cm.Data["cni-conf.json"], err)
	}
	ns, err := kube.CoreV1().Namespaces().Get(ctx, flannelNamespace, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if ns.Labels["pod-security.kubernetes.io/enforce"] != "privileged" {
		t.Errorf("namespace labels %v: flanneld's pods need the privileged pod security level", ns.Labels)
	}
	for _, get := range []func() error{
		func() error {
			_, err := kube.CoreV1().ServiceAccounts(flannelNamespace).Get(ctx, flannelName, metav1.GetOptions{})
			return err
		},
		func() error {
			_, err := kube.RbacV1().ClusterRoles().Get(ctx, flannelName, metav1.GetOptions{})
			return err
		},
		func() error {
			_, err := kube.RbacV1().ClusterRoleBindings().Get(ctx, flannelName, metav1.GetOptions{})
			return err
		},
	} {
		if err := get(); err != nil {
			t.Error(err)
		}
	}
}

func TestNetConfig(t *testing.T) {
	for _, tc := range []struct {
		subnet, want string
	}{
		{"10.244.0.0/16", `"Network":"10.244.0.0/16","EnableIPv4":true,"EnableIPv6":false`},
		{"10.244.0.0/16,fd00:10:244::/56", `"Network":"10.244.0.0/16","IPv6Network":"fd00:10:244::/56","EnableIPv4":true,"EnableIPv6":true`},
		{"fd00:10:244::/56", `"IPv6Network":"fd00:10:244::/56","EnableIPv4":false,"EnableIPv6":true`},
	} {
		nets, err := parseSubnets(tc.subnet)
		if err != nil {
			t.Fatal(err)
		}
		conf, err := netConfig(nets)
		if err != nil {
			t.Fatal(err)
		}
		var compact bytes.Buffer
		if err := json.Compact(&compact, conf); err != nil {
			t.Fatal(err)
		}
		if got := compact.String(); !strings.Contains(got, tc.want) || !strings.Contains(got, `"Backend":{"Type":"vxlan"}`) {
			t.Errorf("%s: net-conf.json = %s, want %s with the vxlan backend", tc.subnet, got, tc.want)
		}
	}
}

func TestInstallRefuses(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		plugin, subnet, want string
	}{
		{"calico", "10.244.0.0/16", `pod network "calico" is not one Berth installs (flannel, none)`},
		{Flannel, "10.244.0.0", `pod subnet "10.244.0.0"`},
		{Flannel, "10.244.0.0/16,10.245.0.0/16", "two CIDRs of one address family"},
	} {
		kube := fake.NewClientset()
		err := Install(ctx, kube, tc.plugin, tc.subnet, Settings{})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Install(%q, %q) = %v, want an error saying %q", tc.plugin, tc.subnet, err, tc.want)
		}
		if actions := kube.Actions(); len(actions) != 0 {
			t.Errorf("Install(%q, %q) refused but wrote: %v", tc.plugin, tc.subnet, actions)
		}
	}
}

func TestInstallNone(t *testing.T) {
	for _, plugin := range []string{None, ""} {
		kube := fake.NewClientset()
		if err := Install(context.Background(), kube, plugin, "10.244.0.0/16", Settings{}); err != nil {
			t.Fatal(err)
		}
		if actions := kube.Actions(); len(actions) != 0 {
			t.Errorf("pod network %q wrote %v, want nothing", plugin, actions)
		}
	}
}
