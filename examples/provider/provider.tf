terraform {
  # Write-only arguments need Terraform 1.11.
  required_version = ">= 1.11"

  required_providers {
    berth = {
      source = "berthlabs/berth"
    }
  }
}

# The provider has no configuration.
provider "berth" {}
