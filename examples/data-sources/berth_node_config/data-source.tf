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
