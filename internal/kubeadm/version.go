package kubeadm

import "regexp"

// release is the form of the Kubernetes versions kubeadm is baked with and initializes: v1.36.3, or a
// pre-release such as v1.37.0-rc.1, with its "v" as kubeadm names releases and image manifests record them.
var release = regexp.MustCompile(`\Av(0|[1-9][0-9]{0,3})\.(0|[1-9][0-9]{0,3})\.(0|[1-9][0-9]{0,3})(-[0-9A-Za-z.]{1,32})?\z`)

// IsRelease says whether v is a Kubernetes release version in that form. The provider checks
// kubernetes_version with it at plan, and the init server checks the request with it, so that both agree.
func IsRelease(v string) bool { return release.MatchString(v) }
