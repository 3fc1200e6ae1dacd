terraform {
  # Write-only arguments need Terraform 1.11.
  required_version = ">= 1.11"

  required_providers {
    berth = {
      source = "berthlabs/berth"
    }
  }
}

# The admin kubeconfig lets berth_join_policy write into the cluster; it is provider configuration, which
# Terraform never stores in state.
variable "kubeconfig" {
  type      = string
  sensitive = true
  ephemeral = true
}

provider "berth" {
  kubeconfig = var.kubeconfig
}
