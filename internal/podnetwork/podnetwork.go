// Package podnetwork is the pod network a Berth cluster's first control-plane node installs once kubeadm
// init is done, as kubeadm itself installs kube-proxy and CoreDNS. kubeadm installs no CNI plugin, and until
// one runs no node is Ready; a cluster that gets its network from the node it was made on works on every
// platform the moment it exists, without a second tool that needs the admin credentials.
//
// The Terraform provider takes the plugin names from here (berth_cluster's pod_network); the agent installs.
package podnetwork

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// The pod networks a cluster can get.
const (
	// Flannel with its VXLAN backend: pods' packets travel between nodes inside UDP on port 8472, so it
	// needs nothing from the network below but that port, on every platform.
	Flannel = "flannel"
	// None installs nothing: the operator brings a plugin.
	None = "none"
)

// Plugins are the pod networks a cluster can get, the default first.
var Plugins = []string{Flannel, None}

// The images and the CNI directory a node uses unless its image names its own: upstream's, of the Flannel
// release whose manifest (Documentation/kube-flannel.yml of flannel v0.27.4) the objects follow.
const (
	DefaultFlannelImage          = "ghcr.io/flannel-io/flannel:v0.27.4"
	DefaultFlannelCNIPluginImage = "ghcr.io/flannel-io/flannel-cni-plugin:v1.8.0-flannel1"
	DefaultCNIBinDir             = "/opt/cni/bin"
)

// Settings are a machine image's side of the pod network: where its container runtime looks for CNI
// plugins, and which images run the network (an image that preloads or mirrors them names its own).
type Settings struct {
	CNIBinDir             string `json:"cniBinDir,omitempty"`
	FlannelImage          string `json:"flannelImage,omitempty"`
	FlannelCNIPluginImage string `json:"flannelCNIPluginImage,omitempty"`
}

func (s Settings) withDefaults() Settings {
	if s.CNIBinDir == "" {
		s.CNIBinDir = DefaultCNIBinDir
	}
	if s.FlannelImage == "" {
		s.FlannelImage = DefaultFlannelImage
	}
	if s.FlannelCNIPluginImage == "" {
		s.FlannelCNIPluginImage = DefaultFlannelCNIPluginImage
	}
	return s
}

// Check refuses a plugin this package does not install. The empty name is None: what an init request of a
// provider from before pod networks means.
func Check(plugin string) error {
	if plugin == "" || slices.Contains(Plugins, plugin) {
		return nil
	}
	return fmt.Errorf("pod network %q is not one Berth installs (%s)", plugin, strings.Join(Plugins, ", "))
}

// Install installs plugin for a cluster whose pods take their addresses from podSubnet (kubeadm's
// networking.podSubnet: one CIDR, or an IPv4 and an IPv6 CIDR, comma-separated). Objects that exist are
// overwritten, so a retried install ends the same.
func Install(ctx context.Context, kube kubernetes.Interface, plugin, podSubnet string, s Settings) error {
	if err := Check(plugin); err != nil {
		return err
	}
	if plugin == "" || plugin == None {
		return nil
	}
	nets, err := parseSubnets(podSubnet)
	if err != nil {
		return fmt.Errorf("pod network %s: %w", plugin, err)
	}
	if err := installFlannel(ctx, kube, nets, s.withDefaults()); err != nil {
		return fmt.Errorf("installing pod network %s: %w", plugin, err)
	}
	return nil
}

// subnets are a cluster's pod ranges by family; either may be invalid (single-stack).
type subnets struct {
	v4, v6 netip.Prefix
}

func parseSubnets(s string) (subnets, error) {
	var nets subnets
	for part := range strings.SplitSeq(s, ",") {
		p, err := netip.ParsePrefix(strings.TrimSpace(part))
		if err != nil {
			return subnets{}, fmt.Errorf("pod subnet %q: %w", s, err)
		}
		family := &nets.v4
		if p.Addr().Is6() {
			family = &nets.v6
		}
		if family.IsValid() {
			return subnets{}, fmt.Errorf("pod subnet %q has two CIDRs of one address family", s)
		}
		*family = p.Masked()
	}
	return nets, nil
}

// writer is what a typed client of one kind offers to create and replace its objects.
type writer[T any] interface {
	Create(ctx context.Context, obj T, opts metav1.CreateOptions) (T, error)
	Update(ctx context.Context, obj T, opts metav1.UpdateOptions) (T, error)
}

// fieldManager names Berth as the writer of the objects, in their managed fields.
const fieldManager = "berth"

// put creates obj, or replaces the object of its name.
func put[T any](ctx context.Context, w writer[T], obj T, what string) error {
	_, err := w.Create(ctx, obj, metav1.CreateOptions{FieldManager: fieldManager})
	if apierrors.IsAlreadyExists(err) {
		_, err = w.Update(ctx, obj, metav1.UpdateOptions{FieldManager: fieldManager})
	}
	if err != nil {
		return fmt.Errorf("writing %s: %w", what, err)
	}
	return nil
}
