package provider

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"testing"

	"github.com/hashicorp/terraform-plugin-testing/config"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"sigs.k8s.io/yaml"

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

// checkCloudInit checks that cloud_init is a #cloud-config that writes exactly json to the agent's path,
// and that size_bytes is its size.
func checkCloudInit(addr string, want metadata.UserData) resource.TestCheckFunc {
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
		var cc cloudConfig
		if err := yaml.UnmarshalStrict([]byte(doc), &cc); err != nil {
			return fmt.Errorf("%s.cloud_init is not YAML: %w", addr, err)
		}
		if len(cc.WriteFiles) != 1 || cc.WriteFiles[0] != (writeFile{Path: "/etc/berth/user-data.json",
			Content: a["json"], Owner: "root:root", Permissions: "0644"}) {
			return fmt.Errorf("%s.cloud_init writes %+v", addr, cc.WriteFiles)
		}
		if a["size_bytes"] != strconv.Itoa(len(doc)) || len(doc) > maxUserData {
			return fmt.Errorf("%s.size_bytes = %s for %d bytes", addr, a["size_bytes"], len(doc))
		}
		return nil
	}
}

func TestNodeConfigDataSource(t *testing.T) {
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
					checkCloudInit("data.berth_node_config.first", metadata.UserData{
						ClusterName: "prod", JoinEndpoints: []string{"join.berth.example.internal:7450"},
						JoinPort: 7450, JoinCAPin: testPin, InitSecretHash: hash,
					}),
					checkCloudInit("data.berth_node_config.worker", metadata.UserData{
						ClusterName: "prod", JoinPort: 8443, JoinCAPin: testPin,
					}),
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

func TestRenderUserDataLimit(t *testing.T) {
	u := metadata.UserData{ClusterName: "prod", JoinPort: 7450, JoinCAPin: testPin}
	_, small, err := renderUserData(u)
	if err != nil {
		t.Fatal(err)
	}
	// Grow the document with endpoints until it passes the limit: the last size accepted is at most the limit.
	last := len(small)
	for i := 0; ; i++ {
		u.JoinEndpoints = append(u.JoinEndpoints, fmt.Sprintf("join-%04d.example.internal:7450", i))
		_, doc, err := renderUserData(u)
		if err != nil {
			if !strings.Contains(err.Error(), "16 KiB") || last > maxUserData {
				t.Fatalf("after %d bytes accepted: %v", last, err)
			}
			return
		}
		last = len(doc)
	}
}

func TestRenderUserDataRefusesInvalid(t *testing.T) {
	for _, u := range []metadata.UserData{
		{ClusterName: "Prod", JoinPort: 7450, JoinCAPin: testPin},
		{ClusterName: "prod", JoinPort: 7450, JoinCAPin: "sha256:xyz"},
		{ClusterName: "prod", JoinPort: 7450, JoinCAPin: testPin, InitSecretHash: "plain-text-secret"},
	} {
		if _, _, err := renderUserData(u); err == nil {
			t.Errorf("rendered invalid user-data %+v", u)
		} else if strings.Contains(err.Error(), "plain-text-secret") {
			t.Errorf("error echoes the init secret hash field: %v", err)
		}
	}
}
