terraform {
  required_providers {
    berth = {
      source = "berthlabs/berth"
    }
  }
}

# berth-image.json is written by `packer build` with the Berth plugin.
data "berth_image" "release" {
  path = "${path.module}/berth-image.json"
  name = "berth-2026-11-22"
}

output "images" {
  value = [for image in data.berth_image.release.images : image.name]
}

# The measurements a join policy admits for this image.
output "pcrs" {
  value = data.berth_image.release.pcrs
}
