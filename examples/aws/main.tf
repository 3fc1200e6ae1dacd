# A Berth cluster on AWS EC2: a control-plane autoscaling group and a worker autoscaling group of one AMI,
# measured and booted by its UKI with a NitroTPM. Nodes join by themselves: the join service, on the
# control-plane nodes, finds each connecting instance through the EC2 API, gives it the role of its
# autoscaling group, and trusts its TPM only when its endorsement key is the one EC2 reports for that
# instance. docs/guides/aws.md walks through it, from `packer build` to a scaled group.
#
# Terraform must reach the first control-plane node's private address on port 7451 (run it inside the VPC,
# or over a VPN): that is where berth_cluster attests the node and sends it the cluster's secrets.

terraform {
  required_version = ">= 1.11"
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = "~> 6.0"
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

variable "region" {
  description = "The region of the AMI and the cluster."
  type        = string
}

variable "vpc_id" {
  description = "The VPC of the cluster's nodes; its join services admit instances of this VPC only."
  type        = string
}

variable "subnet_ids" {
  description = "Private subnets of var.vpc_id for the nodes and the internal load balancer."
  type        = list(string)
}

variable "operator_cidrs" {
  description = "Where Terraform and kubectl run from: they reach the init port (7451) and the API server (6443)."
  type        = list(string)
}

variable "manifest" {
  description = "berth-image.json, written by `packer build examples/packer/aws.pkr.hcl`."
  type        = string
  default     = "berth-image.json"
}

variable "image" {
  description = "The image in the manifest to run."
  type        = string
  default     = "berth-node-aws"
}

variable "instance_type" {
  description = "An instance type with NitroTPM support (Nitro-based, UEFI boot), such as m6i.large."
  type        = string
  default     = "m6i.large"
}

variable "control_plane_nodes" {
  description = "Size of the control-plane group: 3 or 5 keep etcd's quorum through a node's loss; 1 is a cluster that dies with its instance."
  type        = number
  default     = 3
  validation {
    condition     = contains([1, 3, 5], var.control_plane_nodes)
    error_message = "control_plane_nodes must be 1, 3 or 5: etcd needs a majority, and an even count adds a node without adding a failure it survives."
  }
}

variable "workers" {
  description = "Size of the worker group."
  type        = object({ min = number, desired = number, max = number })
  default     = { min = 1, desired = 2, max = 10 }
}

locals {
  cluster_name = "prod"
  # The groups' names are known before they exist, so the control-plane nodes' user-data can name them.
  control_plane_group = "${local.cluster_name}-control-plane"
  worker_group        = "${local.cluster_name}-workers"
  # berth-manifest names an AMI copied to another region "<image>-<region>"; the UKI, so the PCRs, are the same.
  ami = one([for image in data.berth_image.all.images : image.artifact_id
  if contains([var.image, "${var.image}-${var.region}"], image.name) && image.region == var.region])
}

data "berth_image" "node" {
  path = var.manifest
  name = var.image
}

data "berth_image" "all" {
  path = var.manifest
}

data "aws_vpc" "cluster" {
  id = var.vpc_id
}

# The root key comes from Secrets Manager (root_key.tf). Never change root_key_wo_version on a running cluster:
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

# An internal network load balancer in front of the control-plane nodes: the join service (7450) and the
# API server (6443). Cross-zone load balancing is on (a network load balancer's default is off), so that each
# zone's address reaches the control-plane nodes of every zone, not only its own, which may have none.
resource "aws_lb" "control_plane" {
  name                             = "${local.cluster_name}-cp"
  internal                         = true
  load_balancer_type               = "network"
  subnets                          = var.subnet_ids
  security_groups                  = [aws_security_group.control_plane_lb.id]
  enable_cross_zone_load_balancing = true
}

# The join service identifies a node by its source address, so its target group keeps the clients' addresses.
# A joining control-plane node is not sent to itself: its join service does not listen before it is a member,
# so it fails the health check. Only before init, when no target is healthy and the load balancer sends to
# any, can a node's attempt reach itself and go unanswered; its join client times out and tries again.
resource "aws_lb_target_group" "join" {
  name               = "${local.cluster_name}-join"
  port               = 7450
  protocol           = "TCP"
  vpc_id             = var.vpc_id
  target_type        = "instance"
  preserve_client_ip = true
}

resource "aws_lb_listener" "join" {
  load_balancer_arn = aws_lb.control_plane.arn
  port              = 7450
  protocol          = "TCP"
  default_action {
    type             = "forward"
    target_group_arn = aws_lb_target_group.join.arn
  }
}

# The API server needs no client address, and a control-plane node reaches it through the load balancer
# (kubeadm's controlPlaneEndpoint, which kubeadm init, its kubelet and every joining control-plane node use):
# with the client's address preserved, a connection the load balancer sends back to the node that opened it
# would never complete, and kubeadm init would hang. Without it, the load balancer's own address is the
# source and the connection completes wherever it lands.
resource "aws_lb_target_group" "api" {
  name               = "${local.cluster_name}-api"
  port               = 6443
  protocol           = "TCP"
  vpc_id             = var.vpc_id
  target_type        = "instance"
  preserve_client_ip = false
}

resource "aws_lb_listener" "api" {
  load_balancer_arn = aws_lb.control_plane.arn
  port              = 6443
  protocol          = "TCP"
  default_action {
    type             = "forward"
    target_group_arn = aws_lb_target_group.api.arn
  }
}

# The control-plane nodes' user-data: the init secret's hash (only they may initialize), their role, and
# the groups whose instances their join services admit.
data "berth_node_config" "control_plane" {
  cluster_name     = local.cluster_name
  join_ca_pin      = berth_secrets.cluster.join_ca_pin
  init_secret_hash = berth_secrets.cluster.init_secret_hash
  join_endpoints   = ["${aws_lb.control_plane.dns_name}:7450"]
  role             = "control-plane"
  autoscaling_groups = {
    (local.control_plane_group) = "control-plane"
    (local.worker_group)        = "worker"
  }
}

data "berth_node_config" "worker" {
  cluster_name   = local.cluster_name
  join_ca_pin    = berth_secrets.cluster.join_ca_pin
  join_endpoints = ["${aws_lb.control_plane.dns_name}:7450"]
  role           = "worker"
}

resource "aws_launch_template" "node" {
  for_each = {
    control-plane = { user_data = data.berth_node_config.control_plane.json, profile = aws_iam_instance_profile.control_plane.name, sg = aws_security_group.control_plane.id }
    worker        = { user_data = data.berth_node_config.worker.json, profile = null, sg = aws_security_group.worker.id }
  }

  name_prefix            = "${local.cluster_name}-${each.key}-"
  image_id               = local.ami
  instance_type          = var.instance_type
  user_data              = base64encode(each.value.user_data)
  vpc_security_group_ids = [each.value.sg, aws_security_group.pod_network.id]

  dynamic "iam_instance_profile" {
    for_each = each.value.profile == null ? [] : [each.value.profile]
    content {
      name = iam_instance_profile.value
    }
  }

  # IMDSv2 only; a hop limit of 1 keeps the metadata from containers on the node.
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
    instance_metadata_tags      = "disabled"
  }

  # The encrypted state disk the agent keys with its LUKS2 volume: agent.yaml names it by this device name
  # (stateDisk: /dev/disk/by-ebs-name/sdb), which EBS reports to the instance whatever NVMe name it gets.
  block_device_mappings {
    device_name = "/dev/sdb"
    ebs {
      volume_size           = 20
      volume_type           = "gp3"
      delete_on_termination = true
    }
  }
}

# Three control-plane nodes by default: etcd keeps its quorum when one fails or is replaced. The first the
# group starts is initialized by berth_cluster; the others join it as control-plane nodes through the join
# service, once the join policy admits them.
resource "aws_autoscaling_group" "control_plane" {
  name                = local.control_plane_group
  min_size            = var.control_plane_nodes
  max_size            = var.control_plane_nodes
  desired_capacity    = var.control_plane_nodes
  vpc_zone_identifier = var.subnet_ids
  target_group_arns   = [aws_lb_target_group.join.arn, aws_lb_target_group.api.arn]
  launch_template {
    id      = aws_launch_template.node["control-plane"].id
    version = aws_launch_template.node["control-plane"].latest_version
  }
  # berth_cluster needs the first node running; this waits for it.
  wait_for_capacity_timeout = "15m"
  # The AWS cloud controller manager knows the cluster's instances by this tag (docs/guides/aws.md).
  tag {
    key                 = "kubernetes.io/cluster/${local.cluster_name}"
    value               = "owned"
    propagate_at_launch = true
  }
}

data "aws_instances" "first_control_plane" {
  instance_tags        = { "aws:autoscaling:groupName" = aws_autoscaling_group.control_plane.name }
  instance_state_names = ["running"]
}

resource "berth_cluster" "prod" {
  endpoint               = "${data.aws_instances.first_control_plane.private_ips[0]}:7451"
  cluster_name           = local.cluster_name
  kubernetes_version     = data.berth_image.node.components["kubernetes"]
  control_plane_endpoint = "${aws_lb.control_plane.dns_name}:6443"
  pcrs                   = data.berth_image.node.pcrs
  # Installed by the first node right after kubeadm init (docs/networking.md): Flannel's VXLAN, on the UDP
  # port security.tf opens between nodes. "none" to bring your own.
  pod_network = "flannel"

  # A NitroTPM has no endorsement key certificate: EC2 vouches for the instance's key instead.
  aws = {
    instance_id = data.aws_instances.first_control_plane.ids[0]
    region      = var.region
  }

  kubernetes_ca_certificate = berth_secrets.cluster.kubernetes_ca_certificate
  join_ca_certificate       = berth_secrets.cluster.join_ca_certificate
  init_secret_wo            = ephemeral.berth_secrets.cluster.init_secret
  master_secret_wo          = ephemeral.berth_secrets.cluster.master_secret
  salt_wo                   = ephemeral.berth_secrets.cluster.salt
  kubernetes_ca_key_wo      = ephemeral.berth_secrets.cluster.kubernetes_ca_key
  join_ca_key_wo            = ephemeral.berth_secrets.cluster.join_ca_key

  # Which instance initialized the cluster matters only at init: the data source lists the group's instances
  # in no fixed order, and the group replaces failed ones. A new endpoint would otherwise plan a new cluster.
  lifecycle {
    ignore_changes = [endpoint, aws]
  }
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
resource "aws_autoscaling_group" "worker" {
  name                = local.worker_group
  min_size            = var.workers.min
  desired_capacity    = var.workers.desired
  max_size            = var.workers.max
  vpc_zone_identifier = var.subnet_ids
  launch_template {
    id      = aws_launch_template.node["worker"].id
    version = aws_launch_template.node["worker"].latest_version
  }
  # The AWS cloud controller manager knows the cluster's instances by this tag (docs/guides/aws.md).
  tag {
    key                 = "kubernetes.io/cluster/${local.cluster_name}"
    value               = "owned"
    propagate_at_launch = true
  }
  depends_on = [berth_join_policy.prod]
}

output "kubeconfig" {
  value     = berth_cluster.prod.kubeconfig
  sensitive = true
}

output "join_endpoint" {
  value = "${aws_lb.control_plane.dns_name}:7450"
}
