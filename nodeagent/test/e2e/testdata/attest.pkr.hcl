# TestMeasuredBootJoin's image: the smallest one whose agent attests, not a Kubernetes node (that is
# examples/packer/node.pkr.hcl). berth-uki turns a Debian root file system with busybox, cryptsetup and the
# agent's other tools (scripts/guest-root.sh) into the initrd of a unified kernel image whose /init (init,
# here) runs berth-agent boot; the berth-agent provisioner installs the agent and agent.yaml into it in a
# chroot, and berth-manifest predicts the PCRs its boot measures. The test boots it under QEMU with OVMF and
# a swtpm three times in a few seconds each, which a systemd node under TCG could not.

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
  default = "berth-attest-local"
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
    source      = "${path.root}/init"
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
    agent_config = "${path.root}/agent.yaml"
  }

  post-processor "berth-manifest" {
    image_name  = var.image_name
    output      = var.manifest
    uki         = "${var.output_directory}/berth.efi"
    artifact_id = "${var.output_directory}/berth.raw"
    components  = var.kubernetes_version == "" ? {} : { kubernetes = var.kubernetes_version }
  }
}
