# The local attested cluster of `make lab`: Terraform makes the cluster's secrets, boots lab machines with
# user-data from berth_node_config, attests and initializes the first control-plane node, and writes the join
# policy; the workers join by themselves. `make lab` sets up the lab host (bridge, swtpm EK CA, images and
# their manifest) first and passes its directory here; see docs/lab.md.
#
# The lab's machines are berth-lab commands run by local-exec, where a cloud configuration would have
# instances or an autoscaling group with the same user-data.

terraform {
  required_version = ">= 1.11"
  required_providers {
    berth = {
      source = "berthlabs/berth"
    }
  }
}

variable "root_key" {
  description = "The cluster's root key (base64 of 32 random bytes); make lab keeps it in the lab directory."
  type        = string
  ephemeral   = true
  sensitive   = true
}

variable "lab_dir" {
  description = "The lab host's directory (berth-lab host): image manifest, EK CA and machines."
  type        = string
  default     = "/var/tmp/berth-lab"
}

variable "berth_lab" {
  description = "The berth-lab command."
  type        = string
  default     = "berth-lab"
}

variable "control_plane_image" {
  description = "Image of the first control-plane node, from the lab's manifest."
  type        = string
  default     = "berthlab-a"
}

# A list rather than a map for for_each: terraform-plugin-testing, which applies this file in the acceptance
# tests, cannot read for_each instances from state. Add workers at the end of the list.
variable "workers" {
  description = "Worker machines: name, image and host number in 10.250.0.0/24."
  type = list(object({
    name  = string
    image = string
    host  = number
  }))
  default = [
    { name = "worker-0", image = "berthlab-a", host = 20 },
    { name = "worker-1", image = "berthlab-a", host = 21 },
  ]
}

variable "allowed_images" {
  description = "Images the join policy admits, for both roles."
  type        = list(string)
  default     = ["berthlab-a", "berthlab-b"]
}

locals {
  cluster_name  = "berthlab"
  subnet        = "10.250.0.0/24"
  control_plane = cidrhost(local.subnet, 10)
  manifest      = "${var.lab_dir}/berth-image.json"
}

resource "berth_secrets" "lab" {
  root_key_wo         = var.root_key
  root_key_wo_version = 1
}

ephemeral "berth_secrets" "lab" {
  root_key                  = var.root_key
  kubernetes_ca_certificate = berth_secrets.lab.kubernetes_ca_certificate
  join_ca_certificate       = berth_secrets.lab.join_ca_certificate
}

data "berth_image" "control_plane" {
  path = local.manifest
  name = var.control_plane_image
}

data "berth_image" "lab" {
  path = local.manifest
}

# The first machine is the control-plane node that berth_cluster initializes; the workers follow.
locals {
  control_plane_machine = {
    name      = "cp-0"
    role      = "control-plane"
    address   = local.control_plane
    image     = var.control_plane_image
    user_data = data.berth_node_config.control_plane.json
    lab       = var.berth_lab
    dir       = var.lab_dir
  }
  worker_machines = [for w in var.workers : {
    name      = w.name
    role      = "worker"
    address   = cidrhost(local.subnet, w.host)
    image     = w.image
    user_data = data.berth_node_config.worker.json
    lab       = var.berth_lab
    dir       = var.lab_dir
  }]
  machines = concat([local.control_plane_machine], local.worker_machines)
}

# Only the first control-plane node's user-data carries the init secret's hash.
data "berth_node_config" "control_plane" {
  cluster_name     = local.cluster_name
  join_ca_pin      = berth_secrets.lab.join_ca_pin
  init_secret_hash = berth_secrets.lab.init_secret_hash
}

data "berth_node_config" "worker" {
  cluster_name = local.cluster_name
  join_ca_pin  = berth_secrets.lab.join_ca_pin
}

# The lab's machines, booted together as an autoscaling group's would be; the workers join once the policy
# admits their image. A machine whose image or user-data changes is replaced, as a cloud instance would be.
resource "terraform_data" "machine" {
  count            = length(local.machines)
  input            = local.machines[count.index]
  triggers_replace = local.machines[count.index]

  provisioner "local-exec" {
    command     = "\"$LAB\" node up --dir \"$DIR\" --name \"$NAME\" --role \"$ROLE\" --addr \"$ADDR\" --image \"$IMAGE\" --user-data \"$USER_DATA\""
    environment = { LAB = self.input.lab, DIR = self.input.dir, NAME = self.input.name, ROLE = self.input.role, ADDR = self.input.address, IMAGE = self.input.image, USER_DATA = self.input.user_data }
  }

  provisioner "local-exec" {
    when        = destroy
    command     = "\"$LAB\" node down --dir \"$DIR\" --name \"$NAME\""
    environment = { LAB = self.input.lab, DIR = self.input.dir, NAME = self.input.name }
  }
}

resource "berth_cluster" "lab" {
  endpoint           = "${local.control_plane}:7451"
  cluster_name       = local.cluster_name
  kubernetes_version = data.berth_image.control_plane.components["kubernetes"]
  pcrs               = data.berth_image.control_plane.pcrs
  ek_ca_certificates = file("${var.lab_dir}/ek-ca.pem")

  kubernetes_ca_certificate = berth_secrets.lab.kubernetes_ca_certificate
  join_ca_certificate       = berth_secrets.lab.join_ca_certificate
  init_secret_wo            = ephemeral.berth_secrets.lab.init_secret
  master_secret_wo          = ephemeral.berth_secrets.lab.master_secret
  salt_wo                   = ephemeral.berth_secrets.lab.salt
  kubernetes_ca_key_wo      = ephemeral.berth_secrets.lab.kubernetes_ca_key
  join_ca_key_wo            = ephemeral.berth_secrets.lab.join_ca_key

  depends_on = [terraform_data.machine]

  # The node is a machine of this configuration: a new machine means a new cluster.
  lifecycle {
    replace_triggered_by = [terraform_data.machine[0]]
  }
}

provider "berth" {
  alias      = "lab"
  kubeconfig = berth_cluster.lab.kubeconfig
}

resource "berth_join_policy" "lab" {
  provider = berth.lab
  # Written only into this cluster; a new cluster gets it written again.
  cluster_id = berth_cluster.lab.cluster_id
  images = [for image in data.berth_image.lab.images : {
    name  = image.name
    roles = ["control-plane", "worker"]
    pcrs  = image.pcrs
    # The join services hold nodes of this image to the version skew policy.
    kubernetes_version = image.components["kubernetes"]
  } if contains(var.allowed_images, image.name)]
}

output "cluster_id" {
  value = berth_cluster.lab.cluster_id
}

output "api_server_endpoint" {
  value = berth_cluster.lab.api_server_endpoint
}

output "kubeconfig" {
  value     = berth_cluster.lab.kubeconfig
  sensitive = true
}
