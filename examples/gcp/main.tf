# A Berth cluster on Google Compute Engine: a control-plane managed instance group and a worker managed
# instance group of one image, booted by its UKI on Shielded VMs whose vTPM measures it. Nodes join by
# themselves: the join service, on the control-plane nodes, finds each connecting instance through the Compute
# API, gives it the role of the managed instance group that created it, and trusts its vTPM only when Google's
# EK certificate and the Compute API both say it is that instance's. docs/guides/gcp.md walks through it, from
# `packer build` to a scaled group.
#
# Terraform must reach the first control-plane node's internal address on port 7451 (run it from a network
# routed into this VPC: Cloud VPN, Interconnect, a peered network): that is where berth_cluster attests the
# node and sends it the cluster's secrets. The Berth provider needs no Google credentials for that: Google's EK
# certificate names the instance. Only the google provider does, to build what follows.
#
# Written for hashicorp/google 7.11 or a later 7.x (root_key.tf says why). Only `terraform fmt` and
# provider/cloudexamples_test.go have checked this configuration: the machine it was written on reaches no
# Terraform registry, so it was never validated against the provider's schema nor applied.

terraform {
  required_version = ">= 1.11"
  required_providers {
    google = {
      source  = "hashicorp/google"
      version = "~> 7.11"
    }
    random = {
      source  = "hashicorp/random"
      version = "~> 3.9"
    }
    berth = {
      source = "berthlabs/berth"
    }
  }
}

provider "google" {
  project = var.project
  region  = var.region
}

variable "project" {
  description = "The project of the cluster's instances, network and service accounts."
  type        = string
}

variable "region" {
  description = "The region of the managed instance groups, the subnetwork and the internal load balancer."
  type        = string
  default     = "europe-west1"
}

variable "zones" {
  description = "Zones of var.region the managed instance groups spread over."
  type        = list(string)
  default     = ["europe-west1-b", "europe-west1-c", "europe-west1-d"]

  validation {
    condition     = length(var.zones) > 0 && alltrue([for zone in var.zones : startswith(zone, "${var.region}-")])
    error_message = "Every zone must be a zone of var.region."
  }
}

variable "subnet_cidr" {
  description = "The nodes' subnetwork; the internal load balancer takes one address of it. With shared_vpc, the shared subnetwork's range."
  type        = string
  default     = "10.20.0.0/20"
}

variable "shared_vpc" {
  description = "A Shared VPC subnetwork for the nodes instead of a network of their own: the host project's id and the names of its network and of the subnetwork in var.region shared with this project. The firewall rules are then made in the host project, and the node image's agent.yaml names the network (gcp.network; see \"Shared VPC\" in docs/guides/gcp.md)."
  type        = object({ host_project = string, network = string, subnetwork = string })
  default     = null
}

variable "operator_cidrs" {
  description = "Where Terraform and kubectl run from, as the VPC sees them: they reach the init port (7451) and the API server (6443)."
  type        = list(string)
}

variable "manifest" {
  description = "berth-image.json, written by `packer build examples/packer/gcp.pkr.hcl`."
  type        = string
  default     = "berth-image.json"
}

variable "image" {
  description = "The image in the manifest to run; its artifact_id is the Compute Engine image's self-link."
  type        = string
  default     = "berth-node-gcp"
}

variable "machine_types" {
  description = "Machine types of the two roles: any series with Shielded VM support and persistent disks (e2, n2, n2d, t2d)."
  type        = object({ control_plane = string, worker = string })
  default     = { control_plane = "e2-standard-4", worker = "e2-standard-2" }
}

variable "workers" {
  description = "Target size of the worker group."
  type        = number
  default     = 2
}

locals {
  cluster_name = "prod"
  # The groups' names are fixed here, before the groups exist, so that the control-plane nodes' metadata can
  # name them: the group depends on its instance template, the template on that metadata, and a name read back
  # from the group would close the cycle. The keys are "<region>/<name>", as regional groups are named.
  control_plane_group     = "${local.cluster_name}-control-plane"
  worker_group            = "${local.cluster_name}-workers"
  control_plane_group_key = "${var.region}/${local.control_plane_group}"
  worker_group_key        = "${var.region}/${local.worker_group}"
  # One control-plane node; see "One control-plane node" in docs/guides/gcp.md.
  control_plane_size = 1
  # The nodes' network: this project's own (network.tf), or a Shared VPC host project's.
  network_project = var.shared_vpc == null ? var.project : var.shared_vpc.host_project
  network         = var.shared_vpc == null ? google_compute_network.cluster[0].id : "projects/${var.shared_vpc.host_project}/global/networks/${var.shared_vpc.network}"
  subnetwork      = var.shared_vpc == null ? google_compute_subnetwork.nodes[0].id : "projects/${var.shared_vpc.host_project}/regions/${var.region}/subnetworks/${var.shared_vpc.subnetwork}"
  # Compute Engine images are global: the manifest has one entry for the image, whatever the build's zone.
  image = one([for image in data.berth_image.node.images : image.artifact_id if image.name == var.image])
}

data "berth_image" "node" {
  path = var.manifest
  name = var.image
}

# The root key comes from Secret Manager (root_key.tf). Never change root_key_wo_version on a running cluster:
# a new value replaces berth_secrets, so new CA certificates, which the running cluster refuses.
resource "berth_secrets" "cluster" {
  root_key_wo         = local.root_key
  root_key_wo_version = 1
}

ephemeral "berth_secrets" "cluster" {
  root_key                  = local.root_key
  kubernetes_ca_certificate = berth_secrets.cluster.kubernetes_ca_certificate
  join_ca_certificate       = berth_secrets.cluster.join_ca_certificate
}

# An internal passthrough Network Load Balancer in front of the control-plane nodes: the join service (7450)
# and the API server (6443) on one address. A passthrough balancer delivers the clients' own packets, source
# address included, and the join service finds a node's instance by that address; a proxy load balancer
# (internal Application or proxy Network Load Balancer) would show it the proxy's address instead, and every
# node would be refused. The address is reserved first so that the nodes' metadata can name it: the forwarding
# rule depends on the group through the backend service, and the group on that metadata.
resource "google_compute_address" "control_plane" {
  name         = "${local.cluster_name}-control-plane"
  region       = var.region
  subnetwork   = local.subnetwork
  address_type = "INTERNAL"
}

# One health check for both ports: the API server and the join service start together on a control-plane node
# once it is a member. A TCP check needs nothing of the API server's authentication.
resource "google_compute_health_check" "control_plane" {
  name                = "${local.cluster_name}-control-plane"
  check_interval_sec  = 5
  timeout_sec         = 5
  healthy_threshold   = 2
  unhealthy_threshold = 3

  tcp_health_check {
    port = 6443
  }
}

resource "google_compute_region_backend_service" "control_plane" {
  name                  = "${local.cluster_name}-control-plane"
  region                = var.region
  protocol              = "TCP"
  load_balancing_scheme = "INTERNAL"
  health_checks         = [google_compute_health_check.control_plane.id]

  backend {
    group          = google_compute_region_instance_group_manager.control_plane.instance_group
    balancing_mode = "CONNECTION"
  }
}

resource "google_compute_forwarding_rule" "control_plane" {
  name                  = "${local.cluster_name}-control-plane"
  region                = var.region
  load_balancing_scheme = "INTERNAL"
  backend_service       = google_compute_region_backend_service.control_plane.id
  ip_address            = google_compute_address.control_plane.address
  ip_protocol           = "TCP"
  ports                 = ["6443", "7450"]
  network               = local.network
  subnetwork            = local.subnetwork
}

# The control-plane nodes' metadata: the init secret's hash (only they may initialize), their role, and the
# groups whose instances their join services admit, each with its role.
data "berth_node_config" "control_plane" {
  cluster_name     = local.cluster_name
  join_ca_pin      = berth_secrets.cluster.join_ca_pin
  init_secret_hash = berth_secrets.cluster.init_secret_hash
  join_endpoints   = ["${google_compute_address.control_plane.address}:7450"]
  role             = "control-plane"
  instance_groups = {
    (local.control_plane_group_key) = "control-plane"
    (local.worker_group_key)        = "worker"
  }
}

data "berth_node_config" "worker" {
  cluster_name   = local.cluster_name
  join_ca_pin    = berth_secrets.cluster.join_ca_pin
  join_endpoints = ["${google_compute_address.control_plane.address}:7450"]
  role           = "worker"
}

resource "google_compute_instance_template" "node" {
  for_each = {
    control-plane = { node_config = data.berth_node_config.control_plane.json, service_account = google_service_account.control_plane.email, machine_type = var.machine_types.control_plane }
    worker        = { node_config = data.berth_node_config.worker.json, service_account = google_service_account.worker.email, machine_type = var.machine_types.worker }
  }

  name_prefix  = "${local.cluster_name}-${each.key}-"
  machine_type = each.value.machine_type
  # For people and billing: the join service never reads labels (compute.instances.setLabels changes them).
  labels = { berth-cluster = local.cluster_name, berth-role = each.key }

  # The image's UKI is unsigned, so secure boot stays off: the firmware would refuse it (gcp.pkr.hcl says why,
  # and which PCRs each choice fixes). The vTPM is what the agent attests with; integrity monitoring compares
  # every boot with the first one's measurements, Google's own report beside the join policy's check.
  shielded_instance_config {
    enable_secure_boot          = false
    enable_vtpm                 = true
    enable_integrity_monitoring = true
  }

  disk {
    boot         = true
    source_image = local.image
    disk_type    = "pd-balanced"
    disk_size_gb = 20
    auto_delete  = true
  }

  # The encrypted state disk the agent keys with its LUKS2 volume: Google's guest environment names it
  # /dev/disk/by-id/google-berth-state, the stateDisk of examples/packer/gcp/agent.yaml. (Machine series that
  # take only Hyperdisk, such as c3 or n4, need disk_type "hyperdisk-balanced" here and above.)
  disk {
    boot         = false
    device_name  = "berth-state"
    disk_type    = "pd-balanced"
    disk_size_gb = 20
    auto_delete  = true
  }

  # No access_config: no external address. The nodes reach Google's APIs through Private Google Access and
  # everything else through Cloud NAT (network.tf).
  network_interface {
    subnetwork = local.subnetwork
  }

  # The GCP cloud controller manager opens the firewall for a LoadBalancer Service's health checks and
  # traffic to the instances of this tag (its cloud config's node-tags, docs/guides/gcp.md).
  tags = ["${local.cluster_name}-node"]

  metadata = {
    berth-node-config = each.value.node_config
    # The project's SSH keys give no way onto a node; no firewall rule opens port 22 either.
    block-project-ssh-keys = "TRUE"
  }

  # IAM decides what the token may do (iam.tf); the scope does not narrow it further.
  service_account {
    email  = each.value.service_account
    scopes = ["cloud-platform"]
  }

  lifecycle {
    create_before_destroy = true
  }
}

resource "google_compute_region_instance_group_manager" "control_plane" {
  name                      = local.control_plane_group
  region                    = var.region
  base_instance_name        = "${local.cluster_name}-cp"
  distribution_policy_zones = var.zones
  target_size               = local.control_plane_size

  version {
    instance_template = google_compute_instance_template.node["control-plane"].id
  }

  # A new template reaches the control-plane node only when the node is recreated, never by itself: replacing
  # the only control-plane node replaces the cluster. Nor does the group move it to another zone to even out
  # its spread. No autohealing either: before berth_cluster initializes it, the node answers no health check.
  update_policy {
    type                         = "OPPORTUNISTIC"
    minimal_action               = "REPLACE"
    instance_redistribution_type = "NONE"
    max_surge_fixed              = length(var.zones)
    max_unavailable_fixed        = 0
  }

  # berth_cluster needs the first node running; this waits for it.
  wait_for_instances        = true
  wait_for_instances_status = "STABLE"
  timeouts {
    create = "20m"
  }

  # Its join service calls the Compute API, and its first boot may fetch from the internet.
  depends_on = [google_project_iam_member.join_service, google_compute_router_nat.nodes]
}

# The group names its instances itself (base name and a random suffix), so the first control-plane node is
# read back once the group is stable: the group's instance list gives its link, the instance its internal
# address and zone.
data "google_compute_region_instance_group" "control_plane" {
  self_link = google_compute_region_instance_group_manager.control_plane.instance_group
}

data "google_compute_instance" "first_control_plane" {
  self_link = data.google_compute_region_instance_group.control_plane.instances[0].instance
}

resource "berth_cluster" "prod" {
  endpoint               = "${data.google_compute_instance.first_control_plane.network_interface[0].network_ip}:7451"
  cluster_name           = local.cluster_name
  kubernetes_version     = data.berth_image.node.components["kubernetes"]
  control_plane_endpoint = "${google_compute_address.control_plane.address}:6443"
  pcrs                   = data.berth_image.node.pcrs
  # Installed by the first node right after kubeadm init (docs/networking.md): Flannel's VXLAN, on the UDP
  # port firewall.tf opens between nodes. "none" to bring your own.
  pod_network = "flannel"

  # The vTPM's EK certificate chains to Google's EK CAs and names this instance in Google's extension: that
  # binds the TPM to the instance, with no Google credentials in the Berth provider.
  gcp = {
    project  = var.project
    zone     = data.google_compute_instance.first_control_plane.zone
    instance = data.google_compute_instance.first_control_plane.name
  }

  kubernetes_ca_certificate = berth_secrets.cluster.kubernetes_ca_certificate
  join_ca_certificate       = berth_secrets.cluster.join_ca_certificate
  init_secret_wo            = ephemeral.berth_secrets.cluster.init_secret
  master_secret_wo          = ephemeral.berth_secrets.cluster.master_secret
  salt_wo                   = ephemeral.berth_secrets.cluster.salt
  kubernetes_ca_key_wo      = ephemeral.berth_secrets.cluster.kubernetes_ca_key
  join_ca_key_wo            = ephemeral.berth_secrets.cluster.join_ca_key

  # Which instance initialized the cluster matters only at init. Should the group ever recreate that instance,
  # the data sources above name another one; a new endpoint would plan a new cluster.
  lifecycle {
    ignore_changes = [endpoint, gcp]
  }

  # kubeadm init reaches the API server at control_plane_endpoint, the load balancer's address, which leads
  # anywhere only once the forwarding rule exists (see "One control-plane node" in docs/guides/gcp.md).
  depends_on = [google_compute_forwarding_rule.control_plane]
}

provider "berth" {
  alias      = "prod"
  kubeconfig = berth_cluster.prod.kubeconfig
}

resource "berth_join_policy" "prod" {
  provider   = berth.prod
  cluster_id = berth_cluster.prod.cluster_id
  images = [{
    name  = var.image
    roles = ["control-plane", "worker"]
    pcrs  = data.berth_image.node.pcrs
    # The join services hold nodes of this image to the version skew policy.
    kubernetes_version = data.berth_image.node.components["kubernetes"]
  }]
}

# The workers start once the policy admits their image.
resource "google_compute_region_instance_group_manager" "worker" {
  name                      = local.worker_group
  region                    = var.region
  base_instance_name        = "${local.cluster_name}-worker"
  distribution_policy_zones = var.zones
  target_size               = var.workers

  version {
    instance_template = google_compute_instance_template.node["worker"].id
  }

  # A new template replaces the workers a few at a time, new ones first: list the new image in the join policy
  # before (docs/guides/gcp.md, "A new image").
  update_policy {
    type                  = "PROACTIVE"
    minimal_action        = "REPLACE"
    max_surge_fixed       = length(var.zones)
    max_unavailable_fixed = 0
  }

  depends_on = [berth_join_policy.prod]
}

output "kubeconfig" {
  value     = berth_cluster.prod.kubeconfig
  sensitive = true
}

output "join_endpoint" {
  value = "${google_compute_address.control_plane.address}:7450"
}

output "first_control_plane" {
  value = data.google_compute_instance.first_control_plane.self_link
}
