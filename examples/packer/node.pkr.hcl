# A node image built on this machine from Debian's archive: berth-uki turns a Debian root file system
# (scripts/guest-root.sh) into the initrd of a unified kernel image, the berth-agent provisioner installs
# the agent and its configuration into it (in a chroot, as it would over SSH on a cloud builder), and
# berth-manifest predicts the PCRs its boot measures. Booted under QEMU with OVMF and a swtpm, the agent
# attests to a join service that knows only berth-image.json: make e2e-measured-boot does exactly that.

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
  description = "systemd-stub, from Debian's systemd-boot-efi."
}

variable "kernel" {
  type        = string
  description = "The kernel (vmlinuz); root_directory must hold its modules."
}

variable "root_directory" {
  type        = string
  description = "The image's root file system, as scripts/guest-root.sh makes it."
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

variable "cmdline" {
  type    = string
  default = "console=ttyS0 panic=-1 quiet"
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
  kernel         = var.kernel
  cmdline        = var.cmdline
  root_directory = var.root_directory

  initrd_files {
    source      = "${path.root}/node/init"
    destination = "/init"
  }

  output_directory = var.output_directory
  name             = "berth"
}

build {
  sources = ["source.berth-uki.node"]

  provisioner "berth-agent" {
    agent_binary = var.agent_binary
    agent_sha256 = var.agent_sha256
    agent_config = "${path.root}/node/agent.yaml"
  }

  post-processor "berth-manifest" {
    image_name  = var.image_name
    output      = var.manifest
    uki         = "${var.output_directory}/berth.efi"
    artifact_id = "${var.output_directory}/berth.raw"
    components  = var.kubernetes_version == "" ? {} : { kubernetes = var.kubernetes_version }
  }
}
