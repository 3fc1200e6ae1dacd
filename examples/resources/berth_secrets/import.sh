# The API server's host:port; the root key comes from the provider's root_key (see the import guide).
terraform import berth_secrets.cluster 10.0.0.10:6443
