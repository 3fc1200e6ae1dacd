package joinservice

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/test/kubetest"
)

// fixedVersions are API servers at fixed releases.
type fixedVersions struct {
	vs  []string
	err error
}

func (f fixedVersions) APIServerVersions(context.Context) ([]string, error) { return f.vs, f.err }

// fixedTarget is an instructed upgrade's release.
type fixedTarget struct {
	release string
	err     error
}

func (f fixedTarget) UpgradeTarget(context.Context) (string, error) { return f.release, f.err }

// TestCheckVersion: a node newer than the oldest API server waits (Unavailable, so it retries); a
// control-plane node older than the newest, or a worker more than three minors older, is refused; what the
// service cannot tell is not checked.
func TestCheckVersion(t *testing.T) {
	for _, tt := range []struct {
		name    string
		servers APIServerVersions
		target  UpgradeTarget
		config  string // Config.KubernetesVersion
		role    metadata.Role
		node    string
		code    codes.Code // codes.OK: admitted
		reason  string
		msg     string
	}{
		{name: "same release", servers: fixedVersions{vs: []string{"v1.36.3"}}, role: metadata.RoleWorker, node: "v1.36.3"},
		{name: "older patch", servers: fixedVersions{vs: []string{"v1.36.3"}}, role: metadata.RoleControlPlane, node: "v1.36.1"},
		{name: "newer patch", servers: fixedVersions{vs: []string{"v1.36.1"}}, role: metadata.RoleWorker, node: "v1.36.3"},
		{name: "worker three minors older", servers: fixedVersions{vs: []string{"v1.36.3"}}, role: metadata.RoleWorker, node: "v1.33.0"},
		{name: "image without a version", servers: fixedVersions{vs: []string{"v1.36.3"}}, role: metadata.RoleWorker, node: ""},
		{name: "no API server known", servers: fixedVersions{}, role: metadata.RoleWorker, node: "v1.40.0"},
		{name: "tags that are not releases", servers: fixedVersions{vs: []string{"latest", "v1.36"}}, role: metadata.RoleWorker, node: "v1.40.0"},
		{
			name: "newer than the only API server", servers: fixedVersions{vs: []string{"v1.36.3"}}, role: metadata.RoleWorker, node: "v1.37.0",
			code: codes.Unavailable, reason: RefusedHeldBack,
			msg: `held back: image "img" carries Kubernetes v1.37.0 and the control plane runs v1.36.3: waiting for the control plane to reach v1.37`,
		},
		{
			name: "newer than the oldest of two", servers: fixedVersions{vs: []string{"v1.37.0", "v1.36.3"}}, role: metadata.RoleWorker, node: "v1.37.0",
			code: codes.Unavailable, reason: RefusedHeldBack, msg: "the control plane runs v1.36.3",
		},
		{
			name: "configured version stands in", servers: fixedVersions{}, config: "v1.36.3", role: metadata.RoleWorker, node: "v1.37.0",
			code: codes.Unavailable, reason: RefusedHeldBack, msg: "the control plane runs v1.36.3",
		},
		{
			name: "control plane older than the newest", servers: fixedVersions{vs: []string{"v1.36.3", "v1.35.4"}}, role: metadata.RoleControlPlane, node: "v1.35.4",
			code: codes.FailedPrecondition, reason: RefusedVersion,
			msg: `control-plane image "img" carries Kubernetes v1.35.4 and the control plane runs v1.36.3: kubeadm join --control-plane runs the cluster's release, whose images this image does not carry; boot an image of v1.36`,
		},
		{
			name: "worker four minors older", servers: fixedVersions{vs: []string{"v1.36.3"}}, role: metadata.RoleWorker, node: "v1.32.9",
			code: codes.FailedPrecondition, reason: RefusedVersion, msg: "lets a kubelet trail the API server by 3 minors at most",
		},
		{
			name: "another major", servers: fixedVersions{vs: []string{"v1.36.3"}}, role: metadata.RoleWorker, node: "v2.0.0",
			code: codes.FailedPrecondition, reason: RefusedVersion, msg: "are of different major versions",
		},
		// The exception that lets an upgrade start: control-plane nodes of the instructed release.
		{name: "control plane of the instructed release", servers: fixedVersions{vs: []string{"v1.36.3"}}, target: fixedTarget{release: "v1.37.0"},
			role: metadata.RoleControlPlane, node: "v1.37.0"},
		{name: "control plane of a newer patch, never held back", servers: fixedVersions{vs: []string{"v1.36.3", "v1.36.1"}}, target: fixedTarget{release: "v1.36.4"},
			role: metadata.RoleControlPlane, node: "v1.36.4"},
		{
			name: "worker of the instructed release", servers: fixedVersions{vs: []string{"v1.36.3"}}, target: fixedTarget{release: "v1.37.0"},
			role: metadata.RoleWorker, node: "v1.37.0", code: codes.Unavailable, reason: RefusedHeldBack, msg: "waiting for the control plane to reach v1.37",
		},
		{
			name: "control plane of another release than the instructed", servers: fixedVersions{vs: []string{"v1.36.3"}}, target: fixedTarget{release: "v1.37.0"},
			role: metadata.RoleControlPlane, node: "v1.37.1", code: codes.Unavailable, reason: RefusedHeldBack, msg: "waiting for the control plane",
		},
		{
			name: "control plane of an instructed release two minors ahead of the oldest API server", servers: fixedVersions{vs: []string{"v1.37.0", "v1.36.3"}},
			target: fixedTarget{release: "v1.38.0"}, role: metadata.RoleControlPlane, node: "v1.38.0", code: codes.Unavailable, reason: RefusedHeldBack,
			msg: "the control plane runs v1.36.3",
		},
		{
			name: "upgrade unreadable", servers: fixedVersions{vs: []string{"v1.36.3"}}, target: fixedTarget{err: errors.New("API server down")},
			role: metadata.RoleControlPlane, node: "v1.37.0", code: codes.Unavailable, msg: "join service failed reading the cluster's upgrade; retry later",
		},
		{
			name: "versions unreadable", servers: fixedVersions{err: errors.New("API server down")}, role: metadata.RoleWorker, node: "v1.36.3",
			code: codes.Unavailable, msg: "join service failed reading the API servers' versions; retry later",
		},
	} {
		t.Run(tt.name, func(t *testing.T) {
			rec := &recorded{}
			s := &Server{cfg: Config{APIServers: tt.servers, UpgradeTarget: tt.target, KubernetesVersion: tt.config, Metrics: rec, HeldBackRetry: 30 * time.Second}}
			log := slog.New(slog.DiscardHandler)
			ex := &exchange{instance: &metadata.Instance{Name: "n", Role: tt.role}, image: "img", kubernetesVersion: tt.node, log: log}
			err := s.checkVersion(context.Background(), ex)
			if tt.code == codes.OK {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			st := status.Convert(err)
			if st.Code() != tt.code || !strings.Contains(st.Message(), tt.msg) {
				t.Fatalf("status %v %q, want %v with %q", st.Code(), st.Message(), tt.code, tt.msg)
			}
			var retry []time.Duration
			for _, d := range st.Details() {
				if ri, ok := d.(*errdetails.RetryInfo); ok {
					retry = append(retry, ri.GetRetryDelay().AsDuration())
				}
			}
			if wantRetry := tt.reason == RefusedHeldBack; wantRetry != slices.Equal(retry, []time.Duration{30 * time.Second}) {
				t.Errorf("retry delays in the status: %v; want 30s only for a node held back", retry)
			}
			s.observe(CallJoin, time.Now(), &err)
			want := "error join internal"
			if tt.reason != "" {
				want = "refused join " + tt.reason
			}
			if !slices.Equal(*rec, recorded{want}) {
				t.Errorf("counted %q, want %q", *rec, want)
			}
		})
	}
}

// TestKubeAPIServers reads the releases of the API servers from the kube-apiserver pods of a real API
// server, as kubeadm's static pods show there, and leaves out other pods and images that name no release;
// with no pod that names one, it reads kubeadm's ClusterConfiguration.
func TestKubeAPIServers(t *testing.T) {
	api := kubetest.Start(t)
	ctx := context.Background()
	// The API server admits a pod only with its service account, which no controller manager makes here.
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default", Namespace: metav1.NamespaceSystem}}
	if _, err := api.Client.CoreV1().ServiceAccounts(metav1.NamespaceSystem).Create(ctx, sa, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	apiServer := map[string]string{"component": "kube-apiserver", "tier": "control-plane"}
	for _, p := range []struct {
		name   string
		labels map[string]string
		image  string
	}{
		{"kube-apiserver-cp-0", apiServer, "registry.k8s.io/kube-apiserver:v1.36.3"},
		{"kube-apiserver-cp-1", apiServer, "localhost:5000/mirror/kube-apiserver:v1.37.0-rc.1"},
		{"kube-apiserver-cp-2", apiServer, "registry.k8s.io/kube-apiserver@sha256:" + strings.Repeat("0", 64)},
		{"kube-controller-manager-cp-0", map[string]string{"component": "kube-controller-manager", "tier": "control-plane"}, "registry.k8s.io/kube-controller-manager:v1.30.0"},
	} {
		pod := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: p.name, Namespace: metav1.NamespaceSystem, Labels: p.labels},
			Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: p.labels["component"], Image: p.image}}},
		}
		if _, err := api.Client.CoreV1().Pods(metav1.NamespaceSystem).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	now := time.Now()
	k := &KubeAPIServers{Client: api.Client, Clock: func() time.Time { return now }}
	got, err := k.APIServerVersions(ctx)
	if want := []string{"v1.36.3", "v1.37.0-rc.1"}; err != nil || !slices.Equal(sortReleases(got), want) {
		t.Fatalf("APIServerVersions = %q, %v; want %q", got, err, want)
	}

	if err := api.Client.CoreV1().Pods(metav1.NamespaceSystem).Delete(ctx, "kube-apiserver-cp-1", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if got, _ := k.APIServerVersions(ctx); len(got) != 2 {
		t.Errorf("within %v of the first read: %q, want the same answer, from memory", apiServerVersionsTTL, got)
	}
	now = now.Add(apiServerVersionsTTL)
	if got, err := k.APIServerVersions(ctx); err != nil || !slices.Equal(got, []string{"v1.36.3"}) {
		t.Errorf("after %v: %q, %v; want the API server that is left", apiServerVersionsTTL, got, err)
	}

	// Only the API server pinned by digest is left.
	if err := api.Client.CoreV1().Pods(metav1.NamespaceSystem).Delete(ctx, "kube-apiserver-cp-0", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	now = now.Add(apiServerVersionsTTL)
	if got, err := k.APIServerVersions(ctx); err != nil || len(got) != 0 {
		t.Errorf("without kubeadm's configuration: %q, %v; want none", got, err)
	}
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "kubeadm-config", Namespace: metav1.NamespaceSystem},
		Data: map[string]string{"ClusterConfiguration": "apiVersion: kubeadm.k8s.io/v1beta4\nkind: ClusterConfiguration\nkubernetesVersion: v1.37.0\n"}}
	if _, err := api.Client.CoreV1().ConfigMaps(metav1.NamespaceSystem).Create(ctx, cm, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	now = now.Add(apiServerVersionsTTL)
	if got, err := k.APIServerVersions(ctx); err != nil || !slices.Equal(got, []string{"v1.37.0"}) {
		t.Errorf("with kubeadm's configuration only: %q, %v; want its release", got, err)
	}
}
