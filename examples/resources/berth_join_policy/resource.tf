terraform {
  required_providers {
    berth = {
      source = "berthlabs/berth"
    }
  }
}

# The images in the Packer manifest that may join, per role. Dropping an image from the list stops new
# nodes of it from joining.
data "berth_image" "current" {
  path = "${path.module}/berth-image.json"
  name = "berth-2026-11-22"
}

resource "berth_join_policy" "this" {
  images = [
    {
      name  = "berth-2026-11-22"
      roles = ["control-plane", "worker"]
      pcrs  = data.berth_image.current.pcrs
      # Nodes of a newer Kubernetes minor than the control plane wait until it runs theirs.
      kubernetes_version = data.berth_image.current.components["kubernetes"]
    },
    {
      name    = "berth-2026-11-01"
      roles   = ["worker"]
      expires = "2026-12-31T00:00:00Z"
      pcrs = {
        "4"  = "3d4587b3cf4e0e2fbbbd2b1ce6e5b4a2c0ee3f1c0f1e5a3a9f2b7c6d8e9f0a1b"
        "9"  = "77aa2b7c6d8e9f0a1b3d4587b3cf4e0e2fbbbd2b1ce6e5b4a2c0ee3f1c0f1e5a"
        "11" = "c0ee3f1c0f1e5a3a9f2b7c6d8e9f0a1b3d4587b3cf4e0e2fbbbd2b1ce6e5b4a2"
      }
    },
  ]
}
