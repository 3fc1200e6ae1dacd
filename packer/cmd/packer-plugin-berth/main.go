// Command packer-plugin-berth is Berth's Packer plugin: the builder berth-uki, which makes a measured UEFI
// disk image from local files with no network, the provisioner berth-agent, which installs the node
// agent, its unit and pinned Kubernetes components (checked by SHA-256) over any communicator, the
// provisioner berth-node, which makes the image a Kubernetes node that kubeadm join accepts (container
// runtime, kubelet unit, kernel settings, preloaded images) and refuses one that is not, the provisioner
// berth-uki-install, which makes a machine being built (an EC2 instance, say) boot a unified
// kernel image assembled from its own kernel and initrd, and the post-processor berth-manifest, which
// predicts the TPM measurements of a built image and writes berth-image.json for Terraform's
// data.berth_image. Packer starts it as a plugin; install it with make packer-plugin.
package main

import (
	"fmt"
	"os"

	"github.com/hashicorp/packer-plugin-sdk/plugin"

	"github.com/berthlabs/berth/packer/builder/uki"
	"github.com/berthlabs/berth/packer/postprocessor/manifest"
	"github.com/berthlabs/berth/packer/provisioner/agent"
	"github.com/berthlabs/berth/packer/provisioner/node"
	"github.com/berthlabs/berth/packer/provisioner/ukiinstall"
	"github.com/berthlabs/berth/packer/version"
)

func main() {
	set := plugin.NewSet()
	set.RegisterBuilder("uki", new(uki.Builder))
	set.RegisterPostProcessor("manifest", new(manifest.PostProcessor))
	set.RegisterProvisioner("agent", new(agent.Provisioner))
	set.RegisterProvisioner("node", new(node.Provisioner))
	set.RegisterProvisioner("uki-install", new(ukiinstall.Provisioner))
	set.SetVersion(version.PluginVersion)
	if err := set.Run(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
