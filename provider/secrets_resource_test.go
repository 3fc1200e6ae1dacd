package provider

import (
	"bytes"
	"crypto/ecdsa"
	"encoding/base64"
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-testing/config"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"

	"github.com/berthlabs/berth/internal/clustersecrets"
	"github.com/berthlabs/berth/internal/initsecret"
	"github.com/berthlabs/berth/internal/keys"
	"github.com/berthlabs/berth/internal/pki"
)

func testRoot(b byte) []byte { return bytes.Repeat([]byte{b}, 32) }

// phrase matches words however Terraform wraps them in its diagnostics.
func phrase(s string) *regexp.Regexp {
	words := strings.Fields(s)
	for i, w := range words {
		words[i] = regexp.QuoteMeta(w)
	}
	return regexp.MustCompile(strings.Join(words, `\s+`))
}

const secretsConfig = `
variable "root_key" {
  type      = string
  ephemeral = true
  sensitive = true
}

variable "key_version" {
  type = number
}

resource "berth_secrets" "test" {
  root_key_wo         = var.root_key
  root_key_wo_version = var.key_version
}
`

func secretsVars(root []byte, version int) config.Variables {
	return config.Variables{
		"root_key":    config.StringVariable(base64.StdEncoding.EncodeToString(root)),
		"key_version": config.IntegerVariable(version),
	}
}

// kept is what a test remembers of berth_secrets between steps.
type kept struct {
	clusterID, kubeCert, joinCert, kubePin, joinPin string
}

// checkSecrets checks berth_secrets.test against what root derives, and remembers it in k.
func checkSecrets(root []byte, k *kept) resource.TestCheckFunc {
	return func(s *terraform.State) error {
		rs, ok := s.RootModule().Resources["berth_secrets.test"]
		if !ok {
			return fmt.Errorf("berth_secrets.test is not in state")
		}
		a := rs.Primary.Attributes
		if v := a["root_key_wo"]; v != "" {
			return fmt.Errorf("state holds root_key_wo")
		}
		want, err := clustersecrets.Derive(root)
		if err != nil {
			return err
		}
		for _, ca := range []struct {
			name, certAttr, pinAttr, cn string
			key                         *ecdsa.PublicKey
		}{
			{"Kubernetes CA", "kubernetes_ca_certificate", "kubernetes_ca_pin", clustersecrets.KubernetesCAName, &want.KubernetesCAKey.PublicKey},
			{"join CA", "join_ca_certificate", "join_ca_pin", clustersecrets.JoinCAName, &want.JoinCAKey.PublicKey},
		} {
			cert, err := pki.ParseCertPEM([]byte(a[ca.certAttr]))
			if err != nil {
				return fmt.Errorf("%s: %w", ca.certAttr, err)
			}
			if !ca.key.Equal(cert.PublicKey) {
				return fmt.Errorf("%s certificate is not for the key the root key derives", ca.name)
			}
			if cert.Subject.CommonName != ca.cn || !cert.IsCA {
				return fmt.Errorf("%s certificate: subject %q, CA %v", ca.name, cert.Subject.CommonName, cert.IsCA)
			}
			if got := a[ca.pinAttr]; got != pki.SPKIPin(cert) {
				return fmt.Errorf("%s = %q, want the certificate's SPKI pin %q", ca.pinAttr, got, pki.SPKIPin(cert))
			}
			if got := cert.NotAfter.Sub(cert.NotBefore); got != 3650*24*time.Hour+5*time.Minute {
				return fmt.Errorf("%s certificate is valid for %v, want 3650 days and 5 minutes of backdating", ca.name, got)
			}
		}
		wantID, err := keys.ClusterIDOf(want.MasterSecret, want.Salt)
		if err != nil {
			return err
		}
		if a["cluster_id"] != wantID || a["id"] != wantID {
			return fmt.Errorf("cluster_id %q, id %q, want %q", a["cluster_id"], a["id"], wantID)
		}
		ok, err = initsecret.Verify(a["init_secret_hash"], []byte(want.InitSecret))
		if err != nil || !ok {
			return fmt.Errorf("init_secret_hash does not verify the derived init secret (%v)", err)
		}
		if a["ca_validity_days"] != "3650" {
			return fmt.Errorf("ca_validity_days = %q, want the default 3650", a["ca_validity_days"])
		}
		*k = kept{a["cluster_id"], a["kubernetes_ca_certificate"], a["join_ca_certificate"], a["kubernetes_ca_pin"], a["join_ca_pin"]}
		return nil
	}
}

func TestSecretsResource(t *testing.T) {
	t.Parallel()
	var first, second, other kept
	resource.UnitTest(t, resource.TestCase{
		ProtoV6ProviderFactories: providers,
		Steps: []resource.TestStep{
			{
				Config:          secretsConfig,
				ConfigVariables: secretsVars(testRoot(1), 1),
				Check:           checkSecrets(testRoot(1), &first),
			},
			{
				// Nothing remote, nothing to refresh: a second apply changes nothing.
				Config:          secretsConfig,
				ConfigVariables: secretsVars(testRoot(1), 1),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
			},
			{
				Config:             secretsConfig,
				ConfigVariables:    secretsVars(testRoot(1), 2),
				PlanOnly:           true,
				ExpectNonEmptyPlan: true,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PostApplyPreRefresh: []plancheck.PlanCheck{
						plancheck.ExpectResourceAction("berth_secrets.test", plancheck.ResourceActionReplace),
					},
				},
			},
			{
				// The same root key under a new version: same keys, pins and ID, new certificates.
				Config:          secretsConfig,
				ConfigVariables: secretsVars(testRoot(1), 2),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{
						plancheck.ExpectResourceAction("berth_secrets.test", plancheck.ResourceActionReplace),
					},
				},
				Check: resource.ComposeTestCheckFunc(checkSecrets(testRoot(1), &second), func(*terraform.State) error {
					if second.clusterID != first.clusterID || second.kubePin != first.kubePin || second.joinPin != first.joinPin {
						return fmt.Errorf("the same root key gave another cluster ID or pins: %+v, then %+v", first, second)
					}
					if second.kubeCert == first.kubeCert || second.joinCert == first.joinCert {
						return fmt.Errorf("replacement kept the old CA certificates")
					}
					return nil
				}),
			},
			{
				Config:          secretsConfig,
				ConfigVariables: secretsVars(testRoot(2), 3),
				Check: resource.ComposeTestCheckFunc(checkSecrets(testRoot(2), &other), func(*terraform.State) error {
					if other.clusterID == first.clusterID || other.joinPin == first.joinPin {
						return fmt.Errorf("another root key gave the same cluster ID or join pin")
					}
					return nil
				}),
			},
			{
				Config:          secretsConfig,
				ConfigVariables: secretsVars(testRoot(2), 3),
				ResourceName:    "berth_secrets.test",
				ImportState:     true,
				ImportStateId:   "0123456789abcdef0123456789abcdef",
				ExpectError:     phrase("Importing berth_secrets needs the root key"),
			},
		},
	})
}

func TestSecretsResourceRefusesBadInput(t *testing.T) {
	t.Parallel()
	withKey := func(text string) config.Variables {
		return config.Variables{"root_key": config.StringVariable(text), "key_version": config.IntegerVariable(1)}
	}
	resource.UnitTest(t, resource.TestCase{
		ProtoV6ProviderFactories: providers,
		Steps: []resource.TestStep{
			{
				Config:          secretsConfig,
				ConfigVariables: withKey(base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{9}, 16))),
				PlanOnly:        true,
				ExpectError:     phrase("the root key decodes to 16 bytes, want at least 32 random bytes"),
			},
			{
				Config:          secretsConfig,
				ConfigVariables: withKey("correct horse battery staple"),
				PlanOnly:        true,
				ExpectError:     phrase("the root key is not base64"),
			},
			{
				Config: `
resource "berth_secrets" "test" {
  root_key_wo         = "` + base64.StdEncoding.EncodeToString(testRoot(3)) + `"
  root_key_wo_version = 1
  ca_validity_days    = 0
}`,
				PlanOnly:    true,
				ExpectError: phrase("ca_validity_days is 0, want 1 to 36500"),
			},
		},
	})
}
