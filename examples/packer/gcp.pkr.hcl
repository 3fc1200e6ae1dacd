# A Compute Engine image for Shielded VM instances with a vTPM that boots a unified kernel image (UKI) whose
# TPM measurements berth-image.json predicts, and whose root file system those measurements cover, so that a
# join policy admits exactly the nodes launched from it.
#
# The path is the AWS image's (aws.pkr.hcl): the build instance is Debian 12's own GCE image (family
# debian-12 of the project debian-cloud); the berth-agent provisioner installs the agent, its unit,
# gcp/agent.yaml, kubeadm and the kubelet; berth-node makes the instance a Kubernetes node (containerd and the
# tools kubeadm runs from Debian's archive, the kubelet's unit, kernel settings, the pause image, and an image
# generic enough for every instance: no machine-id, SSH host keys or cloud-init state); berth-uki-install then
# makes the root a verified one: it teaches the initrd to open a dm-verity root, writes the root file system
# as erofs with its hash tree onto a second disk (device name berth-image, the image), assembles a UKI on this
# machine from Debian's systemd-stub (var.stub) and the build instance's own kernel, initrd, os-release and
# command line plus the root hash, and installs it on that disk's EFI system partition as
# EFI/BOOT/BOOTX64.EFI; googlecompute stops the instance and makes the image from that disk (create_image),
# not from the boot disk the build ran on; berth-manifest predicts PCR 4, 9 and 11 (and 12, which stays zero)
# from that same file and records them with the image's self-link,
# https://www.googleapis.com/compute/v1/projects/<project>/global/images/<name> (images are global on Compute
# Engine: one entry, whatever the zone of the build).
#
# Why the image boots the UKI: a new instance starts with its own, empty UEFI variable store, so its firmware
# starts the removable-media path of the boot disk, EFI/BOOT/BOOTX64.EFI: the UKI, the only program on it.
#
# Secure boot, and which PCRs each choice fixes. Compute Engine keeps the Shielded VM settings per instance,
# not per image: enable_secure_boot, enable_vtpm and enable_integrity_monitoring below are the build instance's,
# which never boots the UKI (it is installed last and the instance is stopped to make the image), and the nodes'
# are those of their instance template (shielded_instance_config), which must match:
# - secure boot off (this image's only working choice): the firmware starts the UKI unsigned. PCR 7 records
#   SecureBoot=0 and the firmware's own variables (PK, KEK, db, dbx as Compute Engine sets them): it depends on
#   Google's firmware and key defaults, not on the image, so it is not predicted; pin it, if at all, from what
#   the first node measures (observation, not prediction). PCR 4, 9, 11 and 12 are predicted from the UKI.
# - secure boot on: the firmware starts only binaries signed by a key in the image's db. The UKI Berth builds
#   is unsigned and this template signs nothing, and packer-plugin-googlecompute v1.1.6's builder cannot set
#   an image's own db (its shielded_instance_initial_state; only its import post-processor can), so the
#   default db (Microsoft's keys) applies: a node's firmware would refuse the UKI and the node would not boot.
#   With a UKI signed by a key in db, PCR 4, 9, 11 and 12 would still be the predicted ones (an Authenticode
#   hash leaves the signature out); PCR 7 would then record SecureBoot=1, the variables and the db certificate
#   that verified the UKI, again the firmware's, pinned by observation.
# The vTPM is what the agent attests with (and what Compute Engine vouches for through the instance's Shielded
# identity); integrity monitoring needs it, and compares every boot with the first one's measurements.
#
# What the prediction covers: the UKI's Authenticode hash and that of the kernel in it (PCR 4), the embedded
# command line (with the root hash) and the initrd as the kernel measures them (PCR 9), every UKI section
# (PCR 11); through the root hash, every byte of the root file system: the initrd opens it through dm-verity,
# and a block that does not match its hash stops the node (docs/threat-model.md). What it does not cover: the
# firmware's own PCRs (0-3, 5-7), which are Google's. PCR 4 equals the prediction only when the UKI is the
# first boot application the firmware starts. The prediction and the verified root were checked against real
# boots under QEMU with OVMF and a swtpm (qemu.pkr.hcl, which runs the same provisioners, TestAccQEMUImage); no
# build or boot on Compute Engine has been run from this repository: compare the first node's PCRs
# (berth-agent doctor; docs/node-image.md) with the manifest before relying on them.
#
# Nodes are replaced by new images, not upgraded in place: the root is read-only, and what a package upgrade
# wrote would live in RAM until the next boot, unmeasured. The build masks apt's timers, which start
# unattended upgrades; keep VM Manager's OS patch jobs away from these instances for the same reason.
#
#   parts=$(scripts/boot-parts.sh)      # Debian's systemd-stub 252, cached
#   CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o /tmp/berth-agent ./nodeagent/cmd/berth-agent
#   cd examples/packer && packer init gcp.pkr.hcl
#   # kubernetes.pkrvars.hcl: kubernetes_files (kubeadm, kubelet, kubectl with their SHA-256; docs/guides/gcp.md)
#   packer build -var project_id=my-project -var "stub=$parts/linuxx64.efi.stub" -var agent_binary=/tmp/berth-agent \
#     -var-file=kubernetes.pkrvars.hcl gcp.pkr.hcl
#
# Credentials are Google's application default ones (gcloud auth application-default login, or
# GOOGLE_APPLICATION_CREDENTIALS naming a service account key).

packer {
  required_plugins {
    googlecompute = {
      version = "= 1.1.6"
      source  = "github.com/hashicorp/googlecompute"
    }
    berth = {
      version = ">= 0.1.0"
      source  = "github.com/berthlabs/berth"
    }
  }
}

variable "project_id" {
  type        = string
  description = "Project of the build instance and of the image."
}

variable "zone" {
  type        = string
  description = "Zone of the build instance. The image itself is global."
  default     = "europe-west1-b"
}

variable "machine_type" {
  type        = string
  description = "Machine type of the build instance (one that supports Shielded VM)."
  default     = "e2-standard-2"
}

variable "network" {
  type        = string
  description = "VPC network of the build instance; Packer connects to its external address over SSH."
  default     = "default"
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
  type        = string
  description = "Name of the image's entry in berth-image.json, and the prefix of the Compute Engine image's name."
  default     = "berth-node-gcp"
}

variable "image_family" {
  type        = string
  description = "Image family the image joins, so that instance templates can follow the newest."
  default     = "berth-node"
}

variable "manifest" {
  type    = string
  default = "berth-image.json"
}

variable "uki" {
  type        = string
  description = "Where berth-uki-install writes the UKI on this machine, for berth-manifest."
  default     = "output-gcp/berth.efi"
}

locals {
  # Compute Engine image names: lowercase letters, digits and '-', at most 63 characters.
  gce_image_name = "${var.image_name}-${formatdate("YYYYMMDDhhmmss", timestamp())}"
}

source "googlecompute" "node" {
  project_id   = var.project_id
  zone         = var.zone
  machine_type = var.machine_type
  network      = var.network

  source_image_family     = "debian-12"
  source_image_project_id = ["debian-cloud"]
  disk_size               = 10
  disk_type               = "pd-balanced"

  # The image: berth-uki-install writes the ESP with the UKI and the verified root onto this disk, which
  # Google's guest environment links as /dev/disk/by-id/google-berth-image, and googlecompute makes the image
  # from it. It must hold the root file system compressed with its hash tree, and 64 MiB (the qemu-builder
  # image's root, from a smaller Debian, came to 464 MiB: docs/lab.md); 10 GB is the smallest pd-balanced
  # disk, and the nodes' boot disks (examples/gcp: 20 GB) must be at least as large. The build's boot disk
  # above is only where the build ran.
  disk_attachment {
    volume_type  = "pd-balanced"
    volume_size  = 10
    device_name  = "berth-image"
    create_image = true
  }

  # Packer's own key, added to the instance's metadata for this build; project-wide keys stay out. The guest
  # agent creates the user with passwordless sudo. (Where an organization policy enforces OS Login, set
  # use_os_login = true instead.)
  ssh_username = "packer"
  # Packer's key would otherwise stay in the image's authorized_keys.
  ssh_clear_authorized_keys = true
  metadata = {
    block-project-ssh-keys = "TRUE"
  }

  # The build instance's Shielded VM settings (see above: the nodes' come from their instance template).
  enable_secure_boot          = false
  enable_vtpm                 = true
  enable_integrity_monitoring = true

  image_name        = local.gce_image_name
  image_family      = var.image_family
  image_description = "Berth node: a UKI for Shielded VM with vTPM, secure boot off; PCRs in berth-image.json as ${var.image_name}"
  # UEFI_COMPATIBLE: the image boots under UEFI, which Shielded VM needs; the others as Debian's own image has
  # them (the kernel has virtio-scsi multiqueue and gVNIC's driver).
  image_guest_os_features = ["UEFI_COMPATIBLE", "VIRTIO_SCSI_MULTIQUEUE", "GVNIC"]
  image_labels = {
    berth-image = var.image_name
  }
}

build {
  sources = ["source.googlecompute.node"]

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
    agent_config    = "${path.root}/gcp/agent.yaml"
    execute_command = "sudo -n sh '{{.Path}}'"

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
  # take their place.
  provisioner "berth-uki-install" {
    stub            = var.stub
    output          = var.uki
    execute_command = "sudo -n sh '{{.Path}}'"
    verified_root {
      device = "/dev/disk/by-id/google-berth-image"
    }
  }

  # The googlecompute artifact's id is the image's name; berth-manifest records its self-link as artifact_id.
  post-processor "berth-manifest" {
    image_name = var.image_name
    output     = var.manifest
    uki        = var.uki
    components = var.kubernetes_version == "" ? {} : { kubernetes = var.kubernetes_version }
  }
}
