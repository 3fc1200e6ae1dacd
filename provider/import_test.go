package provider

import (
	"context"
	"fmt"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/berthlabs/berth/internal/clusterinfo"
	"github.com/berthlabs/berth/internal/clustersecrets"
	"github.com/berthlabs/berth/internal/keys"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/test/kubetest"
)

// putPolicy writes the join policy's ConfigMap as berth_join_policy does.
func putPolicy(t *testing.T, api *kubetest.APIServer, images ...policy.Image) {
	t.Helper()
	data, err := (&policy.Policy{Images: images}).Marshal()
	if err != nil {
		t.Fatal(err)
	}
	cms := api.Client.CoreV1().ConfigMaps(metav1.NamespaceSystem)
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: policy.DefaultConfigMap}, Data: map[string]string{policy.ConfigMapKey: string(data)}}
	_, err = cms.Update(context.Background(), cm, metav1.UpdateOptions{})
	if apierrors.IsNotFound(err) {
		_, err = cms.Create(context.Background(), cm, metav1.CreateOptions{})
	}
	if err != nil {
		t.Fatal(err)
	}
}

// testPolicyImage is a policy image of a Kubernetes release for roles.
func testPolicyImage(name, release string, roles ...metadata.Role) policy.Image {
	return policy.Image{Name: name, Roles: roles, PCRs: map[int][]byte{11: make([]byte, 32)}, KubernetesVersion: release}
}

// importConfig is clusterConfig with the provider's root key, which only imports read.
func importConfig(cluster string) string {
	return `
provider "berth" {
  root_key = var.root_key
}
` + clusterConfig(cluster)
}

// TestImportAfterLostState imports berth_secrets and berth_cluster with the real terraform from a real
// kube-apiserver whose CA the root key made, as after a lost state: the imported values are the running
// cluster's (its CA certificates, not new ones; the same init secret hash, so the first control-plane node's
// user-data does not change), the first apply only writes pcrs and the TPM's trust into state (no node
// answers at the endpoint), and the plan after it is empty. A wrong root key, none, and a cluster whose record
// predates the init settings are refused, each saying why. With the state of the import, a plan to the next
// minor reads the cluster's join policy.
func TestImportAfterLostState(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	root := testRoot(7)
	c := startRootCluster(t, root)
	api, secrets, kubeCA, joinCA, id, apiServer := c.api, c.secrets, c.kubeCA, c.joinCA, c.id, c.apiServer
	wantHash, err := secrets.InitSecretHash()
	if err != nil {
		t.Fatal(err)
	}

	vars := clusterVars(t)
	// Nothing listens at the endpoint: the apply after the import must not need the node.
	// The record spells the certificate validity as the node's Go did; the configuration as a user does.
	cfg := importConfig(clusterArgs("127.0.0.1:1", "lab", zeroPCR11) + `  certificate_validity = "2160h"` + "\n" + clusterSecrets)
	upgraded := strings.Replace(cfg, `"v1.36.3"`, `"v1.37.0"`, 1)
	clusterID := "127.0.0.1:1," + apiServer
	step := func(resourceName, importID string, root []byte, want ...string) resource.TestStep {
		return resource.TestStep{Config: cfg, ConfigVariables: vars(root), ResourceName: resourceName, ImportState: true,
			ImportStateId: importID, ExpectError: phrases(want...)}
	}
	imported := func(resourceName, importID string, check resource.ImportStateCheckFunc) resource.TestStep {
		return resource.TestStep{Config: cfg, ConfigVariables: vars(root), ResourceName: resourceName, ImportState: true,
			ImportStateId: importID, ImportStatePersist: true, ImportStateCheck: check}
	}
	resource.UnitTest(t, resource.TestCase{
		ProtoV6ProviderFactories: providers,
		Steps: []resource.TestStep{
			step("berth_secrets.test", apiServer, testRoot(8), "Importing berth_secrets from "+apiServer+" failed", "is not of this root key's cluster"),
			step("berth_cluster.test", clusterID, testRoot(8), "Importing berth_cluster from "+clusterID+" failed", "is not of this root key's cluster"),
			imported("berth_secrets.test", apiServer, func(states []*terraform.InstanceState) error {
				a := stateOf(states, "berth_secrets").Attributes
				for name, want := range map[string]string{
					"cluster_id": id, "kubernetes_ca_certificate": string(kubeCA.CertPEM()),
					"join_ca_certificate": string(joinCA.CertPEM()), "kubernetes_ca_pin": pki.SPKIPin(kubeCA.Cert),
					"join_ca_pin": pki.SPKIPin(joinCA.Cert), "init_secret_hash": wantHash, "ca_validity_days": fmt.Sprint(defaultCAValidityDays),
					"root_key_wo_version": "1",
				} {
					if a[name] != want {
						return fmt.Errorf("imported berth_secrets: %s = %q, want %q", name, a[name], want)
					}
				}
				return nil
			}),
			imported("berth_cluster.test", clusterID, func(states []*terraform.InstanceState) error {
				a := stateOf(states, "berth_cluster").Attributes
				for name, want := range map[string]string{
					"cluster_id": id, "endpoint": "127.0.0.1:1", "cluster_name": "lab", "kubernetes_version": "v1.36.3",
					"pod_network": "flannel", "api_server_endpoint": apiServer, "init_timeout": defaultInitTimeout,
					"certificate_validity":      "2160h0m0s",
					"kubernetes_ca_certificate": string(kubeCA.CertPEM()), "join_ca_certificate": string(joinCA.CertPEM()),
				} {
					if a[name] != want {
						return fmt.Errorf("imported berth_cluster: %s = %q, want %q", name, a[name], want)
					}
				}
				for _, unset := range []string{"control_plane_endpoint", "pod_subnet", "service_subnet", "pcrs.%"} {
					if v, ok := a[unset]; ok && v != "0" {
						return fmt.Errorf("imported berth_cluster: %s = %q, want it unset as at init", unset, v)
					}
				}
				// The minted kubeconfig reaches the cluster as an admin.
				got, err := readClusterInfo(ctx, a["kubeconfig"])
				if err != nil || got.ID != id {
					return fmt.Errorf("reading the record with the imported kubeconfig: %+v, %v", got, err)
				}
				return nil
			}),
			// The apply writes what the configuration adds (pcrs, the TPM's trust) into state and nothing
			// else: no replacement, no init.
			{
				Config:          cfg,
				ConfigVariables: vars(root),
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{
					plancheck.ExpectResourceAction("berth_secrets.test", plancheck.ResourceActionNoop),
					plancheck.ExpectResourceAction("berth_cluster.test", plancheck.ResourceActionUpdate),
				}},
				Check: resource.TestCheckResourceAttr("berth_cluster.test", "cluster_id", id),
			},
			{Config: cfg, ConfigVariables: vars(root), PlanOnly: true},
			// With the state it imported, berth_cluster reaches the cluster: a plan to the next minor reads the
			// join policy and names the role it has no image of the target for.
			{
				PreConfig: func() {
					putPolicy(t, api, testPolicyImage("berth-a", "v1.36.3", metadata.RoleControlPlane, metadata.RoleWorker))
				},
				Config: upgraded, ConfigVariables: vars(root), PlanOnly: true,
				ExpectError: phrases("No image of the new Kubernetes release may join", "allows no image of v1.37.0 for either role:"),
			},
			{
				PreConfig: func() {
					putPolicy(t, api, testPolicyImage("berth-a", "v1.36.3", metadata.RoleControlPlane, metadata.RoleWorker),
						testPolicyImage("berth-b-worker", "v1.37.0", metadata.RoleWorker))
				},
				Config: upgraded, ConfigVariables: vars(root), PlanOnly: true,
				ExpectError: phrases("No image of the new Kubernetes release may join", `kubernetes_version is now "v1.37.0", but the `+
					"cluster's join policy (ConfigMap kube-system/berth-join-policy) allows no image of v1.37.0 for the role control-plane:"),
			},
		},
	})

	// Without the root key, and with a record from before the init settings.
	resource.UnitTest(t, resource.TestCase{
		ProtoV6ProviderFactories: providers,
		Steps: []resource.TestStep{
			{
				Config: clusterConfig(clusterArgs("127.0.0.1:1", "lab", zeroPCR11)), ConfigVariables: vars(root),
				ResourceName: "berth_cluster.test", ImportState: true, ImportStateId: clusterID,
				ExpectError: phrases("Importing berth_cluster needs the root key", "Set root_key in the provider block"),
			},
			{
				PreConfig: func() {
					if err := api.Client.CoreV1().ConfigMaps(clusterinfo.Namespace).Delete(ctx, clusterinfo.Name, metav1.DeleteOptions{}); err != nil {
						t.Error(err)
					}
					if err := clusterinfo.Publish(ctx, api.Client, clusterinfo.Info{ID: id, Name: "lab"}); err != nil {
						t.Error(err)
					}
				},
				Config: cfg, ConfigVariables: vars(root), ResourceName: "berth_secrets.test", ImportState: true, ImportStateId: apiServer,
				ExpectError: phrases("was initialized before its record", "kept the join CA certificate"),
			},
		},
	})
}

// stateOf picks the state of the resource type from what an import step checks: every resource in state,
// in map order, the ones earlier steps imported included.
func stateOf(states []*terraform.InstanceState, typ string) *terraform.InstanceState {
	for _, s := range states {
		if s.Ephemeral.Type == typ {
			return s
		}
	}
	return &terraform.InstanceState{}
}

// phrases matches each phrase (see phrase) in order, with anything between.
func phrases(ps ...string) *regexp.Regexp {
	parts := make([]string, len(ps))
	for i, p := range ps {
		parts[i] = phrase(p).String()
	}
	return regexp.MustCompile(`(?s)` + strings.Join(parts, ".*"))
}

// rootCluster is a real kube-apiserver whose CA the root key made, with what kubeadm init, the root CA
// publisher and the agent leave in every Berth cluster (the admins' binding, kube-root-ca.crt, the cluster
// record of a v1.36.3 init): a cluster the provider can import.
type rootCluster struct {
	api            *kubetest.APIServer
	secrets        *clustersecrets.Secrets
	kubeCA, joinCA *pki.CA
	id, apiServer  string
}

func startRootCluster(t *testing.T, root []byte) rootCluster {
	t.Helper()
	ctx := context.Background()
	secrets, err := clustersecrets.Derive(root)
	if err != nil {
		t.Fatal(err)
	}
	kubeCA, joinCA, err := secrets.NewCAs(time.Now(), defaultCAValidityDays*24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	api := kubetest.StartWith(t, kubetest.Options{CA: kubeCA})
	// What kubeadm init and kube-controller-manager's root CA publisher leave in every Berth cluster.
	api.CreateRBAC(t, []byte(`apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: kubeadm:cluster-admins
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: cluster-admin
subjects:
- apiGroup: rbac.authorization.k8s.io
  kind: Group
  name: kubeadm:cluster-admins
`))
	if _, err := api.Client.CoreV1().ConfigMaps("kube-system").Create(ctx, &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: rootCAConfigMap}, Data: map[string]string{"ca.crt": string(kubeCA.CertPEM())},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	id, err := keys.ClusterIDOf(secrets.MasterSecret, secrets.Salt)
	if err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(api.URL)
	if err != nil {
		t.Fatal(err)
	}
	apiServer := u.Host
	record := clusterinfo.Info{ID: id, Name: "lab", Init: clusterinfo.InitSettings{KubernetesVersion: "v1.36.3",
		PodNetwork: "flannel", APIServerEndpoint: apiServer, JoinCACertificate: string(joinCA.CertPEM()),
		CertificateValidity: "2160h0m0s"}}
	if err := clusterinfo.Publish(ctx, api.Client, record); err != nil {
		t.Fatal(err)
	}
	return rootCluster{api: api, secrets: secrets, kubeCA: kubeCA, joinCA: joinCA, id: id, apiServer: apiServer}
}
