terraform {
  # Write-only arguments need Terraform 1.11.
  required_version = ">= 1.11"

  required_providers {
    berth = {
      source = "berthlabs/berth"
    }
  }
}

# The root key stays out of Terraform state: keep it in your secret store and pass it on every run, e.g.
# export TF_VAR_root_key="$(head -c 32 /dev/urandom | base64)" the first time, then read it back from the store.
variable "root_key" {
  type      = string
  ephemeral = true
  sensitive = true
}

resource "berth_secrets" "cluster" {
  root_key_wo = var.root_key
  # Bump to rotate the root key: the cluster gets new CAs, pins, ID and init secret.
  root_key_wo_version = 1
  ca_validity_days    = 3650
}

output "cluster_id" {
  value = berth_secrets.cluster.cluster_id
}

output "join_ca_pin" {
  value = berth_secrets.cluster.join_ca_pin
}
