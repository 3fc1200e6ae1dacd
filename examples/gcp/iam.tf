# The control-plane nodes' join services call three read-only Compute Engine methods as the control-plane
# instances' service account: no more. Workers run as a service account of their own with no role at all.
#
# Neither role uses the Compute Engine default service account: many projects still give it Editor, which
# includes compute.instances.setMetadata. A node that could set metadata could rewrite a control-plane node's
# berth-node-config (which groups get which role) or add a startup script or SSH key to any node, root there
# at its next boot.

# What each method needs, from Compute Engine's API reference:
#   instances.aggregatedList                          compute.instances.list
#   regionInstanceGroupManagers.listManagedInstances  compute.instanceGroupManagers.get
#   instances.getShieldedInstanceIdentity             compute.instances.getShieldedInstanceIdentity
# IAM has no regionInstanceGroupManagers permissions: regional groups are read with the zonal groups' one.
# aggregatedList is a call on the project, so the role is bound on the project: a control-plane node can list
# the project's instances and read any Shielded VM's public endorsement key. A project of its own keeps that
# to the cluster.
resource "google_project_iam_custom_role" "join_service" {
  project     = var.project
  role_id     = "berthJoinService_${local.cluster_name}"
  title       = "Berth join service (${local.cluster_name})"
  description = "Find joining instances by internal address, their managed instance group, and their vTPM's endorsement key."
  permissions = [
    "compute.instances.list",
    "compute.instanceGroupManagers.get",
    "compute.instances.getShieldedInstanceIdentity",
  ]
}

resource "google_service_account" "control_plane" {
  account_id   = "${local.cluster_name}-control-plane"
  display_name = "Berth ${local.cluster_name}: control-plane nodes"
}

resource "google_project_iam_member" "join_service" {
  project = var.project
  role    = google_project_iam_custom_role.join_service.name
  member  = "serviceAccount:${google_service_account.control_plane.email}"
}

# The GCP cloud controller manager (docs/guides/gcp.md) runs on the control-plane nodes as their service
# account. Initializing and removing Nodes reads instances and zones; LoadBalancer Services make forwarding
# rules, target pools, health checks, addresses and firewall rules. None of it may set an instance's metadata.
resource "google_project_iam_custom_role" "cloud_controller_manager" {
  project     = var.project
  role_id     = "berthCloudControllerManager_${local.cluster_name}"
  title       = "Berth cloud controller manager (${local.cluster_name})"
  description = "Initialize and remove the cluster's Nodes, and serve its LoadBalancer Services."
  permissions = [
    "compute.instances.get", "compute.instances.list", "compute.zones.list", "compute.zones.get",
    "compute.regions.get", "compute.networks.get", "compute.subnetworks.get",
    "compute.addresses.create", "compute.addresses.delete", "compute.addresses.get", "compute.addresses.use",
    "compute.forwardingRules.create", "compute.forwardingRules.delete", "compute.forwardingRules.get",
    "compute.forwardingRules.list", "compute.forwardingRules.setTarget",
    "compute.targetPools.create", "compute.targetPools.delete", "compute.targetPools.get",
    "compute.targetPools.addInstance", "compute.targetPools.removeInstance", "compute.targetPools.use",
    "compute.httpHealthChecks.create", "compute.httpHealthChecks.delete", "compute.httpHealthChecks.get",
    "compute.httpHealthChecks.update", "compute.httpHealthChecks.useReadOnly",
    "compute.firewalls.create", "compute.firewalls.delete", "compute.firewalls.get", "compute.firewalls.update",
    "compute.networks.updatePolicy", "compute.instances.use",
  ]
}

resource "google_project_iam_member" "cloud_controller_manager" {
  project = var.project
  role    = google_project_iam_custom_role.cloud_controller_manager.name
  member  = "serviceAccount:${google_service_account.control_plane.email}"
}

# No role: a worker's agent reads only the metadata server, which needs no credentials. Grant narrow roles here
# if workloads need them (logging, an image registry), never compute.instances.setMetadata or any compute.*
# permission that reads other instances.
resource "google_service_account" "worker" {
  account_id   = "${local.cluster_name}-worker"
  display_name = "Berth ${local.cluster_name}: workers"
}
