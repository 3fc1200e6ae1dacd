# An AMI for EC2 instances with NitroTPM that boots a unified kernel image (UKI) whose TPM measurements
# berth-image.json predicts, and whose root file system those measurements cover, so that a join policy admits
# exactly the nodes launched from it.
#
# The build instance is Debian 12's own AMI. The berth-agent provisioner installs the agent, its unit,
# aws/agent.yaml, kubeadm and the kubelet; berth-node makes the instance a Kubernetes node (containerd and the
# tools kubeadm runs from Debian's archive, the kubelet's unit, kernel settings, the pause image, and an image
# generic enough for every instance: no machine-id, SSH host keys or cloud-init state); berth-uki-install then
# makes the instance's root a verified one: it teaches the initrd to open a dm-verity root, writes the root
# file system as erofs with its hash tree onto the second volume (/dev/sdf, the image), assembles a UKI here
# from Debian's systemd-stub (var.stub) and the instance's own kernel, initrd, os-release and command line plus
# the root hash, and installs it on that volume's EFI system partition as EFI/BOOT/BOOTX64.EFI; berth-manifest
# predicts PCR 4, 9 and 11 (and 12, which stays zero) from that same file and records them with the AMI id of
# each region. The build instance's own root volume is only where the build ran: it is not part of the AMI.
#
# What the prediction covers: the UKI's Authenticode hash and that of the kernel in it (PCR 4), the embedded
# command line (with the root hash) and the initrd as the kernel measures them (PCR 9), every UKI section
# (PCR 11); through the root hash, every byte of the root file system: the initrd opens it through dm-verity,
# and a block that does not match its hash stops the node (docs/threat-model.md). What it does not cover: the
# firmware's own PCRs (0-3, 5-7), which are EC2's.
#
# Why the AMI boots the UKI: amazon-ebssurrogate registers the AMI (RegisterImage) from a snapshot of the image
# volume with boot_mode "uefi", tpm_support "v2.0" and no uefi_data, so every instance starts with an empty
# UEFI variable store and its firmware starts the removable-media path of the boot disk,
# EFI/BOOT/BOOTX64.EFI: the UKI, the only program on that disk. (amazon-ebs cannot make this AMI: it uses
# CreateImage of the instance's root, and v1.8.0 has no tpm_support or boot_mode.) The prediction and the
# verified root were checked against real boots under QEMU with OVMF and a swtpm (qemu.pkr.hcl, which runs
# the same provisioners, TestAccQEMUImage); EC2's firmware is also EDK2, but no build or boot on EC2 has been
# run from this repository: compare the first node's PCRs (berth-agent doctor; docs/node-image.md) with the
# manifest before relying on it.
#
# Nodes are replaced by new images, never upgraded in place: the root is read-only, and what a package
# upgrade wrote would live in RAM until the next boot, unmeasured. The build masks apt's timers, which start
# unattended upgrades.
#
#   parts=$(scripts/boot-parts.sh)      # Debian's systemd-stub 252, cached
#   CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o /tmp/berth-agent ./nodeagent/cmd/berth-agent
#   cd examples/packer && packer init aws.pkr.hcl
#   # kubernetes.pkrvars.hcl: kubernetes_files (kubeadm, kubelet, kubectl with their SHA-256; docs/guides/aws.md)
#   packer build -var "stub=$parts/linuxx64.efi.stub" -var agent_binary=/tmp/berth-agent -var-file=kubernetes.pkrvars.hcl aws.pkr.hcl

packer {
  required_plugins {
    amazon = {
      version = "= 1.8.0"
      source  = "github.com/hashicorp/amazon"
    }
    berth = {
      version = ">= 0.1.0"
      source  = "github.com/berthlabs/berth"
    }
  }
}

variable "region" {
  type        = string
  description = "Region of the build; its entry in berth-image.json is called image_name."
  default     = "eu-central-1"
}

variable "ami_regions" {
  type        = list(string)
  description = "Further regions to copy the AMI to; their entries are called <image_name>-<region>."
  default     = []
}

variable "instance_type" {
  type        = string
  description = "Type of the build instance."
  default     = "m6i.large"
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

variable "kubernetes_files" {
  type = list(object({
    source      = string
    destination = string
    sha256      = string
  }))
  description = "kubeadm, kubelet (destination /usr/bin/kubelet) and kubectl, each pinned by its SHA-256; berth-node refuses an image without kubeadm and the kubelet."
  default     = []
}

variable "kubernetes_version" {
  type    = string
  default = ""
}

variable "image_name" {
  type    = string
  default = "berth-node-aws"
}

variable "manifest" {
  type    = string
  default = "berth-image.json"
}

variable "uki" {
  type        = string
  description = "Where berth-uki-install writes the UKI on this machine, for berth-manifest."
  default     = "output-aws/berth.efi"
}

locals {
  ami_name = "${var.image_name}-${formatdate("YYYYMMDDhhmmss", timestamp())}"
}

source "amazon-ebssurrogate" "node" {
  region        = var.region
  ami_regions   = var.ami_regions
  instance_type = var.instance_type

  source_ami_filter {
    owners      = ["136693071363"] # Debian
    most_recent = true
    filters = {
      name                = "debian-12-amd64-*"
      architecture        = "x86_64"
      root-device-type    = "ebs"
      virtualization-type = "hvm"
    }
  }
  ssh_username = "admin"
  # Packer's temporary key would otherwise stay in the AMI's authorized_keys; each instance gets its own
  # key pair's key from cloud-init at its first boot.
  ssh_clear_authorized_keys = true

  # The build instance's root (Debian's AMI, where the build runs) is left out of the AMI. The image volume,
  # sdf, gets the ESP with the UKI and the verified root (berth-uki-install's verified_root); its snapshot,
  # taken once the instance has stopped, is registered as the AMI's root device. Its size must hold the root
  # file system compressed with its hash tree, and 64 MiB: the qemu-builder image's root, from a smaller
  # Debian, came to 464 MiB (docs/lab.md); 4 GiB leaves room for Debian's cloud image and your packages.
  launch_block_device_mappings {
    device_name           = "/dev/xvda"
    volume_size           = 8
    volume_type           = "gp3"
    delete_on_termination = true
    omit_from_artifact    = true
  }
  launch_block_device_mappings {
    device_name           = "/dev/sdf"
    volume_size           = 4
    volume_type           = "gp3"
    delete_on_termination = true
  }
  ami_root_device {
    source_device_name    = "/dev/sdf"
    device_name           = "/dev/xvda"
    volume_size           = 4
    volume_type           = "gp3"
    delete_on_termination = true
  }

  ami_name                = local.ami_name
  ami_description         = "Berth node: a UKI with NitroTPM; PCRs in berth-image.json as ${var.image_name}"
  ami_architecture        = "x86_64"
  ami_virtualization_type = "hvm"
  ena_support             = true
  sriov_support           = true
  boot_mode               = "uefi"
  tpm_support             = "v2.0"
  imds_support            = "v2.0"

  # The build instance answers only IMDSv2 too.
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }

  tags = {
    Name          = local.ami_name
    "berth:image" = var.image_name
  }
}

build {
  sources = ["source.amazon-ebssurrogate.node"]

  # Nodes are replaced by new images, never upgraded in place: on a read-only root an upgrade would only
  # fill RAM with files no measurement covers. apt's timers are what start unattended-upgrades; masked, no
  # package can enable them again.
  provisioner "shell" {
    execute_command = "sudo -n sh -eu '{{.Path}}'"
    inline = [
      "systemctl mask --now apt-daily.timer apt-daily-upgrade.timer",
    ]
  }

  provisioner "berth-agent" {
    agent_binary    = var.agent_binary
    agent_sha256    = var.agent_sha256
    agent_config    = "${path.root}/aws/agent.yaml"
    execute_command = "sudo -n sh '{{.Path}}'"

    # The links agent.yaml names the state disk by, and berth-uki-install the image volume.
    files {
      source      = "${path.root}/aws/90-berth-ebs.rules"
      destination = "/etc/udev/rules.d/90-berth-ebs.rules"
      sha256      = sha256(file("${path.root}/aws/90-berth-ebs.rules"))
      mode        = "0644"
    }

    dynamic "files" {
      for_each = var.kubernetes_files
      content {
        source      = files.value.source
        destination = files.value.destination
        sha256      = files.value.sha256
      }
    }
  }

  # After berth-agent, whose kubeadm and kubelet it checks for; its apt-get runs with apt's timers masked.
  provisioner "berth-node" {
    execute_command = "sudo -n sh '{{.Path}}'"
  }

  # Last, so that nothing after it changes the kernel, initrd or root it seals. The command line is the build
  # instance's own without GRUB's BOOT_IMAGE= and its root=, which name the build's root: the verified root's
  # take their place. /dev/disk/by-ebs-name/sdf is the link 90-berth-ebs.rules (installed above) makes for
  # the image volume; berth-uki-install has udev apply the new rule to the disks already attached.
  provisioner "berth-uki-install" {
    stub            = var.stub
    output          = var.uki
    execute_command = "sudo -n sh '{{.Path}}'"
    verified_root {
      device = "/dev/disk/by-ebs-name/sdf"
    }
  }

  post-processor "berth-manifest" {
    image_name = var.image_name
    output     = var.manifest
    uki        = var.uki
    region     = var.region
    components = var.kubernetes_version == "" ? {} : { kubernetes = var.kubernetes_version }
  }
}
