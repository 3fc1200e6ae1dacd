terraform {
  # Write-only arguments need Terraform 1.11.
  required_version = ">= 1.11"

  required_providers {
    berth = {
      source = "berthlabs/berth"
    }
  }
}

# The root key stays out of Terraform state: make it once, keep it in your secret store, and pass it on every
# run (the cloud guides read it from AWS Secrets Manager or Google Secret Manager). Locally:
#   umask 077; head -c 32 /dev/urandom | base64 > ~/.config/berth/prod.key   # once
#   export TF_VAR_root_key="$(cat ~/.config/berth/prod.key)"                  # every run
variable "root_key" {
  type      = string
  ephemeral = true
  sensitive = true
}

resource "berth_secrets" "cluster" {
  root_key_wo = var.root_key
  # Keep it: a root key cannot be rotated, and a new version makes new CAs that a running cluster refuses.
  root_key_wo_version = 1
  ca_validity_days    = 3650
}

output "cluster_id" {
  value = berth_secrets.cluster.cluster_id
}

output "join_ca_pin" {
  value = berth_secrets.cluster.join_ca_pin
}
