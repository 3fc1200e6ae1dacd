// Module k8stools pins the Kubernetes and etcd versions that the real-cluster lab builds from source
// (scripts/build-k8s.sh). It is a module of its own so that the Kubernetes dependency graph, and the
// replace block k8s.io/kubernetes needs for its staging modules, never reach the product's go.mod.
package k8stools
