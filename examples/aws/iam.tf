# The control-plane nodes' instance profile serves two programs: the join service, which calls two read-only
# EC2 actions, and the AWS cloud controller manager (docs/guides/aws.md), which reads instances to initialize
# and remove Nodes and makes load balancers for Services of type LoadBalancer. Workers have no instance
# profile at all.

data "aws_iam_policy_document" "assume_ec2" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

# DescribeInstances takes no resource-level permissions, and the join service filters by VPC itself; both
# actions are kept to the cluster's region.
data "aws_iam_policy_document" "join_service" {
  statement {
    sid       = "FindJoiningInstancesAndTheirNitroTPMs"
    actions   = ["ec2:DescribeInstances", "ec2:GetInstanceTpmEkPub"]
    resources = ["*"]
    condition {
      test     = "StringEquals"
      variable = "aws:RequestedRegion"
      values   = [var.region]
    }
  }
}

resource "aws_iam_role" "control_plane" {
  name_prefix        = "${local.cluster_name}-cp-"
  assume_role_policy = data.aws_iam_policy_document.assume_ec2.json
}

resource "aws_iam_role_policy" "join_service" {
  name   = "berth-join-service"
  role   = aws_iam_role.control_plane.id
  policy = data.aws_iam_policy_document.join_service.json
}

# The cloud controller manager's actions, from its own list (k8s.io/cloud-provider-aws docs/prerequisites.md)
# without those of the controllers Berth leaves off (routes, volumes). Creating and deleting load balancers and
# security groups takes no resource-level condition that would tie them to this cluster: the controller
# limits itself to the resources it tags with kubernetes.io/cluster/<cluster>.
data "aws_iam_policy_document" "cloud_controller_manager" {
  statement {
    sid       = "InitializeAndRemoveNodes"
    actions   = ["ec2:DescribeInstances", "ec2:DescribeAvailabilityZones", "ec2:DescribeInstanceTopology"]
    resources = ["*"]
  }
  statement {
    sid = "ServeLoadBalancerServices"
    actions = [
      "ec2:DescribeSecurityGroups", "ec2:DescribeSubnets", "ec2:DescribeVpcs", "ec2:DescribeRouteTables",
      "ec2:CreateSecurityGroup", "ec2:DeleteSecurityGroup", "ec2:CreateTags",
      "ec2:AuthorizeSecurityGroupIngress", "ec2:RevokeSecurityGroupIngress", "ec2:ModifyInstanceAttribute",
      "elasticloadbalancing:AddTags", "elasticloadbalancing:ApplySecurityGroupsToLoadBalancer",
      "elasticloadbalancing:AttachLoadBalancerToSubnets", "elasticloadbalancing:ConfigureHealthCheck",
      "elasticloadbalancing:CreateListener", "elasticloadbalancing:CreateLoadBalancer",
      "elasticloadbalancing:CreateLoadBalancerListeners", "elasticloadbalancing:CreateLoadBalancerPolicy",
      "elasticloadbalancing:CreateTargetGroup", "elasticloadbalancing:DeleteListener",
      "elasticloadbalancing:DeleteLoadBalancer", "elasticloadbalancing:DeleteLoadBalancerListeners",
      "elasticloadbalancing:DeleteTargetGroup", "elasticloadbalancing:DeregisterInstancesFromLoadBalancer",
      "elasticloadbalancing:DeregisterTargets", "elasticloadbalancing:DescribeListeners",
      "elasticloadbalancing:DescribeLoadBalancerAttributes", "elasticloadbalancing:DescribeLoadBalancerPolicies",
      "elasticloadbalancing:DescribeLoadBalancers", "elasticloadbalancing:DescribeTargetGroups",
      "elasticloadbalancing:DescribeTargetHealth", "elasticloadbalancing:DetachLoadBalancerFromSubnets",
      "elasticloadbalancing:ModifyListener", "elasticloadbalancing:ModifyLoadBalancerAttributes",
      "elasticloadbalancing:ModifyTargetGroup", "elasticloadbalancing:RegisterInstancesWithLoadBalancer",
      "elasticloadbalancing:RegisterTargets", "elasticloadbalancing:SetLoadBalancerPoliciesForBackendServer",
      "elasticloadbalancing:SetLoadBalancerPoliciesOfListener", "iam:CreateServiceLinkedRole", "kms:DescribeKey",
    ]
    resources = ["*"]
  }
}

resource "aws_iam_role_policy" "cloud_controller_manager" {
  name   = "berth-cloud-controller-manager"
  role   = aws_iam_role.control_plane.id
  policy = data.aws_iam_policy_document.cloud_controller_manager.json
}

resource "aws_iam_instance_profile" "control_plane" {
  name_prefix = "${local.cluster_name}-cp-"
  role        = aws_iam_role.control_plane.name
}
