package provider

import (
	"bytes"
	"encoding/base64"
	"fmt"
	"testing"

	"github.com/hashicorp/terraform-plugin-testing/config"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/terraform"

	"github.com/berthlabs/berth/internal/clustersecrets"
	"github.com/berthlabs/berth/internal/pki"
)

const ephemeralConfig = `
variable "root_key" {
  type      = string
  ephemeral = true
  sensitive = true
}

variable "ephemeral_root_key" {
  type      = string
  ephemeral = true
  sensitive = true
}

resource "berth_secrets" "test" {
  root_key_wo         = var.root_key
  root_key_wo_version = 1
}

ephemeral "berth_secrets" "test" {
  root_key                  = var.ephemeral_root_key
  kubernetes_ca_certificate = berth_secrets.test.kubernetes_ca_certificate
  join_ca_certificate       = berth_secrets.test.join_ca_certificate
}

# Only tests do this: the echo provider copies the ephemeral values into state so the test can see them.
provider "echo" {
  data = ephemeral.berth_secrets.test
}

resource "echo" "test" {}
`

func ephemeralVars(root, ephemeralRoot []byte) config.Variables {
	return config.Variables{
		"root_key":           config.StringVariable(base64.StdEncoding.EncodeToString(root)),
		"ephemeral_root_key": config.StringVariable(base64.RawURLEncoding.EncodeToString(ephemeralRoot)),
	}
}

// checkEphemeralSecrets checks that the ephemeral values echoed into state are root's secrets and that the
// CA keys belong to the certificates of berth_secrets.test.
func checkEphemeralSecrets(root []byte) resource.TestCheckFunc {
	return func(s *terraform.State) error {
		echo, ok := s.RootModule().Resources["echo.test"]
		if !ok {
			return fmt.Errorf("echo.test is not in state")
		}
		got := echo.Primary.Attributes
		managed := s.RootModule().Resources["berth_secrets.test"].Primary.Attributes
		want, err := clustersecrets.Derive(root)
		if err != nil {
			return err
		}
		for attr, value := range map[string]string{
			"master_secret": base64.StdEncoding.EncodeToString(want.MasterSecret),
			"salt":          base64.StdEncoding.EncodeToString(want.Salt),
			"init_secret":   want.InitSecret,
		} {
			if got["data."+attr] != value {
				return fmt.Errorf("%s is not the secret the root key derives", attr)
			}
		}
		for keyAttr, certAttr := range map[string]string{
			"kubernetes_ca_key": "kubernetes_ca_certificate",
			"join_ca_key":       "join_ca_certificate",
		} {
			ca, err := pki.ParseCA([]byte(managed[certAttr]), []byte(got["data."+keyAttr]))
			if err != nil {
				return fmt.Errorf("%s does not pair with berth_secrets.%s: %w", keyAttr, certAttr, err)
			}
			if _, err := ca.KeyPEM(); err != nil {
				return err
			}
		}
		return nil
	}
}

func TestSecretsEphemeralResource(t *testing.T) {
	t.Parallel()
	root := testRoot(5)
	resource.UnitTest(t, resource.TestCase{
		ProtoV6ProviderFactories: providersWithEcho,
		Steps: []resource.TestStep{
			{
				// The root key is written differently here (unpadded base64url) than for the managed resource.
				Config:          ephemeralConfig,
				ConfigVariables: ephemeralVars(root, root),
				Check:           checkEphemeralSecrets(root),
			},
			{
				Config:          ephemeralConfig,
				ConfigVariables: ephemeralVars(root, testRoot(6)),
				ExpectError:     phrase("Root key does not match berth_secrets"),
			},
			{
				Config:          ephemeralConfig,
				ConfigVariables: ephemeralVars(root, bytes.Repeat([]byte{1}, 8)),
				ExpectError:     phrase("the root key decodes to 8 bytes"),
			},
			{
				// The post-test destroy runs with the last step's configuration, which must be valid.
				Config:          ephemeralConfig,
				ConfigVariables: ephemeralVars(root, root),
			},
		},
	})
}

func TestSecretsEphemeralResourceRefusesGarbageCertificate(t *testing.T) {
	t.Parallel()
	resource.UnitTest(t, resource.TestCase{
		ProtoV6ProviderFactories: providers,
		Steps: []resource.TestStep{{
			Config: `
ephemeral "berth_secrets" "test" {
  root_key                  = "` + base64.StdEncoding.EncodeToString(testRoot(7)) + `"
  kubernetes_ca_certificate = "not a certificate"
  join_ca_certificate       = "not a certificate"
}`,
			ExpectError: phrase("Invalid CA certificate"),
		}},
	})
}
