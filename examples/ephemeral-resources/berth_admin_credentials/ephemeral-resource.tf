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

# berth_cluster.<name>.api_server_endpoint, or a load balancer's https:// URL.
variable "api_server_endpoint" {
  type = string
}

resource "berth_secrets" "cluster" {
  root_key_wo         = var.root_key
  root_key_wo_version = 1
}

# A new admin certificate for each plan and each apply, signed with the Kubernetes CA key that the root key
# derives; no admin credential is ever stored.
ephemeral "berth_admin_credentials" "admin" {
  root_key                  = var.root_key
  kubernetes_ca_certificate = berth_secrets.cluster.kubernetes_ca_certificate
  api_server_endpoint       = var.api_server_endpoint
  user_name                 = "terraform-ci"
  validity                  = "30m"
}

# Provider configuration takes ephemeral values and is never stored.
provider "berth" {
  alias      = "admin"
  kubeconfig = ephemeral.berth_admin_credentials.admin.kubeconfig
}

data "berth_cluster_health" "this" {
  provider            = berth.admin
  control_plane_nodes = 3
}

# The kubernetes and helm providers take host, cluster_ca_certificate, client_certificate and client_key of
# ephemeral.berth_admin_credentials.admin in their provider blocks the same way.
