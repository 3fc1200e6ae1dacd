package provider

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/berthlabs/berth/internal/clusterinfo"
	"github.com/berthlabs/berth/internal/metadata"
)

func TestRefuseKubernetesVersionChange(t *testing.T) {
	state := clusterModel{ClusterID: types.StringValue("c1"), KubernetesVersion: types.StringValue("v1.36.3"),
		APIServerEndpoint: types.StringValue("10.0.0.1:6443")}
	unreadable := errors.New("reading the join policy: connection refused")
	for _, tc := range []struct {
		name, to string
		roles    []metadata.Role
		err      error
		atApply  bool
		// want is the one diagnostic's severity, summary and a part of its detail; none if summary is empty.
		severity         diag.Severity
		summary, inState string
	}{
		{name: "the next minor", to: "v1.37.0"},
		{name: "a patch, at apply", to: "v1.36.4", atApply: true},
		{name: "a skipped minor", to: "v1.38.0", severity: diag.SeverityError, summary: "Kubernetes version change not allowed",
			inState: "skips a minor"},
		{name: "a downgrade", to: "v1.36.2", severity: diag.SeverityError, summary: "Kubernetes version change not allowed",
			inState: "is a downgrade"},
		{name: "no control-plane image", to: "v1.37.0", roles: []metadata.Role{metadata.RoleControlPlane},
			severity: diag.SeverityError, summary: "No image of the new Kubernetes release may join", inState: "for the role control-plane"},
		{name: "no image", to: "v1.37.0", roles: []metadata.Role{metadata.RoleControlPlane, metadata.RoleWorker},
			severity: diag.SeverityError, summary: "No image of the new Kubernetes release may join", inState: "for either role"},
		{name: "no policy of the default name", to: "v1.37.0", err: errNoPolicy, atApply: true, severity: diag.SeverityWarning,
			summary: "Cannot check the join policy", inState: "no ConfigMap kube-system/berth-join-policy, where berth_join_policy keeps the policy unless its name is set"},
		{name: "an unreadable policy at plan", to: "v1.37.0", err: unreadable, severity: diag.SeverityWarning,
			summary: "Cannot check the join policy", inState: "The apply checks it again"},
		{name: "an unreadable policy at apply", to: "v1.37.0", err: unreadable, atApply: true, severity: diag.SeverityError,
			summary: "Cannot check the join policy", inState: "Nothing was changed; apply again once the API server at 10.0.0.1:6443 answers."},
	} {
		t.Run(tc.name, func(t *testing.T) {
			plan := state
			plan.KubernetesVersion = types.StringValue(tc.to)
			var diags diag.Diagnostics
			refuseInitChanges(&state, &plan, &diags, func(release string) ([]metadata.Role, error) {
				if release != tc.to {
					t.Errorf("images of %s looked for, want %s", release, tc.to)
				}
				return tc.roles, tc.err
			}, tc.atApply)
			if tc.summary == "" {
				if len(diags) > 0 {
					t.Errorf("diagnostics %v, want none", diags)
				}
				return
			}
			if len(diags) != 1 || diags[0].Severity() != tc.severity || diags[0].Summary() != tc.summary ||
				!strings.Contains(diags[0].Detail(), tc.inState) {
				t.Errorf("diagnostics %v, want one %v %q saying %q", diags, tc.severity, tc.summary, tc.inState)
			}
		})
	}
}

func TestUpgradeLook(t *testing.T) {
	const target = "v1.37.0"
	since := time.Date(2026, 11, 29, 11, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		name    string
		look    upgradeLook
		reached bool
		want    string
	}{
		{"nobody took it up",
			upgradeLook{record: clusterinfo.Upgrade{Target: target, Phase: clusterinfo.PhaseInstructed, Time: since},
				release: "v1.36.3", apiServers: map[string]string{"cp-1": "v1.36.3", "cp-0": "v1.36.3"}}, false,
			"no control-plane node of v1.37.0 has taken the upgrade up yet; kubeadm's configuration: v1.36.3; " +
				"API servers at v1.37.0: 0 of 2 (not yet: cp-0 (v1.36.3), cp-1 (v1.36.3))"},
		{"a step failed and is retried",
			upgradeLook{record: clusterinfo.Upgrade{Target: target, Phase: clusterinfo.PhaseApplying, Node: "cp-3", Time: since,
				Message: "kubeadm upgrade apply failed; trying again in 2m0s"},
				release: "v1.36.3", apiServers: map[string]string{"cp-3": "v1.36.3"}}, false,
			"phase applying (node cp-3, since 2026-11-29T11:00:00Z): kubeadm upgrade apply failed; trying again in 2m0s; " +
				"kubeadm's configuration: v1.36.3; API servers at v1.37.0: 0 of 1 (not yet: cp-3 (v1.36.3))"},
		{"applied, an old node remains",
			upgradeLook{record: clusterinfo.Upgrade{Target: target, Phase: clusterinfo.PhaseApplied, Node: "cp-3", Time: since},
				release: target, apiServers: map[string]string{"cp-3": target, "cp-0": "v1.36.3"}}, false,
			"phase applied (node cp-3, since 2026-11-29T11:00:00Z); kubeadm's configuration: v1.37.0; " +
				"API servers at v1.37.0: 1 of 2 (not yet: cp-0 (v1.36.3))"},
		{"every API server, but not kubeadm's configuration",
			upgradeLook{record: clusterinfo.Upgrade{Target: target, Phase: clusterinfo.PhaseApplying, Node: "cp-3"},
				release: "v1.36.3", apiServers: map[string]string{"cp-3": target}}, false,
			"phase applying (node cp-3); kubeadm's configuration: v1.36.3; API servers at v1.37.0: 1 of 1"},
		{"no API server seen",
			upgradeLook{record: clusterinfo.Upgrade{Target: target, Phase: clusterinfo.PhaseApplied}, release: target}, false,
			"phase applied; kubeadm's configuration: v1.37.0; API servers at v1.37.0: 0 of 0"},
		{"another target written since",
			upgradeLook{record: clusterinfo.Upgrade{Target: "v1.37.1", Phase: clusterinfo.PhaseInstructed, Message: "x"},
				apiServers: map[string]string{"cp-3": target}}, false,
			`the cluster record names target "v1.37.1"; kubeadm's configuration: unknown; API servers at v1.37.0: 1 of 1`},
		{"reached",
			upgradeLook{record: clusterinfo.Upgrade{Target: target, Phase: clusterinfo.PhaseDone, Node: "cp-4", Time: since},
				release: target, apiServers: map[string]string{"cp-3": target, "cp-4": target}}, true,
			"phase done (node cp-4, since 2026-11-29T11:00:00Z); kubeadm's configuration: v1.37.0; API servers at v1.37.0: 2 of 2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.look.reached(target); got != tc.reached {
				t.Errorf("reached = %v, want %v", got, tc.reached)
			}
			if got := tc.look.describe(target); got != tc.want {
				t.Errorf("describe:\n got %s\nwant %s", got, tc.want)
			}
		})
	}
}

// controlPlane makes the cluster's control plane look as kubeadm leaves it: kubeadm-config at a release and
// each node's kube-apiserver mirror pod.
type controlPlane struct{ kube kubernetes.Interface }

func (c controlPlane) setRelease(release string) error {
	cms := c.kube.CoreV1().ConfigMaps(metav1.NamespaceSystem)
	data := map[string]string{"ClusterConfiguration": "apiVersion: kubeadm.k8s.io/v1beta4\nkind: ClusterConfiguration\nkubernetesVersion: " + release + "\n"}
	cm, err := cms.Get(context.Background(), "kubeadm-config", metav1.GetOptions{})
	if err != nil {
		_, err = cms.Create(context.Background(), &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "kubeadm-config"}, Data: data}, metav1.CreateOptions{})
		return err
	}
	cm.Data = data
	_, err = cms.Update(context.Background(), cm, metav1.UpdateOptions{})
	return err
}

func (c controlPlane) addAPIServer(node, release string) error {
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "kube-apiserver-" + node, Labels: map[string]string{"component": "kube-apiserver", "tier": "control-plane"}},
		Spec:       corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "kube-apiserver", Image: "registry.k8s.io/kube-apiserver:" + release}}},
	}
	_, err := c.kube.CoreV1().Pods(metav1.NamespaceSystem).Create(context.Background(), pod, metav1.CreateOptions{})
	return err
}

func (c controlPlane) removeAPIServer(node string) error {
	zero := int64(0)
	return c.kube.CoreV1().Pods(metav1.NamespaceSystem).Delete(context.Background(), "kube-apiserver-"+node,
		metav1.DeleteOptions{GracePeriodSeconds: &zero})
}

// lead does what a control-plane node of target does once the provider instructs the upgrade: it waits for
// the instruction, upgrades the control plane on cp-1 (a new node) and takes cp-0's (an old node's) place,
// recording each phase.
func (c controlPlane) lead(target string) error {
	ctx := context.Background()
	var u clusterinfo.Upgrade
	for deadline := time.Now().Add(time.Minute); u.Target != target; time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			return fmt.Errorf("no upgrade to %s instructed in a minute", target)
		}
		var err error
		if u, err = clusterinfo.ReadUpgrade(ctx, c.kube); err != nil {
			return err
		}
	}
	u, err := u.Record(ctx, c.kube, clusterinfo.PhaseApplying, "cp-1", "", time.Now())
	if err != nil {
		return err
	}
	// The provider's wait must see the step between: a new API server while kubeadm-config is behind.
	time.Sleep(2 * time.Second)
	if err := c.addAPIServer("cp-1", target); err != nil {
		return err
	}
	time.Sleep(2 * time.Second)
	if err := c.setRelease(target); err != nil {
		return err
	}
	if _, err := u.Record(ctx, c.kube, clusterinfo.PhaseApplied, "cp-1", "", time.Now()); err != nil {
		return err
	}
	time.Sleep(2 * time.Second)
	return c.removeAPIServer("cp-0")
}

// TestClusterUpgrade upgrades an imported cluster with the real terraform against a real kube-apiserver, a
// goroutine doing what the control-plane agents do: an apply that no node answers writes the target, waits
// for upgrade_timeout and fails saying where the upgrade stands, keeping the old release in state; the next
// apply, with a node leading, waits until kubeadm's configuration and every API server run the target, and
// only then writes it into state. An import after it takes the release the cluster runs.
func TestClusterUpgrade(t *testing.T) {
	t.Parallel()
	root := testRoot(9)
	c := startRootCluster(t, root)
	kube := c.api.Client
	cp := controlPlane{kube: kube}
	// The API server admits a pod only with its service account, which no controller manager makes here.
	if _, err := kube.CoreV1().ServiceAccounts(metav1.NamespaceSystem).Create(context.Background(),
		&corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := cp.setRelease("v1.36.3"); err != nil {
		t.Fatal(err)
	}
	if err := cp.addAPIServer("cp-0", "v1.36.3"); err != nil {
		t.Fatal(err)
	}
	vars := clusterVars(t)(root)
	cfg := importConfig(clusterArgs("127.0.0.1:1", "lab", zeroPCR11) + `  certificate_validity = "2160h"` + "\n" + clusterSecrets)
	upgraded := strings.Replace(cfg, `"v1.36.3"`, `"v1.37.0"`, 1)
	imported := func(resourceName, id string) resource.TestStep {
		return resource.TestStep{Config: cfg, ConfigVariables: vars, ResourceName: resourceName, ImportState: true,
			ImportStateId: id, ImportStatePersist: true}
	}
	record := func(want clusterinfo.Phase) resource.TestCheckFunc {
		return func(*terraform.State) error {
			u, err := clusterinfo.ReadUpgrade(context.Background(), kube)
			if err != nil || u.Target != "v1.37.0" || u.Phase != want {
				return fmt.Errorf("upgrade record %+v, %v; want target v1.37.0 in phase %s", u, err, want)
			}
			return nil
		}
	}
	led := make(chan error, 1)
	resource.UnitTest(t, resource.TestCase{
		ProtoV6ProviderFactories: providers,
		Steps: []resource.TestStep{
			imported("berth_secrets.test", c.apiServer),
			imported("berth_cluster.test", "127.0.0.1:1,"+c.apiServer),
			{
				PreConfig: func() {
					putPolicy(t, c.api, testPolicyImage("berth-a", "v1.36.3", metadata.RoleControlPlane, metadata.RoleWorker),
						testPolicyImage("berth-b", "v1.37.0", metadata.RoleControlPlane, metadata.RoleWorker))
				},
				Config: strings.Replace(upgraded, "  pcrs =", "  upgrade_timeout = \"3s\"\n  pcrs =", 1), ConfigVariables: vars,
				ExpectError: phrases("Kubernetes upgrade to v1.37.0 not finished", "was told to run v1.37.0",
					"after upgrade_timeout (3s): no control-plane node of v1.37.0 has taken the upgrade up yet; kubeadm's "+
						"configuration: v1.36.3; API servers at v1.37.0: 0 of 1 (not yet: cp-0 (v1.36.3))",
					`State keeps kubernetes_version = "v1.36.3" until the control plane runs v1.37.0.`),
			},
			{
				PreConfig: func() { go func() { led <- cp.lead("v1.37.0") }() },
				Config:    upgraded, ConfigVariables: vars,
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{
					plancheck.ExpectResourceAction("berth_cluster.test", plancheck.ResourceActionUpdate)}},
				Check: resource.ComposeTestCheckFunc(
					resource.TestCheckResourceAttr("berth_cluster.test", "kubernetes_version", "v1.37.0"),
					record(clusterinfo.PhaseApplied),
					func(*terraform.State) error { return <-led },
				),
			},
			{Config: upgraded, ConfigVariables: vars, PlanOnly: true},
			// Imported again, the cluster has the release it runs, not its init's (the record still says v1.36.3).
			{Config: upgraded, ConfigVariables: vars, ResourceName: "berth_cluster.test", ImportState: true,
				ImportStateId: "127.0.0.1:1," + c.apiServer, ImportStateCheck: func(states []*terraform.InstanceState) error {
					if v := stateOf(states, "berth_cluster").Attributes["kubernetes_version"]; v != "v1.37.0" {
						return fmt.Errorf("imported kubernetes_version %q, want v1.37.0", v)
					}
					return nil
				}},
		},
	})
}
