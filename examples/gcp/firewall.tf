# Who may talk to whom. A VPC network denies every inbound connection these rules do not allow. Rules name
# their targets by service account, which only whoever may launch instances as that account can give an
# instance, not by network tag, which anyone allowed compute.instances.setTags can add.
#
# The join service's port is open to the whole subnetwork: nodes that are not yet members reach it, and the
# service itself admits only instances of the configured groups, on this network, with their own vTPM. The
# internal load balancer passes the clients' packets through, so these rules name the clients, not the
# balancer.

resource "google_compute_firewall" "join" {
  name                    = "${local.cluster_name}-join"
  project                 = local.network_project
  network                 = local.network
  description             = "join service, from the nodes"
  direction               = "INGRESS"
  source_ranges           = [var.subnet_cidr]
  target_service_accounts = [google_service_account.control_plane.email]

  allow {
    protocol = "tcp"
    ports    = ["7450"]
  }
}

resource "google_compute_firewall" "api" {
  name                    = "${local.cluster_name}-api"
  project                 = local.network_project
  network                 = local.network
  description             = "API server, from the nodes and the operators"
  direction               = "INGRESS"
  source_ranges           = concat([var.subnet_cidr], var.operator_cidrs)
  target_service_accounts = [google_service_account.control_plane.email]

  allow {
    protocol = "tcp"
    ports    = ["6443"]
  }
}

resource "google_compute_firewall" "init" {
  name                    = "${local.cluster_name}-init"
  project                 = local.network_project
  network                 = local.network
  description             = "init server: berth_cluster, once, from where Terraform runs"
  direction               = "INGRESS"
  source_ranges           = var.operator_cidrs
  target_service_accounts = [google_service_account.control_plane.email]

  allow {
    protocol = "tcp"
    ports    = ["7451"]
  }
}

resource "google_compute_firewall" "etcd" {
  name                    = "${local.cluster_name}-etcd"
  project                 = local.network_project
  network                 = local.network
  description             = "etcd, between control-plane nodes only"
  direction               = "INGRESS"
  source_service_accounts = [google_service_account.control_plane.email]
  target_service_accounts = [google_service_account.control_plane.email]

  allow {
    protocol = "tcp"
    ports    = ["2379-2380"]
  }
}

resource "google_compute_firewall" "kubelet" {
  name                    = "${local.cluster_name}-kubelet"
  project                 = local.network_project
  network                 = local.network
  description             = "kubelet, from the control plane"
  direction               = "INGRESS"
  source_service_accounts = [google_service_account.control_plane.email]
  target_service_accounts = [google_service_account.control_plane.email, google_service_account.worker.email]

  allow {
    protocol = "tcp"
    ports    = ["10250"]
  }
}

# The pod network's tunnel between nodes, both roles (docs/networking.md). Only the nodes may send into it: the
# tunnel carries pods' packets unauthenticated.
resource "google_compute_firewall" "pod_network" {
  name                    = "${local.cluster_name}-pod-network"
  project                 = local.network_project
  network                 = local.network
  description             = "pod network: VXLAN (Flannel, Cilium), between nodes"
  direction               = "INGRESS"
  source_service_accounts = [google_service_account.control_plane.email, google_service_account.worker.email]
  target_service_accounts = [google_service_account.control_plane.email, google_service_account.worker.email]

  allow {
    protocol = "udp"
    ports    = ["8472"]
  }
}

# Google's health checkers probe the backends from these ranges, and the load balancer sends traffic only to
# backends they find healthy.
resource "google_compute_firewall" "health_checks" {
  name                    = "${local.cluster_name}-health-checks"
  project                 = local.network_project
  network                 = local.network
  description             = "load balancer health checks"
  direction               = "INGRESS"
  source_ranges           = ["35.191.0.0/16", "130.211.0.0/22"]
  target_service_accounts = [google_service_account.control_plane.email]

  allow {
    protocol = "tcp"
    ports    = ["6443"]
  }
}
