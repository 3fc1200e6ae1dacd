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

# The first control-plane node initializes the cluster: only its user-data carries the init secret's hash.
data "berth_node_config" "first_control_plane" {
  cluster_name     = "prod"
  join_ca_pin      = berth_secrets.cluster.join_ca_pin
  init_secret_hash = berth_secrets.cluster.init_secret_hash
}

# Every other node, e.g. the launch template of a worker autoscaling group.
data "berth_node_config" "workers" {
  cluster_name   = "prod"
  join_ca_pin    = berth_secrets.cluster.join_ca_pin
  join_port      = 7450
  join_endpoints = ["join.prod.example.internal:7450"]
}

output "worker_user_data" {
  value = data.berth_node_config.workers.cloud_init
}

# Google Compute Engine: the user-data of the control-plane managed instance group's instance template: the
# init secret's hash (only they may initialize), their role, and the groups whose instances their join
# services admit, each with its group's role. The template sets it as the metadata key berth-node-config.
data "berth_node_config" "gce_control_plane" {
  cluster_name     = "prod"
  join_ca_pin      = berth_secrets.cluster.join_ca_pin
  init_secret_hash = berth_secrets.cluster.init_secret_hash
  role             = "control-plane"
  instance_groups = {
    "europe-west1/prod-control-plane" = "control-plane"
    "europe-west1/prod-workers"       = "worker"
  }
}

output "gce_control_plane_metadata" {
  value = { "berth-node-config" = data.berth_node_config.gce_control_plane.json }
}

# Bare-metal workers, PXE-booted, of a cluster whose control plane runs elsewhere. They have no metadata
# service: their image sets `userDataFile: /etc/berth/user-data.json` in agent.yaml, they reach the standalone
# join service only through join_endpoints, and each gets the name of its record in the join service's
# inventory as its hostname, through its own PXE profile.
variable "rack1_machines" {
  type    = set(string)
  default = ["rack1-node01", "rack1-node02"]
}

data "berth_node_config" "rack1" {
  for_each = var.rack1_machines

  cluster_name   = "prod"
  join_ca_pin    = berth_secrets.cluster.join_ca_pin
  join_endpoints = ["join.rack1.example.internal:7450"]
  bare_metal     = true
  hostname       = each.key
}

output "rack1_user_data" {
  value = { for name, node in data.berth_node_config.rack1 : name => node.cloud_init }
}
