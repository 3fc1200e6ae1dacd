# The AWS image's path (aws.pkr.hcl) on this machine, with the real qemu builder instead of EC2: a Debian 12
# machine made by scripts/debian-vm.sh boots with its kernel and initrd handed over directly, as a cloud's
# boot loader would hand them over; berth-agent installs the agent, kubeadm and the kubelet, berth-node makes
# the machine a Kubernetes node (containerd, the kubelet's unit, kernel settings, a generic image);
# berth-uki-install makes its root a verified one: it teaches the machine's initrd to open a dm-verity root,
# writes the root file system as erofs with its hash tree onto the machine's second disk (berth.raw-1, the
# image), downloads the kernel and initrd over SSH, assembles the UKI here with the machine's own command line
# and the root hash, and installs it on the image's EFI system partition as EFI/BOOT/BOOTX64.EFI;
# berth-manifest predicts the PCRs from the same file. The image then boots the UKI under OVMF with no other
# boot option, its TPM holds the predicted PCR 4, 9, 11 and 12, and any byte of its root that differs from
# the build's stops the machine when read: TestAccQEMUImage in packer/provisioner/ukiinstall boots it with a
# swtpm on a lab's network, where it attests against those PCRs, joins the lab's cluster with kubeadm and
# runs pods (agent_config and image_archives make it the lab's).
#
# OVMF's direct kernel boot adds initrd=initrd to the command line the build machine sees; berth-uki-install
# drops it, as it drops GRUB's BOOT_IMAGE= on EC2.
#
#   vm=$(scripts/debian-vm.sh); parts=$(scripts/boot-parts.sh)     # as root
#   export PACKER_PLUGIN_PATH=$(scripts/build-packer-qemu.sh)       # plus packer-plugin-berth (make packer-plugin)
#   packer build -var "vm=$vm" -var "stub=$parts/linuxx64.efi.stub" -var "agent_binary=…" \
#     -var 'kubernetes_files=[{source="…/kubelet", destination="/usr/bin/kubelet", sha256="…"}, …]' qemu.pkr.hcl
#
# scripts/debian-vm.sh's machine carries the node's Debian packages already (the tests that build this
# template reach no archive), so berth-node installs nothing; a machine without them gets them from its
# archive over QEMU's user network.

packer {
  required_plugins {
    qemu = {
      version = "= 1.0.9"
      source  = "github.com/hashicorp/qemu"
    }
    berth = {
      version = ">= 0.1.0"
      source  = "github.com/berthlabs/berth"
    }
  }
}

variable "vm" {
  type        = string
  description = "The directory scripts/debian-vm.sh prints: disk.raw, vmlinuz, initrd.img, cmdline and key."
}

variable "stub" {
  type        = string
  description = "systemd-stub 252 on this machine, from Debian 12's systemd-boot-efi (scripts/boot-parts.sh)."
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
  description = "The agent's configuration (agent.yaml); empty bakes none."
  default     = ""
}

variable "kubernetes_files" {
  type = list(object({
    source      = string
    destination = string
    sha256      = string
  }))
  description = "kubeadm, kubelet and kubectl, each pinned by its SHA-256."
}

variable "extra_files" {
  type = list(object({
    source      = string
    destination = string
    sha256      = string
  }))
  description = "More files the berth-agent provisioner installs, each pinned by its SHA-256: udev rules, CA bundles."
  default     = []
}

variable "image_device" {
  type        = string
  description = "The second disk as the build machine names it: the image berth-uki-install writes."
  default     = "/dev/vdb"
}

variable "images" {
  type        = list(string)
  description = "Container images the machine pulls and keeps; null keeps berth-node's default (the pause image)."
  default     = null
}

variable "image_archives" {
  type = list(object({
    source = string
    sha256 = string
  }))
  description = "Container image archives to keep in the image, each pinned by its SHA-256."
  default     = []
}

variable "cni_bin_dir" {
  type        = string
  description = "Where containerd finds the CNI plugins: the directory the cluster's pod network installs its plugin into."
  default     = "/opt/cni/bin"
}

variable "output_directory" {
  type    = string
  default = "output-qemu"
}

variable "uki" {
  type    = string
  default = "output-qemu-berth.efi"
}

variable "manifest" {
  type    = string
  default = "berth-image.json"
}

variable "image_name" {
  type    = string
  default = "berth-node-qemu"
}

source "qemu" "node" {
  disk_image       = true
  iso_url          = "${var.vm}/disk.raw"
  iso_checksum     = "none"
  format           = "raw"
  skip_resize_disk = true
  # This machine has no KVM.
  accelerator       = "tcg"
  efi_boot          = true
  efi_firmware_code = "/usr/share/OVMF/OVMF_CODE_4M.fd"
  efi_firmware_vars = "/usr/share/OVMF/OVMF_VARS_4M.fd"
  headless          = true
  memory            = 1024
  disk_interface    = "virtio"
  net_device        = "virtio-net"
  qemuargs = [
    ["-kernel", "${var.vm}/vmlinuz"],
    ["-initrd", "${var.vm}/initrd.img"],
    ["-append", trimspace(file("${var.vm}/cmdline"))],
  ]

  communicator         = "ssh"
  ssh_username         = "root"
  ssh_private_key_file = "${var.vm}/key"
  ssh_timeout          = "10m"
  shutdown_command     = "systemctl poweroff"

  output_directory = var.output_directory
  vm_name          = "berth.raw"
  # The image: berth-uki-install writes the verified root and the ESP with the UKI onto this second disk,
  # berth.raw-1; the build machine's own disk, berth.raw, is only where the build ran.
  disk_additional_size = ["2048M"]
}

build {
  sources = ["source.qemu.node"]

  provisioner "berth-agent" {
    agent_binary = var.agent_binary
    agent_sha256 = var.agent_sha256
    agent_config = var.agent_config

    dynamic "files" {
      for_each = concat(var.kubernetes_files, var.extra_files)
      content {
        source      = files.value.source
        destination = files.value.destination
        sha256      = files.value.sha256
      }
    }
  }

  provisioner "berth-node" {
    images      = var.images
    cni_bin_dir = var.cni_bin_dir

    dynamic "image_archives" {
      for_each = var.image_archives
      content {
        source = image_archives.value.source
        sha256 = image_archives.value.sha256
      }
    }
  }

  # Last, so that nothing after it changes the kernel or initrd it embeds.
  provisioner "berth-uki-install" {
    stub   = var.stub
    output = var.uki
    verified_root {
      device = var.image_device
    }
  }

  post-processor "berth-manifest" {
    image_name  = var.image_name
    output      = var.manifest
    uki         = var.uki
    artifact_id = "${var.output_directory}/berth.raw-1"
  }
}
