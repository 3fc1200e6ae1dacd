# The cluster's root key. Every key of the cluster derives from it (berth_secrets), and it alone recovers a node
# whose disk nothing else unlocks (docs/recovery.md). It lives in Secrets Manager, where a team keeps its other
# secrets: the first apply writes it there once, and every run reads it back. Neither the state nor a plan holds
# it. It cannot be rotated: a new root key derives new CAs, which is a new cluster.

variable "root_key_secret" {
  description = "The ARN or name of a Secrets Manager secret the team made itself, whose secret string is the root key: base64 of 32 random bytes, and nothing else. Terraform then only reads it. Null: the first apply makes the secret and writes a new key into it, once."
  type        = string
  default     = null
}

locals {
  make_root_key = var.root_key_secret == null
}

# Opened on every run, but only the first run's bytes are ever sent: secret_string_wo_version stays 1, so no
# later run writes the secret again, and the other runs' bytes are dropped.
ephemeral "random_bytes" "root_key" {
  count  = local.make_root_key ? 1 : 0
  length = 32
}

# Whoever may read this secret can unlock every node's disk and sign admin credentials for the cluster; no
# node's role can. Losing it loses every disk key, so Terraform refuses to destroy it. No rotation is set up:
# a rotated value would be another cluster's root key.
resource "aws_secretsmanager_secret" "root_key" {
  count       = local.make_root_key ? 1 : 0
  name        = "berth/${local.cluster_name}/root-key"
  description = "The root key of Berth cluster ${local.cluster_name} (base64). A new value is a new cluster: never rotate it."

  lifecycle {
    prevent_destroy = true
  }
}

# Write-only: the key goes to Secrets Manager and nowhere else. A new secret_string_wo_version would write a new
# key into the secret, which the running cluster cannot use; prevent_destroy refuses a plan that deletes or
# replaces this version.
resource "aws_secretsmanager_secret_version" "root_key" {
  count                    = local.make_root_key ? 1 : 0
  secret_id                = aws_secretsmanager_secret.root_key[0].id
  secret_string_wo         = ephemeral.random_bytes.root_key[0].base64
  secret_string_wo_version = 1

  lifecycle {
    prevent_destroy = true
  }
}

locals {
  # Named through the version, not the secret: on the first apply Terraform reads the key after writing it.
  root_key_secret = local.make_root_key ? aws_secretsmanager_secret_version.root_key[0].secret_id : var.root_key_secret
}

# Read on every plan and apply. On the first apply the secret does not exist when Terraform plans, so it is read
# at apply, before berth_secrets needs it.
ephemeral "aws_secretsmanager_secret_version" "root_key" {
  secret_id = local.root_key_secret
}

locals {
  root_key = ephemeral.aws_secretsmanager_secret_version.root_key.secret_string
}

output "root_key_secret" {
  description = "The secret that holds the root key, for recovery (docs/recovery.md). Not the key itself."
  value       = local.root_key_secret
}
