// Package flanneltools pins the Flannel whose flanneld the real-cluster lab runs as its pod network (VXLAN
// backend, kube-subnet-mgr), built from its module by scripts/build-k8s.sh. It is a module of its own so that
// Flannel's dependency graph (cloud SDKs, an older client-go) moves neither the product's go.mod nor the
// versions Kubernetes builds with in test/k8stools.
package flanneltools
