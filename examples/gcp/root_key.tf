# The cluster's root key. Every key of the cluster derives from it (berth_secrets), and it alone recovers a node
# whose disk nothing else unlocks (docs/recovery.md). It lives in Secret Manager, where a team keeps its other
# secrets: the first apply writes it there once, and every run reads it back. Neither the state nor a plan holds
# it. It cannot be rotated: a new root key derives new CAs, which is a new cluster.
#
# hashicorp/google 7.6 brought the ephemeral google_secret_manager_secret_version; 7.11 lets its secret be a bare
# secret id as well as projects/<project>/secrets/<id>, which root_key_secret may be.

variable "root_key_secret" {
  description = "The id (or projects/<project>/secrets/<id>) of a Secret Manager secret the team made itself, whose latest version is the root key: base64 of 32 random bytes, and nothing else. Terraform then only reads it. Null: the first apply makes the secret and writes a new key into it, once."
  type        = string
  default     = null
}

locals {
  make_root_key = var.root_key_secret == null
}

# Opened on every run, but only the first run's bytes are ever sent: secret_data_wo_version stays 1, so no
# later run writes the secret again, and the other runs' bytes are dropped.
ephemeral "random_bytes" "root_key" {
  count  = local.make_root_key ? 1 : 0
  length = 32
}

# Whoever may access this secret's versions can unlock every node's disk and sign admin credentials for the
# cluster; neither node service account can (iam.tf). Losing it loses every disk key, so neither Terraform nor
# the provider will destroy it.
resource "google_secret_manager_secret" "root_key" {
  count     = local.make_root_key ? 1 : 0
  secret_id = "berth-${local.cluster_name}-root-key"
  labels    = { berth-cluster = local.cluster_name }

  replication {
    auto {}
  }

  deletion_protection = true
  lifecycle {
    prevent_destroy = true
  }
}

# Write-only: the key goes to Secret Manager and nowhere else. A new secret_data_wo_version would replace this
# version with a new key, which the running cluster cannot use; prevent_destroy refuses that.
resource "google_secret_manager_secret_version" "root_key" {
  count                  = local.make_root_key ? 1 : 0
  secret                 = google_secret_manager_secret.root_key[0].id
  secret_data_wo         = ephemeral.random_bytes.root_key[0].base64
  secret_data_wo_version = 1

  lifecycle {
    prevent_destroy = true
  }
}

locals {
  # Named through the version, not the secret: on the first apply Terraform reads the key after writing it.
  root_key_secret = local.make_root_key ? google_secret_manager_secret_version.root_key[0].secret : var.root_key_secret
}

# Read on every plan and apply, the secret's latest version. On the first apply the secret does not exist when
# Terraform plans, so it is read at apply, before berth_secrets needs it.
ephemeral "google_secret_manager_secret_version" "root_key" {
  secret = local.root_key_secret
}

locals {
  root_key = ephemeral.google_secret_manager_secret_version.root_key.secret_data
}

output "root_key_secret" {
  description = "The secret that holds the root key, for recovery (docs/recovery.md). Not the key itself."
  value       = local.root_key_secret
}
