# The cluster's own VPC network: one subnetwork for every node and the internal load balancer's address. The
# join services look nodes up on this network only: an instance with no interface on it is never found. With
# var.shared_vpc none of this is made: the host project's administrators own the network, its subnetwork, its
# Private Google Access and its Cloud NAT.

resource "google_compute_network" "cluster" {
  count = var.shared_vpc == null ? 1 : 0

  name                    = "${local.cluster_name}-cluster"
  auto_create_subnetworks = false
}

# Private Google Access: nodes without external addresses reach Google's APIs (the control-plane nodes' join
# services call compute.googleapis.com) from their internal addresses.
resource "google_compute_subnetwork" "nodes" {
  count = var.shared_vpc == null ? 1 : 0

  name                     = "${local.cluster_name}-nodes"
  region                   = var.region
  network                  = google_compute_network.cluster[0].id
  ip_cidr_range            = var.subnet_cidr
  private_ip_google_access = true
}

# Outbound connections to the internet (container images the node image does not carry, packages) leave
# through Cloud NAT; nothing comes in that way. Leave it out if the nodes need nothing outside Google's APIs.
resource "google_compute_router" "nodes" {
  count = var.shared_vpc == null ? 1 : 0

  name    = "${local.cluster_name}-nodes"
  region  = var.region
  network = google_compute_network.cluster[0].id
}

resource "google_compute_router_nat" "nodes" {
  count = var.shared_vpc == null ? 1 : 0

  name                               = "${local.cluster_name}-nodes"
  router                             = google_compute_router.nodes[0].name
  region                             = var.region
  nat_ip_allocate_option             = "AUTO_ONLY"
  source_subnetwork_ip_ranges_to_nat = "LIST_OF_SUBNETWORKS"

  subnetwork {
    name                    = google_compute_subnetwork.nodes[0].id
    source_ip_ranges_to_nat = ["ALL_IP_RANGES"]
  }
}
