# The first control-plane node's init endpoint; the API server is then its address, port 6443.
terraform import berth_cluster.this 10.0.0.10:7451
# With a control_plane_endpoint, the API server's host:port after a comma.
terraform import berth_cluster.this 10.0.0.10:7451,api.example.internal:6443
