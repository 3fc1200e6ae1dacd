package kubeadm

import (
	"fmt"
	"regexp"

	"k8s.io/apimachinery/pkg/util/version"
)

// release is the form of the Kubernetes versions kubeadm is baked with and initializes: v1.36.3, or a
// pre-release such as v1.37.0-rc.1, with its "v" as kubeadm names releases and image manifests record them.
var release = regexp.MustCompile(`\Av(0|[1-9][0-9]{0,3})\.(0|[1-9][0-9]{0,3})\.(0|[1-9][0-9]{0,3})(-[0-9A-Za-z.]{1,32})?\z`)

// IsRelease says whether v is a Kubernetes release version in that form. The provider checks
// kubernetes_version with it at plan, and the init server checks the request with it, so that both agree.
func IsRelease(v string) bool { return release.MatchString(v) }

// Step is how a cluster's Kubernetes version changes.
type Step int

const (
	StepNone  Step = iota // the same release
	StepPatch             // a later release of the same minor
	StepMinor             // a release of the next minor
)

// UpgradeStep says which step a cluster takes from release from to release to, or, as an error, which
// rule of the version skew policy (kubernetes.io/releases/version-skew-policy) forbids it: kubeadm upgrades a
// control plane one minor at a time and never back, since etcd and the objects the API server stored may
// already be in the newer release's form.
func UpgradeStep(from, to string) (Step, error) {
	f, t, err := parseReleases(from, to)
	if err != nil {
		return 0, err
	}
	switch {
	case f.Major() != t.Major():
		return 0, fmt.Errorf("%s to %s changes the major version: Kubernetes upgrades go one minor at a time within a major version", from, to)
	case t.LessThan(f):
		return 0, fmt.Errorf("%s to %s is a downgrade: Kubernetes does not go back to an earlier release, since etcd and the stored objects may already be in the newer one's form", from, to)
	case t.Minor() > f.Minor()+1:
		return 0, fmt.Errorf("%s to %s skips a minor: kubeadm upgrades one minor at a time, so go to v%d.%d first, then to v%d.%d",
			from, to, f.Major(), f.Minor()+1, t.Major(), t.Minor())
	case t.Minor() == f.Minor()+1:
		return StepMinor, nil
	case t.EqualTo(f):
		return StepNone, nil
	}
	return StepPatch, nil
}

// MinorsAhead is how many minors release a is ahead of release b: negative when it is behind, an error when
// their major versions differ or either is not a release.
func MinorsAhead(a, b string) (int, error) {
	va, vb, err := parseReleases(a, b)
	if err != nil {
		return 0, err
	}
	if va.Major() != vb.Major() {
		return 0, fmt.Errorf("%s and %s are of different major versions", a, b)
	}
	return int(va.Minor()) - int(vb.Minor()), nil
}

// parseReleases parses two releases.
func parseReleases(a, b string) (*version.Version, *version.Version, error) {
	va, err := parseRelease(a)
	if err != nil {
		return nil, nil, err
	}
	vb, err := parseRelease(b)
	if err != nil {
		return nil, nil, err
	}
	return va, vb, nil
}

func parseRelease(v string) (*version.Version, error) {
	if !IsRelease(v) {
		return nil, fmt.Errorf("%q is not a Kubernetes release such as v1.36.3", v)
	}
	parsed, err := version.ParseSemantic(v)
	if err != nil {
		return nil, fmt.Errorf("%q: %w", v, err)
	}
	return parsed, nil
}
