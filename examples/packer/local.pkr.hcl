# A measured image built on this machine alone: no network, no cloud, no VM to provision. berth-uki joins
# systemd-stub, a kernel and an initrd whose /init is var.init into a unified kernel image and a raw UEFI
# disk that boots it; berth-manifest predicts the PCRs that boot measures and writes berth-image.json.

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
  default     = "/usr/lib/systemd/boot/efi/linuxx64.efi.stub"
}

variable "kernel" {
  type        = string
  description = "The kernel (vmlinuz) the image boots."
}

variable "init" {
  type        = string
  description = "The program the initrd runs as /init: a static binary, or a script with its interpreter in initrd_append."
}

variable "initrd_append" {
  type        = list(string)
  description = "Initrds appended after the one holding /init, such as Debian's /boot/initrd.img."
  default     = []
}

variable "cmdline" {
  type    = string
  default = "console=ttyS0 panic=-1 quiet"
}

variable "image_name" {
  type    = string
  default = "berth-local"
}

variable "output_directory" {
  type    = string
  default = "output-local"
}

variable "manifest" {
  type    = string
  default = "berth-image.json"
}

variable "kubernetes_version" {
  type    = string
  default = ""
}

source "berth-uki" "local" {
  stub    = var.stub
  kernel  = var.kernel
  cmdline = var.cmdline

  initrd_files {
    source      = var.init
    destination = "/init"
  }
  initrd_append = var.initrd_append

  output_directory = var.output_directory
  name             = "berth"
}

build {
  sources = ["source.berth-uki.local"]

  post-processor "berth-manifest" {
    image_name  = var.image_name
    output      = var.manifest
    uki         = "${var.output_directory}/berth.efi"
    artifact_id = "${var.output_directory}/berth.raw"
    components  = var.kubernetes_version == "" ? {} : { kubernetes = var.kubernetes_version }
  }
}
