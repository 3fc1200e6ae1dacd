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

resource "berth_secrets" "cluster" {
  root_key_wo         = var.root_key
  root_key_wo_version = 1
}

# The secrets exist only while Terraform runs; a root key that did not make the certificates is refused.
ephemeral "berth_secrets" "cluster" {
  root_key                  = var.root_key
  kubernetes_ca_certificate = berth_secrets.cluster.kubernetes_ca_certificate
  join_ca_certificate       = berth_secrets.cluster.join_ca_certificate
}

# Ephemeral values can go to write-only arguments, provider configuration, other ephemeral resources and
# ephemeral locals, never to state.
locals {
  init_secret = ephemeral.berth_secrets.cluster.init_secret
}
