package provider

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/berthlabs/berth/internal/clusterinfo"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/test/kubetest"
)

const pcr0 = "0000000000000000000000000000000000000000000000000000000000000000"
const pcr9 = "9999999999999999999999999999999999999999999999999999999999999999"

func joinPolicyConfig(kubeconfig string, images ...string) string {
	return fmt.Sprintf(`
provider "berth" {
  kubeconfig = file(%q)
}

resource "berth_join_policy" "this" {
  images = [%s]
}
`, kubeconfig, strings.Join(images, ",\n"))
}

func policyImage(name, roles, expires string) string {
	exp := ""
	if expires != "" {
		exp = fmt.Sprintf("expires = %q", expires)
	}
	return fmt.Sprintf(`{
    name  = %q
    roles = [%s]
    pcrs  = { "0" = %q, "9" = %q }
    %s
  }`, name, roles, pcr0, pcr9, exp)
}

// clusterPolicy reads the policy the join services would read.
func clusterPolicy(t *testing.T, api *kubetest.APIServer) *policy.Policy {
	t.Helper()
	cm, err := api.Client.CoreV1().ConfigMaps("kube-system").Get(context.Background(), "berth-join-policy", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	p, err := policy.Parse([]byte(cm.Data[policy.ConfigMapKey]))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func imageNames(p *policy.Policy) string {
	var names []string
	for _, img := range p.Images {
		names = append(names, img.Name)
	}
	return strings.Join(names, ",")
}

// TestJoinPolicyResource runs berth_join_policy against a real kube-apiserver: create, drift made outside
// Terraform and repaired, an image dropped, import, plan-time refusals, destroy.
func TestJoinPolicyResource(t *testing.T) {
	t.Parallel()
	api := kubetest.Start(t)
	kubeconfig := filepath.Join(t.TempDir(), "admin.conf")
	if err := os.WriteFile(kubeconfig, api.Kubeconfig, 0o600); err != nil {
		t.Fatal(err)
	}
	both := `"control-plane", "worker"`
	imgA := policyImage("berth-2026-11-01", both, "")
	imgB := strings.Replace(policyImage("berth-2026-11-22", `"worker"`, "2027-01-01T00:00:00Z"), "expires", `kubernetes_version = "v1.36.3"
    expires`, 1)
	resource.UnitTest(t, resource.TestCase{
		ProtoV6ProviderFactories: providers,
		CheckDestroy: func(*terraform.State) error {
			_, err := api.Client.CoreV1().ConfigMaps("kube-system").Get(context.Background(), "berth-join-policy", metav1.GetOptions{})
			if !apierrors.IsNotFound(err) {
				return fmt.Errorf("the policy ConfigMap is still there after destroy (%v)", err)
			}
			return nil
		},
		Steps: []resource.TestStep{
			// Refused at plan time, before anything is written.
			{
				Config:      joinPolicyConfig(kubeconfig, strings.Replace(imgB, `"9" =`, `"24" =`, 1)),
				PlanOnly:    true,
				ExpectError: regexp.MustCompile(`(?s)Invalid PCR index.*` + phrase(`PCR index "24" is not a plain decimal number 0-23`).String()),
			},
			{
				Config:      joinPolicyConfig(kubeconfig, strings.Replace(imgB, pcr9, strings.ToUpper("aa"+pcr9[2:]), 1)),
				PlanOnly:    true,
				ExpectError: regexp.MustCompile(`64 lowercase hex digits`),
			},
			{
				Config:      joinPolicyConfig(kubeconfig, policyImage("berth-x", `"worker"`, "2027-01-01T01:00:00+01:00")),
				PlanOnly:    true,
				ExpectError: regexp.MustCompile(`RFC 3339 time in UTC`),
			},
			{
				Config:      joinPolicyConfig(kubeconfig, policyImage("berth-x", `"admin"`, "")),
				PlanOnly:    true,
				ExpectError: regexp.MustCompile(`(?s)Invalid role.*role "admin" is not "control-plane" or "worker"`),
			},
			{
				Config: joinPolicyConfig(kubeconfig, imgA, imgB),
				Check: resource.ComposeAggregateTestCheckFunc(
					resource.TestCheckResourceAttr("berth_join_policy.this", "id", "kube-system/berth-join-policy"),
					resource.TestCheckResourceAttr("berth_join_policy.this", "images.#", "2"),
					func(*terraform.State) error {
						p := clusterPolicy(t, api)
						if imageNames(p) != "berth-2026-11-01,berth-2026-11-22" || p.Images[1].Expires == nil || len(p.Images[0].PCRs[9]) != 32 ||
							p.Images[0].KubernetesVersion != "" || p.Images[1].KubernetesVersion != "v1.36.3" {
							return fmt.Errorf("policy in the cluster: %+v", p)
						}
						return nil
					},
				),
			},
			{
				// Someone edits the ConfigMap by hand: the next plan shows it and apply puts the policy back.
				PreConfig: func() {
					cms := api.Client.CoreV1().ConfigMaps("kube-system")
					cm, err := cms.Get(context.Background(), "berth-join-policy", metav1.GetOptions{})
					if err != nil {
						t.Fatal(err)
					}
					p := clusterPolicy(t, api)
					p.Images = p.Images[:1]
					data, err := p.Marshal()
					if err != nil {
						t.Fatal(err)
					}
					cm.Data[policy.ConfigMapKey] = string(data)
					if _, err := cms.Update(context.Background(), cm, metav1.UpdateOptions{}); err != nil {
						t.Fatal(err)
					}
				},
				Config: joinPolicyConfig(kubeconfig, imgA, imgB),
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{
					plancheck.ExpectResourceAction("berth_join_policy.this", plancheck.ResourceActionUpdate),
				}},
				Check: func(*terraform.State) error {
					if got := imageNames(clusterPolicy(t, api)); got != "berth-2026-11-01,berth-2026-11-22" {
						return fmt.Errorf("drift not repaired: %s", got)
					}
					return nil
				},
			},
			{
				// The policy drops an image: from now on nodes of it are refused.
				Config: joinPolicyConfig(kubeconfig, imgB),
				Check: func(*terraform.State) error {
					if got := imageNames(clusterPolicy(t, api)); got != "berth-2026-11-22" {
						return fmt.Errorf("policy after dropping an image: %s", got)
					}
					return nil
				},
			},
			{
				ResourceName:      "berth_join_policy.this",
				ImportState:       true,
				ImportStateId:     "berth-join-policy",
				ImportStateVerify: true,
				Config:            joinPolicyConfig(kubeconfig, imgB),
			},
		},
	})
}

func TestJoinPolicyNeedsKubeconfig(t *testing.T) {
	t.Parallel()
	resource.UnitTest(t, resource.TestCase{
		ProtoV6ProviderFactories: providers,
		Steps: []resource.TestStep{{
			Config:      `resource "berth_join_policy" "this" { images = [] }`,
			ExpectError: regexp.MustCompile(`(?s)No cluster to write the join policy into.*the provider has none`),
		}},
	})
}

// TestJoinPolicyClusterID checks that a policy bound to a cluster ID is written only into that cluster,
// and that the ID of a cluster's record is read back.
func TestJoinPolicyClusterID(t *testing.T) {
	t.Parallel()
	api := kubetest.Start(t)
	kubeconfig := filepath.Join(t.TempDir(), "admin.conf")
	if err := os.WriteFile(kubeconfig, api.Kubeconfig, 0o600); err != nil {
		t.Fatal(err)
	}
	const id = "0123456789abcdef0123456789abcdef"
	img := policyImage("berth-2026-11-22", `"worker"`, "")
	bound := strings.Replace(joinPolicyConfig(kubeconfig, img), "images = [", fmt.Sprintf("cluster_id = %q\n  images = [", id), 1)
	resource.UnitTest(t, resource.TestCase{
		ProtoV6ProviderFactories: providers,
		Steps: []resource.TestStep{
			{
				Config:      bound,
				ExpectError: regexp.MustCompile(`(?s)The kubeconfig reaches another cluster.*belongs in cluster ` + id + `, but the\s+provider's kubeconfig reaches a cluster without a Berth record`),
			},
			{
				PreConfig: func() {
					if err := clusterinfo.Publish(context.Background(), api.Client, clusterinfo.Info{ID: id, Name: "prod"}); err != nil {
						t.Fatal(err)
					}
				},
				Config: bound,
				Check:  resource.TestCheckResourceAttr("berth_join_policy.this", "cluster_id", id),
			},
			// Not set in the configuration: read from the record, and no change planned.
			{
				Config: joinPolicyConfig(kubeconfig, img),
				Check:  resource.TestCheckResourceAttr("berth_join_policy.this", "cluster_id", id),
			},
		},
	})
}
