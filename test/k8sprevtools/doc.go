// Module k8sprevtools pins the Kubernetes and etcd versions of the minor release before the lab's
// (test/k8stools), which scripts/build-k8s.sh --module test/k8sprevtools builds from source so that the lab
// can run a cluster of that release and upgrade it. It is a module of its own, as test/k8stools is, so that
// the two releases' dependency graphs never move each other's versions, and neither reaches the product's
// go.mod.
package k8sprevtools
