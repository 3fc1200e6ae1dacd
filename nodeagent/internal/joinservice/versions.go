package joinservice

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/durationpb"
	"k8s.io/apimachinery/pkg/util/version"
	"k8s.io/client-go/kubernetes"

	"github.com/berthlabs/berth/internal/clusterinfo"
	"github.com/berthlabs/berth/internal/kubeadm"
	"github.com/berthlabs/berth/internal/metadata"
)

// APIServerVersions tells which Kubernetes releases the cluster's API servers run.
type APIServerVersions interface {
	APIServerVersions(ctx context.Context) ([]string, error)
}

// maxKubeletMinorsBehind is how far a kubelet may trail the API servers under the version skew policy.
const maxKubeletMinorsBehind = 3

// checkVersion holds back or refuses a joining node whose image's Kubernetes release (from the policy image
// its quote matched) the version skew policy does not let join the API servers the cluster runs now. A
// node newer than the oldest API server waits (Unavailable: it retries), since the control plane is on
// its way there during an upgrade; a node too old for the newest one is refused. An image without a
// version, or a cluster whose API servers' versions are not known, is not checked.
func (s *Server) checkVersion(ctx context.Context, ex *exchange) error {
	node := ex.kubernetesVersion
	if node == "" {
		return nil
	}
	servers, err := s.apiServerVersions(ctx)
	if err != nil {
		return s.fail(ex.log, "reading the API servers' versions", err)
	}
	if len(servers) == 0 {
		return nil
	}
	oldest, newest := servers[0], servers[len(servers)-1]
	ahead, err := kubeadm.MinorsAhead(node, oldest)
	if err != nil {
		return s.refuse(ex.log, RefusedVersion, codes.FailedPrecondition, "Kubernetes version refused",
			fmt.Errorf("image %q carries Kubernetes %s and the control plane runs %s: %w", ex.image, node, oldest, err))
	}
	if ahead > 0 && ex.instance.Role == metadata.RoleControlPlane {
		admit, err := s.carriesUpgrade(ctx, node, oldest)
		if err != nil {
			return s.fail(ex.log, "reading the cluster's upgrade", err)
		}
		if admit {
			ex.log.Info("control-plane node of the instructed upgrade's release admitted ahead of the API servers",
				"kubernetes_version", node, "oldest_api_server", oldest)
			return nil
		}
	}
	if ahead > 0 {
		err := s.refuse(ex.log, RefusedHeldBack, codes.Unavailable, "held back",
			fmt.Errorf("image %q carries Kubernetes %s and the control plane runs %s: waiting for the control plane to reach %s, since the version skew policy lets no kubelet be newer than an API server",
				ex.image, node, oldest, minorOf(node)))
		return retryAfter(err, s.cfg.HeldBackRetry)
	}
	behind, err := kubeadm.MinorsAhead(newest, node)
	if err != nil {
		return s.refuse(ex.log, RefusedVersion, codes.FailedPrecondition, "Kubernetes version refused",
			fmt.Errorf("image %q carries Kubernetes %s and the control plane runs %s: %w", ex.image, node, newest, err))
	}
	switch {
	case ex.instance.Role == metadata.RoleControlPlane && behind > 0:
		return s.refuse(ex.log, RefusedVersion, codes.FailedPrecondition, "Kubernetes version refused",
			fmt.Errorf("control-plane image %q carries Kubernetes %s and the control plane runs %s: kubeadm join --control-plane runs the cluster's release, whose images this image does not carry; boot an image of %s",
				ex.image, node, newest, minorOf(newest)))
	case behind > maxKubeletMinorsBehind:
		return s.refuse(ex.log, RefusedVersion, codes.FailedPrecondition, "Kubernetes version refused",
			fmt.Errorf("image %q carries Kubernetes %s and the control plane runs %s: the version skew policy lets a kubelet trail the API server by %d minors at most",
				ex.image, node, newest, maxKubeletMinorsBehind))
	}
	return nil
}

// carriesUpgrade says whether a control-plane node of release node may join ahead of the oldest API server:
// the provider instructed an upgrade to exactly that release, and the step to it from the oldest API server
// is one kubeadm takes. Such a node joins at the cluster's release and then leads or follows the upgrade
// (package kubeupgrade); without it, no API server would ever reach the release its workers wait for.
func (s *Server) carriesUpgrade(ctx context.Context, node, oldest string) (bool, error) {
	if s.cfg.UpgradeTarget == nil {
		return false, nil
	}
	target, err := s.cfg.UpgradeTarget.UpgradeTarget(ctx)
	if err != nil || target != node {
		return false, err
	}
	_, err = kubeadm.UpgradeStep(oldest, target)
	return err == nil, nil
}

// UpgradeTarget tells which Kubernetes release the provider told the cluster to upgrade to; "" for none.
type UpgradeTarget interface {
	UpgradeTarget(ctx context.Context) (string, error)
}

// KubeUpgradeTarget reads the target from the cluster record (clusterinfo.ReadUpgrade). Only a
// control-plane node ahead of the API servers asks, so it is read each time, never cached.
type KubeUpgradeTarget struct {
	Client kubernetes.Interface
}

// UpgradeTarget implements UpgradeTarget.
func (k KubeUpgradeTarget) UpgradeTarget(ctx context.Context) (string, error) {
	u, err := clusterinfo.ReadUpgrade(ctx, k.Client)
	if errors.Is(err, clusterinfo.ErrNotFound) {
		return "", nil
	}
	return u.Target, err
}

// DefaultHeldBackRetry is Config.HeldBackRetry when zero: an upgrade of the control plane takes minutes,
// and each retry costs the service a quote's verification.
const DefaultHeldBackRetry = 30 * time.Second

// retryAfter adds to a refusal's status the delay its node should wait before it asks again
// (google.rpc.RetryInfo, which the join client honours).
func retryAfter(err error, d time.Duration) error {
	var r *refusal
	if !errors.As(err, &r) {
		return err
	}
	if st, derr := r.st.WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(d)}); derr == nil {
		r.st = st
	}
	return err
}

// apiServerVersions are the API servers' releases, oldest first: the configured source's, or else the
// configured KubernetesVersion, the one the service was set up with.
func (s *Server) apiServerVersions(ctx context.Context) ([]string, error) {
	var vs []string
	if s.cfg.APIServers != nil {
		var err error
		if vs, err = s.cfg.APIServers.APIServerVersions(ctx); err != nil {
			return nil, err
		}
	}
	if len(vs) == 0 && s.cfg.KubernetesVersion != "" {
		vs = []string{s.cfg.KubernetesVersion}
	}
	return sortReleases(vs), nil
}

// sortReleases sorts releases oldest first, leaving out what is not a release.
func sortReleases(vs []string) []string {
	type parsed struct {
		s string
		v *version.Version
	}
	var ps []parsed
	for _, s := range vs {
		if !kubeadm.IsRelease(s) {
			continue
		}
		if v, err := version.ParseSemantic(s); err == nil {
			ps = append(ps, parsed{s, v})
		}
	}
	slices.SortFunc(ps, func(a, b parsed) int {
		switch {
		case a.v.LessThan(b.v):
			return -1
		case b.v.LessThan(a.v):
			return 1
		}
		return 0
	})
	out := make([]string, len(ps))
	for i, p := range ps {
		out[i] = p.s
	}
	return out
}

// minorOf is a release's minor, such as v1.36.
func minorOf(release string) string {
	v, err := version.ParseSemantic(release)
	if err != nil {
		return release
	}
	return fmt.Sprintf("v%d.%d", v.Major(), v.Minor())
}

// apiServerVersionsTTL is how long KubeAPIServers answers from what it read: a storm of joins then costs
// the API server one list every few seconds, and a new API server's version counts within seconds.
const apiServerVersionsTTL = 5 * time.Second

// KubeAPIServers reads the API servers' releases from kubeadm's kube-apiserver pods
// (kubeadm.APIServerReleases), answering from memory for apiServerVersionsTTL. When no pod's image names
// its release (images pinned by digest), kubeadm's ClusterConfiguration stands for them: the release the
// control plane was last deployed or upgraded to, which the service's own configuration, written at init,
// no longer is after an upgrade.
type KubeAPIServers struct {
	Client kubernetes.Interface
	Clock  func() time.Time

	mu   sync.Mutex
	read time.Time
	vs   []string
}

// APIServerVersions implements APIServerVersions.
func (k *KubeAPIServers) APIServerVersions(ctx context.Context) ([]string, error) {
	now := time.Now
	if k.Clock != nil {
		now = k.Clock
	}
	// Joins that arrive while one reads wait for its answer rather than ask again.
	k.mu.Lock()
	defer k.mu.Unlock()
	if !k.read.IsZero() && now().Sub(k.read) < apiServerVersionsTTL {
		return k.vs, nil
	}
	byNode, err := kubeadm.APIServerReleases(ctx, k.Client)
	if err != nil {
		return nil, err
	}
	vs := slices.Collect(maps.Values(byNode))
	if len(vs) == 0 {
		release, found, err := kubeadm.ClusterRelease(ctx, k.Client)
		if err != nil {
			return nil, err
		}
		if found {
			vs = []string{release}
		}
	}
	k.vs, k.read = vs, now()
	return k.vs, nil
}
