package provider

import (
	"context"
	"encoding/base64"
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-testing/config"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/berthlabs/berth/internal/clusterinfo"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/test/kubetest"
	"github.com/berthlabs/berth/test/swtpm"
)

// clusterConfig is berth_secrets, its ephemeral twin and a berth_cluster fed from them; cluster holds the
// cluster's other arguments as HCL lines.
func clusterConfig(cluster string) string {
	return `
variable "root_key" {
  type      = string
  ephemeral = true
  sensitive = true
}

variable "ek_ca" {
  type    = string
  default = null
}

resource "berth_secrets" "test" {
  root_key_wo         = var.root_key
  root_key_wo_version = 1
}

ephemeral "berth_secrets" "test" {
  root_key                  = var.root_key
  kubernetes_ca_certificate = berth_secrets.test.kubernetes_ca_certificate
  join_ca_certificate       = berth_secrets.test.join_ca_certificate
}

resource "berth_cluster" "test" {
  kubernetes_ca_certificate = berth_secrets.test.kubernetes_ca_certificate
  join_ca_certificate       = berth_secrets.test.join_ca_certificate
  ek_ca_certificates        = var.ek_ca
` + cluster + `
}
`
}

// clusterSecrets are the write-only arguments, from the ephemeral resource.
const clusterSecrets = `
  init_secret_wo       = ephemeral.berth_secrets.test.init_secret
  master_secret_wo     = ephemeral.berth_secrets.test.master_secret
  salt_wo              = ephemeral.berth_secrets.test.salt
  kubernetes_ca_key_wo = ephemeral.berth_secrets.test.kubernetes_ca_key
  join_ca_key_wo       = ephemeral.berth_secrets.test.join_ca_key
`

func clusterArgs(endpoint, name, pcrs string) string {
	return fmt.Sprintf("  endpoint = %q\n  cluster_name = %q\n  kubernetes_version = \"v1.36.3\"\n  pcrs = %s\n", endpoint, name, pcrs)
}

var zeroPCR11 = fmt.Sprintf(`{ "11" = %q }`, strings.Repeat("0", 64))

// clusterVars makes one swtpm CA and returns clusterConfig's variables for a root key: the key, and the
// CA's bundle as the EK CA.
func clusterVars(t *testing.T) func(root []byte) config.Variables {
	t.Helper()
	ca, err := swtpm.NewCA(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	bundle, err := ca.BundlePEM()
	if err != nil {
		t.Fatal(err)
	}
	return func(root []byte) config.Variables {
		return config.Variables{
			"root_key": config.StringVariable(base64.StdEncoding.EncodeToString(root)),
			"ek_ca":    config.StringVariable(string(bundle)),
		}
	}
}

// TestClusterResourceRefusals covers what berth_cluster refuses before it reaches a node: plan-time checks
// of every argument, missing secrets, a node that never answers, and import.
func TestClusterResourceRefusals(t *testing.T) {
	t.Parallel()
	vars := clusterVars(t)(make([]byte, 32))
	good := clusterArgs("127.0.0.1:1", "lab", zeroPCR11)
	planOnly := func(args, want string) resource.TestStep {
		return resource.TestStep{Config: clusterConfig(args), ConfigVariables: vars, PlanOnly: true, ExpectError: regexp.MustCompile(want)}
	}
	resource.UnitTest(t, resource.TestCase{
		ProtoV6ProviderFactories: providers,
		Steps: []resource.TestStep{
			planOnly(clusterArgs("127.0.0.1:1", "Lab_1", zeroPCR11), `(?s)Invalid cluster name.*"Lab_1" is not a DNS-1123 label`),
			planOnly(clusterArgs("127.0.0.1", "lab", zeroPCR11), `(?s)Invalid endpoint.*endpoint is "127.0.0.1", which is not host:port`),
			planOnly(clusterArgs("127.0.0.1:1", "lab", `{ "24" = "00" }`), `(?s)Invalid PCR index.*"24"`),
			planOnly(clusterArgs("127.0.0.1:1", "lab", `{ "11" = "ABCD" }`), `(?s)Invalid PCR value.*PCR 11 must be 64 lowercase hex`),
			planOnly(clusterArgs("127.0.0.1:1", "lab", `{}`), `(?s)No measurements.*unmeasured node`),
			planOnly(good+`  init_timeout = "soon"`, `(?s)Invalid timeout.*"soon"`),
			planOnly(good+`  certificate_validity = "1h"`, `(?s)Invalid certificate validity.*"1h" is not a Go duration from 24h0m0s`),
			{
				Config:          clusterConfig(good),
				ConfigVariables: config.Variables{"root_key": vars["root_key"], "ek_ca": config.StringVariable("not PEM")},
				PlanOnly:        true,
				ExpectError:     regexp.MustCompile(`Invalid EK CA certificates`),
			},
			{
				Config:          clusterConfig(good),
				ConfigVariables: config.Variables{"root_key": vars["root_key"]},
				PlanOnly:        true,
				ExpectError:     regexp.MustCompile(`(?s)No trust for the node's TPM.*Set ek_ca_certificates.*aws.*or gcp`),
			},
			planOnly(good+`  aws = { instance_id = "i-0123456789abcdef0", region = "eu-west-1" }`,
				`(?s)More than one trust for the node's TPM.*ek_ca_certificates and aws are set; set only one of`),
			planOnly(good+`  aws = { instance_id = "i-0123456789abcdef0", region = "eu-west-1" }
  gcp = { project = "berth-lab", zone = "europe-west1-b", instance = "cp-0" }`,
				// Terraform validates first with the variables unknown, var.ek_ca included.
				`(?s)More than one trust for the node's TPM.*aws and gcp are set; set only one of`),
			// Without the secrets nothing is dialed: the error names each missing argument.
			{
				Config:          clusterConfig(good),
				ConfigVariables: vars,
				ExpectError:     regexp.MustCompile(`(?s)Cluster secrets missing.*init_secret_wo, master_secret_wo, salt_wo,.*kubernetes_ca_key_wo, join_ca_key_wo`),
			},
			// Nothing listens on port 1: the init waits for the node until its timeout, then says so.
			{
				Config:          clusterConfig(good + `  init_timeout = "3s"` + clusterSecrets),
				ConfigVariables: vars,
				ExpectError:     regexp.MustCompile(`(?s)Initializing the cluster at 127.0.0.1:1 failed.*No init server answered in time.*connection refused`),
			},
			{
				Config:          clusterConfig(good + clusterSecrets),
				ConfigVariables: vars,
				ResourceName:    "berth_cluster.test",
				ImportState:     true,
				ImportStateId:   "anything",
				ExpectError:     regexp.MustCompile(`(?s)Invalid import ID.*"anything" does not start with the init endpoint`),
			},
		},
	})
}

// TestCheckCluster covers what a refresh of berth_cluster concludes, against a real kube-apiserver: the
// cluster is here, another cluster or none answers (gone), or nothing answers (kept).
func TestCheckCluster(t *testing.T) {
	t.Parallel()
	api := kubetest.Start(t)
	ctx := context.Background()
	const id, other = "0123456789abcdef0123456789abcdef", "fedcba9876543210fedcba9876543210"
	if err := clusterinfo.Publish(ctx, api.Client, clusterinfo.Info{ID: id, Name: "prod"}); err != nil {
		t.Fatal(err)
	}
	model := func(kubeconfig []byte, clusterID string) clusterModel {
		return clusterModel{Kubeconfig: types.StringValue(string(kubeconfig)), ClusterID: types.StringValue(clusterID),
			APIServerEndpoint: types.StringValue(api.URL), Endpoint: types.StringValue("127.0.0.1:1")}
	}
	otherCA, err := pki.NewCA("kubernetes", time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := clientcmd.Load(api.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range cfg.Clusters {
		c.CertificateAuthorityData = otherCA.CertPEM()
	}
	foreignCA, err := clientcmd.Write(*cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range cfg.Clusters {
		c.Server = "https://127.0.0.1:1"
	}
	nowhere, err := clientcmd.Write(*cfg)
	if err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct {
		name    string
		model   clusterModel
		verdict clusterVerdict
		why     string
	}{
		{"same cluster", model(api.Kubeconfig, id), clusterHere, ""},
		{"another cluster ID", model(api.Kubeconfig, other), clusterGone, "belongs to cluster " + id + " now"},
		{"another CA", model(foreignCA, id), clusterGone, "does not accept this cluster's credentials or CA"},
		{"nothing answers", model(nowhere, id), clusterSilent, "Reading the cluster record failed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			verdict, why := checkCluster(ctx, tc.model)
			if verdict != tc.verdict || !strings.Contains(why, tc.why) {
				t.Errorf("checkCluster = %v, %q; want %v, %q", verdict, why, tc.verdict, tc.why)
			}
		})
	}

	if err := api.Client.CoreV1().ConfigMaps(clusterinfo.Namespace).Delete(ctx, clusterinfo.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if verdict, why := checkCluster(ctx, model(api.Kubeconfig, id)); verdict != clusterGone || !strings.Contains(why, "holds no Berth cluster record") {
		t.Errorf("without the record: checkCluster = %v, %q; want gone", verdict, why)
	}
}
