terraform {
  # Write-only arguments need Terraform 1.11.
  required_version = ">= 1.11"

  required_providers {
    berth = {
      source = "berthlabs/berth"
    }
  }
}

variable "root_key" {
  type      = string
  ephemeral = true
  sensitive = true
}

variable "first_control_plane_address" {
  type = string
}

# PEM certificates of the CAs that sign your TPMs' endorsement keys (the TPM vendor's, or your cloud's vTPM CA).
variable "tpm_ek_ca_certificates" {
  type = string
}

resource "berth_secrets" "cluster" {
  root_key_wo         = var.root_key
  root_key_wo_version = 1
}

ephemeral "berth_secrets" "cluster" {
  root_key                  = var.root_key
  kubernetes_ca_certificate = berth_secrets.cluster.kubernetes_ca_certificate
  join_ca_certificate       = berth_secrets.cluster.join_ca_certificate
}

data "berth_image" "current" {
  path = "${path.module}/berth-image.json"
  name = "berth-2026-11-22"
}

# The first control-plane node runs from data.berth_image.current and got user-data with init_secret_hash.
# Its TPM must quote exactly these PCRs before it is sent any secret.
resource "berth_cluster" "this" {
  endpoint           = "${var.first_control_plane_address}:7451"
  cluster_name       = "prod"
  kubernetes_version = "v1.36.3"
  pcrs               = data.berth_image.current.pcrs
  ek_ca_certificates = var.tpm_ek_ca_certificates

  kubernetes_ca_certificate = berth_secrets.cluster.kubernetes_ca_certificate
  join_ca_certificate       = berth_secrets.cluster.join_ca_certificate
  init_secret_wo            = ephemeral.berth_secrets.cluster.init_secret
  master_secret_wo          = ephemeral.berth_secrets.cluster.master_secret
  salt_wo                   = ephemeral.berth_secrets.cluster.salt
  kubernetes_ca_key_wo      = ephemeral.berth_secrets.cluster.kubernetes_ca_key
  join_ca_key_wo            = ephemeral.berth_secrets.cluster.join_ca_key
}

# A second provider configuration writes into the new cluster.
provider "berth" {
  alias      = "cluster"
  kubeconfig = berth_cluster.this.kubeconfig
}

resource "berth_join_policy" "this" {
  provider = berth.cluster
  # Written only into this cluster; a new cluster gets it written again.
  cluster_id = berth_cluster.this.cluster_id
  images = [{
    name  = data.berth_image.current.name
    roles = ["control-plane", "worker"]
    pcrs  = data.berth_image.current.pcrs
    # The join services hold nodes of this image to the version skew policy.
    kubernetes_version = data.berth_image.current.components["kubernetes"]
  }]
}

output "cluster_id" {
  value = berth_cluster.this.cluster_id
}

output "kubeconfig" {
  value     = berth_cluster.this.kubeconfig
  sensitive = true
}
