# A Kubernetes node image built on this machine, with no virtual machine and no cloud: berth-uki copies a
# Debian root file system (root_directory, such as mmdebstrap makes; README.md), and the same provisioners as
# the cloud templates' work on it in a chroot: berth-agent installs the agent, its unit, agent.yaml, kubeadm
# and the kubelet; berth-node makes it a node (containerd and the tools kubeadm runs, the kubelet's unit,
# kernel settings, container images, and nothing of the build's identity). berth-uki's verified_root then
# makes the root read-only and verified: its initramfs-tools learn to open it through dm-verity, it becomes
# an erofs file system followed by its hash tree on the disk's second partition, and the UKI (the root's own
# kernel and initrd, with the root hash on its command line) goes on the first, the ESP. berth-manifest
# predicts PCR 4, 9, 11 and 12, which cover every byte of the root through the root hash.
#
# Boot output-node/berth.raw on any UEFI machine with a TPM 2.0 and a second, blank disk for the node's
# state: node/agent.yaml names it by its QEMU serial, berth-state.
#
#   parts=$(scripts/boot-parts.sh)      # Debian's systemd-stub 252, cached
#   CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o /tmp/berth-agent ./nodeagent/cmd/berth-agent
#   cd examples/packer && packer init node.pkr.hcl
#   # kubernetes.pkrvars.hcl: kubernetes_files (kubeadm, kubelet, kubectl with their SHA-256; docs/node-image.md)
#   sudo packer build -var "stub=$parts/linuxx64.efi.stub" -var root_directory=/srv/node-root \
#     -var agent_binary=/tmp/berth-agent -var-file=kubernetes.pkrvars.hcl node.pkr.hcl

packer {
  required_plugins {
    berth = {
      version = ">= 0.1.0"
      source  = "github.com/berthlabs/berth"
    }
  }
}

variable "stub" {
  type        = string
  description = "systemd-stub 252 on this machine, from Debian 12's systemd-boot-efi (scripts/boot-parts.sh)."
}

variable "root_directory" {
  type        = string
  description = "A Debian root file system with a kernel package, initramfs-tools, systemd and what berth-node needs (README.md)."
}

variable "agent_binary" {
  type        = string
  description = "A static berth-agent (CGO_ENABLED=0 go build ./nodeagent/cmd/berth-agent)."
}

variable "agent_sha256" {
  type        = string
  description = "The SHA-256 agent_binary must have; empty accepts any."
  default     = ""
}

variable "agent_config" {
  type        = string
  description = "The agent's configuration (agent.yaml); empty takes node/agent.yaml beside this template."
  default     = ""
}

variable "kubernetes_files" {
  type = list(object({
    source      = string
    destination = string
    sha256      = string
  }))
  description = "kubeadm, kubelet (destination /usr/bin/kubelet) and kubectl, each pinned by its SHA-256; berth-node refuses an image without kubeadm and the kubelet."
}

variable "image_archives" {
  type = list(object({
    source = string
    sha256 = string
  }))
  description = "Container image archives to keep in the image, each pinned by its SHA-256: the pause image at least, since a chroot has no containerd to pull with."
  default     = []
}

variable "cni_bin_dir" {
  type        = string
  description = "Where containerd finds the CNI plugins: the directory the cluster's pod network installs its plugin into."
  default     = "/opt/cni/bin"
}

variable "cmdline" {
  type        = string
  description = "The kernel command line; the verified root's items are added to it."
  default     = "console=ttyS0"
}

variable "image_name" {
  type    = string
  default = "berth-node-local"
}

variable "output_directory" {
  type    = string
  default = "output-node"
}

variable "manifest" {
  type    = string
  default = "berth-image.json"
}

variable "kubernetes_version" {
  type    = string
  default = ""
}

source "berth-uki" "node" {
  stub           = var.stub
  cmdline        = var.cmdline
  root_directory = var.root_directory
  verified_root  = true

  output_directory = var.output_directory
  name             = "berth"
}

build {
  sources = ["source.berth-uki.node"]

  provisioner "berth-agent" {
    agent_binary = var.agent_binary
    agent_sha256 = var.agent_sha256
    agent_config = var.agent_config != "" ? var.agent_config : "${path.root}/node/agent.yaml"

    dynamic "files" {
      for_each = var.kubernetes_files
      content {
        source      = files.value.source
        destination = files.value.destination
        sha256      = files.value.sha256
      }
    }
  }

  provisioner "berth-node" {
    # The chroot runs no containerd to pull with: images come as archives.
    images      = []
    cni_bin_dir = var.cni_bin_dir

    dynamic "image_archives" {
      for_each = var.image_archives
      content {
        source = image_archives.value.source
        sha256 = image_archives.value.sha256
      }
    }
  }

  post-processor "berth-manifest" {
    image_name  = var.image_name
    output      = var.manifest
    uki         = "${var.output_directory}/berth.efi"
    artifact_id = "${var.output_directory}/berth.raw"
    components  = var.kubernetes_version == "" ? {} : { kubernetes = var.kubernetes_version }
  }
}
