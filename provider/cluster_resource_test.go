package provider

import (
	"encoding/base64"
	"fmt"
	"regexp"
	"strings"
	"testing"

	"github.com/hashicorp/terraform-plugin-testing/config"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"

	"github.com/berthlabs/berth/internal/swtpm"
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
  type = string
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

// TestClusterResourceRefusals covers what berth_cluster refuses before it reaches a node: plan-time checks
// of every argument, missing secrets, a node that never answers, and import.
func TestClusterResourceRefusals(t *testing.T) {
	ca, err := swtpm.NewCA(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	bundle, err := ca.BundlePEM()
	if err != nil {
		t.Fatal(err)
	}
	vars := config.Variables{
		"root_key": config.StringVariable(base64.StdEncoding.EncodeToString(make([]byte, 32))),
		"ek_ca":    config.StringVariable(string(bundle)),
	}
	good := clusterArgs("127.0.0.1:1", "lab", zeroPCR11)
	planOnly := func(args, want string) resource.TestStep {
		return resource.TestStep{Config: clusterConfig(args), ConfigVariables: vars, PlanOnly: true, ExpectError: regexp.MustCompile(want)}
	}
	resource.UnitTest(t, resource.TestCase{
		ProtoV6ProviderFactories: providers,
		Steps: []resource.TestStep{
			planOnly(clusterArgs("127.0.0.1:1", "Lab_1", zeroPCR11), `(?s)Invalid cluster name.*"Lab_1" is not a DNS-1123 label`),
			planOnly(clusterArgs("127.0.0.1", "lab", zeroPCR11), `(?s)Invalid endpoint.*"127.0.0.1" is not host:port`),
			planOnly(clusterArgs("127.0.0.1:1", "lab", `{ "24" = "00" }`), `(?s)Invalid PCR index.*"24"`),
			planOnly(clusterArgs("127.0.0.1:1", "lab", `{ "11" = "ABCD" }`), `(?s)Invalid PCR value.*PCR 11 must be 64 lowercase hex`),
			planOnly(clusterArgs("127.0.0.1:1", "lab", `{}`), `(?s)No measurements.*unmeasured node`),
			planOnly(good+`  init_timeout = "soon"`, `(?s)Invalid timeout.*"soon"`),
			{
				Config:          clusterConfig(good),
				ConfigVariables: config.Variables{"root_key": vars["root_key"], "ek_ca": config.StringVariable("not PEM")},
				PlanOnly:        true,
				ExpectError:     regexp.MustCompile(`Invalid EK CA certificates`),
			},
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
				ExpectError:     regexp.MustCompile(`(?s)berth_cluster cannot be imported.*only once`),
			},
		},
	})
}
