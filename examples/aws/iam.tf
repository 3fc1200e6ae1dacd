# The control-plane nodes' join services call two read-only EC2 actions, with their instance profile: no
# more. Workers have no instance profile at all.

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

resource "aws_iam_instance_profile" "control_plane" {
  name_prefix = "${local.cluster_name}-cp-"
  role        = aws_iam_role.control_plane.name
}
