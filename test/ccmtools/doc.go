// Package ccmtools pins the AWS cloud controller manager (k8s.io/cloud-provider-aws) that the AWS lab runs
// against its EC2 endpoint, so that a node's provider ID and --cloud-provider=external are tested with the
// controller the guides install, built from its module by scripts/build-aws-ccm.sh. It is a module of its own
// so that the controller's dependencies stay out of the product's go.mod. Its Kubernetes libraries follow
// the lab's Kubernetes patch release, whose build they share.
package ccmtools
