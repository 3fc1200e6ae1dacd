# Who may talk to whom. The join service's port is open to the whole VPC: nodes that are not yet members
# reach it, and the service itself admits only instances of the configured groups, in this VPC, with their
# own NitroTPM.

resource "aws_security_group" "control_plane_lb" {
  name_prefix = "${local.cluster_name}-cp-lb-"
  vpc_id      = var.vpc_id

  ingress {
    description = "join service"
    from_port   = 7450
    to_port     = 7450
    protocol    = "tcp"
    cidr_blocks = [data.aws_vpc.cluster.cidr_block]
  }
  ingress {
    description = "API server"
    from_port   = 6443
    to_port     = 6443
    protocol    = "tcp"
    cidr_blocks = concat([data.aws_vpc.cluster.cidr_block], var.operator_cidrs)
  }
  egress {
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    cidr_blocks = [data.aws_vpc.cluster.cidr_block]
  }
}

resource "aws_security_group" "control_plane" {
  name_prefix = "${local.cluster_name}-cp-"
  vpc_id      = var.vpc_id

  # The load balancer keeps the clients' addresses on the join port, so these rules name the clients; on the
  # API server's port it connects from its own addresses in the VPC, which the VPC's range covers.
  ingress {
    description = "join service"
    from_port   = 7450
    to_port     = 7450
    protocol    = "tcp"
    cidr_blocks = [data.aws_vpc.cluster.cidr_block]
  }
  ingress {
    description = "init server: berth_cluster, once"
    from_port   = 7451
    to_port     = 7451
    protocol    = "tcp"
    cidr_blocks = var.operator_cidrs
  }
  ingress {
    description = "API server"
    from_port   = 6443
    to_port     = 6443
    protocol    = "tcp"
    cidr_blocks = concat([data.aws_vpc.cluster.cidr_block], var.operator_cidrs)
  }
  ingress {
    description = "etcd, between control-plane nodes"
    from_port   = 2379
    to_port     = 2380
    protocol    = "tcp"
    self        = true
  }
  ingress {
    description = "kubelet"
    from_port   = 10250
    to_port     = 10250
    protocol    = "tcp"
    self        = true
  }
  egress {
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    cidr_blocks = ["0.0.0.0/0"]
  }
}

resource "aws_security_group" "worker" {
  name_prefix = "${local.cluster_name}-worker-"
  vpc_id      = var.vpc_id

  ingress {
    description     = "kubelet, from the control plane"
    from_port       = 10250
    to_port         = 10250
    protocol        = "tcp"
    security_groups = [aws_security_group.control_plane.id]
  }
  egress {
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    cidr_blocks = ["0.0.0.0/0"]
  }
}

# Every node, both roles: the pod network's tunnel between nodes (docs/networking.md). Only members of this
# group may send into it: the tunnel carries pods' packets unauthenticated.
resource "aws_security_group" "pod_network" {
  name_prefix = "${local.cluster_name}-pods-"
  vpc_id      = var.vpc_id

  ingress {
    description = "pod network: VXLAN (Flannel, Cilium), between nodes"
    from_port   = 8472
    to_port     = 8472
    protocol    = "udp"
    self        = true
  }
}
