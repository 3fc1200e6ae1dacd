package provider

import (
	"encoding/json"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/hashicorp/terraform-plugin-testing/config"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"sigs.k8s.io/yaml"

	"github.com/berthlabs/berth/internal/cloudinit"
	"github.com/berthlabs/berth/internal/initsecret"
	"github.com/berthlabs/berth/internal/metadata"
)

const testPin = "sha256:0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f"

const nodeConfig = `
variable "endpoints" {
  type = list(string)
}

variable "hash" {
  type = string
}

data "berth_node_config" "first" {
  cluster_name     = "prod"
  join_ca_pin      = "` + testPin + `"
  join_endpoints   = var.endpoints
  init_secret_hash = var.hash
}

data "berth_node_config" "worker" {
  cluster_name = "prod"
  join_ca_pin  = data.berth_node_config.first.join_ca_pin
  join_port    = 8443
}
`

// checkCloudInit checks that cloud_init is a #cloud-config that writes exactly json to the agent's path and
// sets the hostname only when wantHostname is not empty, and that size_bytes is its size.
func checkCloudInit(addr string, want metadata.UserData, wantHostname string) resource.TestCheckFunc {
	return func(s *terraform.State) error {
		a := s.RootModule().Resources[addr].Primary.Attributes
		var got metadata.UserData
		if err := json.Unmarshal([]byte(a["json"]), &got); err != nil {
			return fmt.Errorf("%s.json: %w", addr, err)
		}
		wantJSON, _ := json.Marshal(want)
		if a["json"] != string(wantJSON) {
			return fmt.Errorf("%s.json = %s, want %s", addr, a["json"], wantJSON)
		}
		doc := a["cloud_init"]
		if !strings.HasPrefix(doc, "#cloud-config\n") {
			return fmt.Errorf("%s.cloud_init does not start with #cloud-config", addr)
		}
		var cc cloudinit.Config
		if err := yaml.UnmarshalStrict([]byte(doc), &cc); err != nil {
			return fmt.Errorf("%s.cloud_init is not YAML: %w", addr, err)
		}
		if len(cc.WriteFiles) != 1 || cc.WriteFiles[0] != (cloudinit.WriteFile{Path: "/etc/berth/user-data.json",
			Content: a["json"], Owner: "root:root", Permissions: "0644"}) {
			return fmt.Errorf("%s.cloud_init writes %+v", addr, cc.WriteFiles)
		}
		if err := checkHostname(cc, wantHostname); err != nil {
			return fmt.Errorf("%s.cloud_init: %w", addr, err)
		}
		if a["size_bytes"] != strconv.Itoa(len(doc)) || len(doc) > cloudinit.MaxSize {
			return fmt.Errorf("%s.size_bytes = %s for %d bytes", addr, a["size_bytes"], len(doc))
		}
		return nil
	}
}

func TestNodeConfigDataSource(t *testing.T) {
	t.Parallel()
	hash, err := initsecret.Hash([]byte("test-init-secret"))
	if err != nil {
		t.Fatal(err)
	}
	manyEndpoints := make([]config.Variable, 600)
	for i := range manyEndpoints {
		manyEndpoints[i] = config.StringVariable(fmt.Sprintf("join-%03d.berth.example.internal:7450", i))
	}
	resource.UnitTest(t, resource.TestCase{
		ProtoV6ProviderFactories: providers,
		Steps: []resource.TestStep{
			{
				Config: nodeConfig,
				ConfigVariables: config.Variables{
					"endpoints": config.ListVariable(config.StringVariable("join.berth.example.internal:7450")),
					"hash":      config.StringVariable(hash),
				},
				Check: resource.ComposeTestCheckFunc(
					resource.TestCheckResourceAttr("data.berth_node_config.first", "join_port", "7450"),
					resource.TestCheckResourceAttr("data.berth_node_config.first", "bare_metal", "false"),
					resource.TestCheckNoResourceAttr("data.berth_node_config.first", "hostname"),
					checkCloudInit("data.berth_node_config.first", metadata.UserData{
						ClusterName: "prod", JoinEndpoints: []string{"join.berth.example.internal:7450"},
						JoinPort: 7450, JoinCAPin: testPin, InitSecretHash: hash,
					}, ""),
					checkCloudInit("data.berth_node_config.worker", metadata.UserData{
						ClusterName: "prod", JoinPort: 8443, JoinCAPin: testPin,
					}, ""),
				),
			},
			{
				Config: nodeConfig,
				ConfigVariables: config.Variables{
					"endpoints": config.ListVariable(manyEndpoints...),
					"hash":      config.StringVariable(hash),
				},
				ExpectError: phrase("more than the 16384 bytes (16 KiB) AWS EC2 accepts"),
			},
			{
				Config: nodeConfig,
				ConfigVariables: config.Variables{
					"endpoints": config.ListVariable(config.StringVariable("no-port")),
					"hash":      config.StringVariable(hash),
				},
				ExpectError: phrase(`join endpoint "no-port" is not host:port`),
			},
		},
	})
}

// checkHostname checks that cc sets the hostname to want the way cloud-init does it on every distribution,
// or does not touch the hostname when want is empty.
func checkHostname(cc cloudinit.Config, want string) error {
	preserve := "unset"
	if cc.PreserveHostname != nil {
		preserve = strconv.FormatBool(*cc.PreserveHostname)
	}
	if want == "" {
		if cc.Hostname != "" || cc.FQDN != "" || cc.PreserveHostname != nil {
			return fmt.Errorf("sets hostname %q, fqdn %q, preserve_hostname %s; want none", cc.Hostname, cc.FQDN, preserve)
		}
		return nil
	}
	if cc.Hostname != want || cc.FQDN != want || preserve != "false" {
		return fmt.Errorf("sets hostname %q, fqdn %q, preserve_hostname %s; want %q, %q, false",
			cc.Hostname, cc.FQDN, preserve, want, want)
	}
	return nil
}

const bareMetalConfig = `
variable "hostname" {
  type    = string
  default = null
}

variable "endpoints" {
  type    = list(string)
  default = null
}

variable "hash" {
  type    = string
  default = null
}

data "berth_node_config" "node" {
  cluster_name     = "prod"
  join_ca_pin      = "` + testPin + `"
  bare_metal       = true
  hostname         = var.hostname
  join_endpoints   = var.endpoints
  init_secret_hash = var.hash
}
`

// attrError matches Terraform's rendering of an error on one attribute of data.berth_node_config.node: the
// summary, the attribute's line of the configuration, then the detail.
func attrError(summary, attr, detail string) *regexp.Regexp {
	return regexp.MustCompile(`(?s)Error: ` + regexp.QuoteMeta(summary) + `.*with data\.berth_node_config\.node,` +
		`.*in data "berth_node_config" "node":\s+\d+:\s+` + attr + `\s+=.*` + phrase(detail).String())
}

func TestNodeConfigBareMetal(t *testing.T) {
	t.Parallel()
	hash, err := initsecret.Hash([]byte("test-init-secret"))
	if err != nil {
		t.Fatal(err)
	}
	endpoints := config.ListVariable(config.StringVariable("join.rack1.example.internal:7450"))
	hostname := func(name string) config.Variables {
		return config.Variables{"hostname": config.StringVariable(name), "endpoints": endpoints}
	}
	resource.UnitTest(t, resource.TestCase{
		ProtoV6ProviderFactories: providers,
		Steps: []resource.TestStep{
			{
				Config:          bareMetalConfig,
				ConfigVariables: hostname("rack1-node07.dc1.example.com"),
				Check: resource.ComposeTestCheckFunc(
					resource.TestCheckResourceAttr("data.berth_node_config.node", "bare_metal", "true"),
					resource.TestCheckResourceAttr("data.berth_node_config.node", "hostname", "rack1-node07.dc1.example.com"),
					checkCloudInit("data.berth_node_config.node", metadata.UserData{
						ClusterName: "prod", JoinEndpoints: []string{"join.rack1.example.internal:7450"},
						JoinPort: 7450, JoinCAPin: testPin,
					}, "rack1-node07.dc1.example.com"),
				),
			},
			{
				Config:          bareMetalConfig,
				ConfigVariables: config.Variables{"hostname": config.StringVariable("rack1-node07")},
				ExpectError: attrError("Missing join endpoints", "join_endpoints",
					"bare-metal nodes find the join service only through join_endpoints"),
			},
			{
				Config:          bareMetalConfig,
				ConfigVariables: config.Variables{"endpoints": config.ListVariable()},
				ExpectError: attrError("Missing join endpoints", "join_endpoints",
					"bare-metal nodes find the join service only through join_endpoints"),
			},
			{
				Config:          bareMetalConfig,
				ConfigVariables: config.Variables{"endpoints": endpoints, "hash": config.StringVariable(hash)},
				ExpectError: attrError("Init secret hash on bare-metal nodes", "init_secret_hash",
					"init_secret_hash must be unset when bare_metal is true"),
			},
			{
				Config:          bareMetalConfig,
				ConfigVariables: hostname("Rack1-Node07"),
				ExpectError:     attrError("Invalid hostname", "hostname", `hostname "Rack1-Node07": 'R' at byte 0 is not a lowercase letter`),
			},
			{
				Config:          bareMetalConfig,
				ConfigVariables: hostname(strings.Repeat("a", 40) + "." + strings.Repeat("b", 24)),
				ExpectError:     attrError("Invalid hostname", "hostname", "has 65 characters; Linux takes at most 64"),
			},
			{
				Config:          bareMetalConfig,
				ConfigVariables: hostname("rack1 node07"),
				ExpectError:     attrError("Invalid hostname", "hostname", `' ' at byte 5 is not a lowercase letter`),
			},
			{
				Config:          bareMetalConfig,
				ConfigVariables: hostname("rack1-node07\nruncmd: [reboot]"),
				ExpectError:     attrError("Invalid hostname", "hostname", `hostname "rack1-node07\nruncmd: [reboot]": '\n' at byte 12`),
			},
		},
	})
}

const roleConfig = `
variable "role" {
  type = string
}

variable "bare" {
  type    = bool
  default = false
}

variable "groups" {
  type    = map(string)
  default = null
}

data "berth_node_config" "node" {
  cluster_name       = "prod"
  join_ca_pin        = "` + testPin + `"
  join_endpoints     = ["10.0.0.10:7450"]
  bare_metal         = var.bare
  role               = var.role
  autoscaling_groups = var.groups
}
`

// TestNodeConfigRole: a launch template per role carries the role in the user-data, where no metadata
// service names it, and the control-plane nodes' carries the autoscaling groups their join services admit.
func TestNodeConfigRole(t *testing.T) {
	t.Parallel()
	role := func(r string, bare bool) config.Variables {
		return config.Variables{"role": config.StringVariable(r), "bare": config.BoolVariable(bare)}
	}
	resource.UnitTest(t, resource.TestCase{
		ProtoV6ProviderFactories: providers,
		Steps: []resource.TestStep{
			{
				Config:          roleConfig,
				ConfigVariables: role("control-plane", false),
				Check: checkCloudInit("data.berth_node_config.node", metadata.UserData{
					ClusterName: "prod", JoinEndpoints: []string{"10.0.0.10:7450"}, JoinPort: 7450, JoinCAPin: testPin,
					Role: metadata.RoleControlPlane,
				}, ""),
			},
			{
				Config: roleConfig,
				ConfigVariables: config.Variables{"role": config.StringVariable("control-plane"), "groups": config.MapVariable(map[string]config.Variable{
					"prod-cp": config.StringVariable("control-plane"), "prod-workers": config.StringVariable("worker")})},
				Check: checkCloudInit("data.berth_node_config.node", metadata.UserData{
					ClusterName: "prod", JoinEndpoints: []string{"10.0.0.10:7450"}, JoinPort: 7450, JoinCAPin: testPin,
					Role: metadata.RoleControlPlane, AutoscalingGroups: map[string]metadata.Role{"prod-cp": metadata.RoleControlPlane, "prod-workers": metadata.RoleWorker},
				}, ""),
			},
			{
				Config: roleConfig,
				ConfigVariables: config.Variables{"role": config.StringVariable("control-plane"), "groups": config.MapVariable(map[string]config.Variable{
					"prod-workers": config.StringVariable("workers")})},
				ExpectError: regexp.MustCompile(`(?s)Invalid role.*autoscaling group "prod-workers" has role "workers"`),
			},
			{
				Config:          roleConfig,
				ConfigVariables: role("admin", false),
				ExpectError:     attrError("Invalid role", "role", `role is "admin", want "control-plane" or "worker".`),
			},
			{
				Config:          roleConfig,
				ConfigVariables: role("control-plane", true),
				ExpectError: attrError("Control-plane role on bare-metal nodes", "role",
					"role must not be control-plane when bare_metal is true"),
			},
		},
	})
}

// instanceGroupsConfig is a control-plane node's user-data on Compute Engine; groups is the HCL of
// instance_groups, a literal so that Terraform can point at the key an error is about.
func instanceGroupsConfig(groups string) string {
	return `
data "berth_node_config" "node" {
  cluster_name    = "prod"
  join_ca_pin     = "` + testPin + `"
  role            = "control-plane"
  instance_groups = {` + groups + `
  }
}
`
}

// groupError matches Terraform's rendering of an error on one key of data.berth_node_config.node's
// instance_groups: the summary, the key's line of the configuration, then the detail.
func groupError(summary, key, detail string) string {
	return regexp.QuoteMeta("Error: "+summary) + `.*in data "berth_node_config" "node":\s+\d+:\s+"` +
		regexp.QuoteMeta(key) + `"\s+=.*` + phrase(detail).String()
}

// TestNodeConfigInstanceGroups: every bad key and role of instance_groups is refused at plan time, all in
// one run, each error pointing at its own entry; the control-plane nodes' user-data on Compute Engine
// carries the managed instance groups their join services admit, each with its role. The refusal comes
// first: the last step's configuration is the one the test destroys with.
func TestNodeConfigInstanceGroups(t *testing.T) {
	t.Parallel()
	resource.UnitTest(t, resource.TestCase{
		ProtoV6ProviderFactories: providers,
		Steps: []resource.TestStep{
			{
				Config: instanceGroupsConfig(`
    "berth-workers"               = "worker"
    "europe-west1/Berth-Workers"  = "workers"
    "europe-west1-b/berth-extras" = "admin"
    "europe-west1/berth-cp"       = "control-plane"`),
				ExpectError: regexp.MustCompile(`(?s)` +
					groupError("Invalid instance group", "berth-workers",
						`instance group "berth-workers" is not "<region or zone>/<name>" (a regional group `+
							`"europe-west1/berth-workers", a zonal one "europe-west1-b/berth-workers").`) + `.*` +
					groupError("Invalid instance group", "europe-west1/Berth-Workers",
						`instance group "europe-west1/Berth-Workers" is not "<region or zone>/<name>"`) + `.*` +
					groupError("Invalid role", "europe-west1/Berth-Workers",
						`instance group "europe-west1/Berth-Workers" has role "workers", want "control-plane" or "worker".`) + `.*` +
					groupError("Invalid role", "europe-west1-b/berth-extras",
						`instance group "europe-west1-b/berth-extras" has role "admin", want "control-plane" or "worker".`)),
			},
			{
				Config: instanceGroupsConfig(`
    "europe-west1/berth-cp"        = "control-plane"
    "europe-west1-b/berth-workers" = "worker"`),
				Check: checkCloudInit("data.berth_node_config.node", metadata.UserData{
					ClusterName: "prod", JoinPort: 7450, JoinCAPin: testPin, Role: metadata.RoleControlPlane,
					InstanceGroups: map[string]metadata.Role{"europe-west1/berth-cp": metadata.RoleControlPlane,
						"europe-west1-b/berth-workers": metadata.RoleWorker},
				}, ""),
			},
		},
	})
}

// TestNodeConfigEveryMistakeAtOnce: one plan names every wrong value, each on its attribute, before the data
// source is read.
func TestNodeConfigEveryMistakeAtOnce(t *testing.T) {
	t.Parallel()
	resource.UnitTest(t, resource.TestCase{
		ProtoV6ProviderFactories: providers,
		Steps: []resource.TestStep{{
			Config: `
data "berth_node_config" "node" {
  cluster_name     = "Prod!"
  join_ca_pin      = "sha256:xyz"
  join_port        = 70000
  init_secret_hash = "plain-secret"
  join_endpoints   = ["join.example.internal:7450", "no-port", "join.example.internal:7450"]
}
`,
			ExpectError: regexp.MustCompile(`(?s)` + strings.Join([]string{
				`Error: Invalid cluster name.*cluster_name\s+=\s+"Prod!"`,
				`Error: Invalid join CA pin.*join_ca_pin\s+=.*` + phrase(`join CA pin "sha256:xyz": digest has 3 characters, want 64 hex: use berth_secrets' join_ca_pin.`).String(),
				`Error: Invalid join port.*join_port\s+=.*` + phrase("join_port is 70000, want 1 to 65535.").String(),
				`Error: Invalid init secret hash.*init_secret_hash\s+=.*` + phrase("init secret hash is not an argon2id PHC string").String(),
				`Error: Invalid join endpoint.*join_endpoints\s+=.*` + phrase(`join endpoint "no-port" is not host:port`).String(),
				`Error: Join endpoint listed twice.*` + phrase(`join endpoint "join.example.internal:7450" is listed twice.`).String(),
			}, ".*")),
		}},
	})
}
