terraform {
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

# berth_secrets.<name>.kubernetes_ca_certificate and berth_cluster.<name>.api_server_endpoint.
variable "kubernetes_ca_certificate" {
  type = string
}

variable "api_server_endpoint" {
  type = string
}

ephemeral "berth_admin_credentials" "admin" {
  root_key                  = var.root_key
  kubernetes_ca_certificate = var.kubernetes_ca_certificate
  api_server_endpoint       = var.api_server_endpoint
}

# The data source reaches the cluster through its provider's kubeconfig: minted for this run as here, or
# the stored berth_cluster.<name>.kubeconfig.
provider "berth" {
  alias      = "admin"
  kubeconfig = ephemeral.berth_admin_credentials.admin.kubeconfig
}

# Waits until the API server is ready, 3 control-plane nodes and 2 workers are Ready, and so is the named
# node; after 15 minutes it fails and says which nodes are missing and why. In the configuration that makes
# the cluster, add depends_on = [berth_cluster.<name>, berth_join_policy.<name>, <the node groups>]: it then
# waits during the apply that creates them.
data "berth_cluster_health" "this" {
  provider            = berth.admin
  control_plane_nodes = 3
  worker_nodes        = 2
  node_names          = ["ip-10-0-1-20.eu-west-1.compute.internal"]
  timeout             = "15m"
}

output "ready_workers" {
  value = data.berth_cluster_health.this.ready_worker_nodes
}
