# The policy ConfigMap in kube-system, by name.
terraform import berth_join_policy.this berth-join-policy
