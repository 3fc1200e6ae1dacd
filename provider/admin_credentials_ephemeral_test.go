package provider

import (
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-testing/config"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/berthlabs/berth/internal/clustersecrets"
	"github.com/berthlabs/berth/internal/pki"
)

// adminCredentialsConfig mints admin credentials; the echo provider copies them into state so that the test
// can look at them, which only tests do.
func adminCredentialsConfig(args string) string {
	return `
variable "root_key" {
  type      = string
  ephemeral = true
  sensitive = true
}

variable "kubernetes_ca_certificate" {
  type = string
}

ephemeral "berth_admin_credentials" "this" {
  root_key                  = var.root_key
  kubernetes_ca_certificate = var.kubernetes_ca_certificate
` + args + `
}

provider "echo" {
  data = ephemeral.berth_admin_credentials.this
}

resource "echo" "this" {}
`
}

// newRootKey makes a root key and the Kubernetes CA that berth_secrets makes of it.
func newRootKey(t *testing.T) ([]byte, *pki.CA) {
	t.Helper()
	root := make([]byte, 32)
	if _, err := rand.Read(root); err != nil {
		t.Fatal(err)
	}
	secrets, err := clustersecrets.Derive(root)
	if err != nil {
		t.Fatal(err)
	}
	kube, _, err := secrets.NewCAs(time.Now(), 10*365*24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	return root, kube
}

func adminCredentialsVars(root []byte, ca *pki.CA) config.Variables {
	return config.Variables{
		"root_key":                  config.StringVariable(base64.StdEncoding.EncodeToString(root)),
		"kubernetes_ca_certificate": config.StringVariable(string(ca.CertPEM())),
	}
}

// wrapped matches texts, in this order, as terraform prints a diagnostic: wrapped at spaces, each line
// after the first of its box behind a "│".
func wrapped(texts ...string) *regexp.Regexp {
	var parts []string
	for _, text := range texts {
		words := strings.Fields(text)
		for i, w := range words {
			words[i] = regexp.QuoteMeta(w)
		}
		parts = append(parts, strings.Join(words, `(?:\s|│)+`))
	}
	return regexp.MustCompile(`(?s)` + strings.Join(parts, `.*`))
}

// TestAdminCredentialsRefused checks the arguments berth_admin_credentials refuses, each at plan, with
// what terraform prints.
func TestAdminCredentialsRefused(t *testing.T) {
	t.Parallel()
	root, ca := newRootKey(t)
	other, _ := newRootKey(t)
	endpoint := `api_server_endpoint = "10.0.0.10:6443"`
	refused := func(args string, vars config.Variables, want *regexp.Regexp) resource.TestStep {
		return resource.TestStep{Config: adminCredentialsConfig(args), ConfigVariables: vars, PlanOnly: true, ExpectError: want}
	}
	resource.UnitTest(t, resource.TestCase{
		ProtoV6ProviderFactories: providersWithEcho,
		Steps: []resource.TestStep{
			refused(endpoint, adminCredentialsVars(other, ca),
				wrapped("Root key does not match the Kubernetes CA", "did not make kubernetes_ca_certificate")),
			refused(endpoint, config.Variables{
				"root_key":                  config.StringVariable("c2hvcnQ="),
				"kubernetes_ca_certificate": config.StringVariable(string(ca.CertPEM())),
			}, wrapped("Invalid root key", "the root key decodes to 5 bytes, want at least 32")),
			refused(endpoint+"\n  validity = \"30s\"", adminCredentialsVars(root, ca),
				wrapped("Validity out of range", "validity is 30s; it must be from 1m0s to 24h0m0s")),
			refused(endpoint+"\n  validity = \"48h\"", adminCredentialsVars(root, ca),
				wrapped("Validity out of range", "validity is 48h0m0s")),
			refused(endpoint+"\n  validity = \"soon\"", adminCredentialsVars(root, ca),
				wrapped("Invalid validity", `validity "soon" is not a Go duration`)),
			refused(endpoint+"\n  user_name = \"system:kube-scheduler\"", adminCredentialsVars(root, ca),
				wrapped("Invalid user name", `"system:kube-scheduler" starts with "system:"`)),
			refused(`api_server_endpoint = "http://10.0.0.10:6443"`, adminCredentialsVars(root, ca),
				wrapped("Invalid API server endpoint", "an API server URL is https://host[:port][/path]")),
			refused(`api_server_endpoint = "10.0.0.10"`, adminCredentialsVars(root, ca),
				wrapped("Invalid API server endpoint", `"10.0.0.10" is neither host:port`)),
			refused(endpoint, config.Variables{
				"root_key":                  config.StringVariable(base64.StdEncoding.EncodeToString(root)),
				"kubernetes_ca_certificate": config.StringVariable("not a certificate"),
			}, wrapped("Invalid Kubernetes CA certificate")),
		},
	})
}

// TestAdminCredentialsMinted checks what berth_admin_credentials mints: a new key, a client certificate
// of the CA the root key derives, in group kubeadm:cluster-admins under user_name, valid for validity, and
// a kubeconfig of them for host.
func TestAdminCredentialsMinted(t *testing.T) {
	t.Parallel()
	root, ca := newRootKey(t)
	// A case each: the echo resource keeps what it first echoed.
	for _, c := range []struct {
		name, args, host, user string
		validity               time.Duration
	}{
		{"defaults", `api_server_endpoint = "10.0.0.10:6443"`, "https://10.0.0.10:6443", defaultAdminUser, time.Hour},
		{"url", `api_server_endpoint = "https://api.example.com/"
  user_name           = "ci-pipeline"
  validity            = "15m"`, "https://api.example.com", "ci-pipeline", 15 * time.Minute},
	} {
		t.Run(c.name, func(t *testing.T) {
			resource.UnitTest(t, resource.TestCase{
				ProtoV6ProviderFactories: providersWithEcho,
				Steps: []resource.TestStep{{
					Config:          adminCredentialsConfig(c.args),
					ConfigVariables: adminCredentialsVars(root, ca),
					Check:           checkMinted(ca, c.host, c.user, c.validity),
				}},
			})
		})
	}
}

func checkMinted(ca *pki.CA, host, user string, validity time.Duration) resource.TestCheckFunc {
	return func(s *terraform.State) error {
		echo, ok := s.RootModule().Resources["echo.this"]
		if !ok {
			return errors.New("echo.this is not in state")
		}
		got := echo.Primary.Attributes
		if got["data.host"] != host {
			return fmt.Errorf("host is %q, want %q", got["data.host"], host)
		}
		if got["data.cluster_ca_certificate"] != string(ca.CertPEM()) {
			return errors.New("cluster_ca_certificate is not the Kubernetes CA certificate given")
		}
		cert, err := pki.ParseCertPEM([]byte(got["data.client_certificate"]))
		if err != nil {
			return err
		}
		roots := x509.NewCertPool()
		roots.AddCert(ca.Cert)
		if _, err := cert.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
			return fmt.Errorf("the client certificate does not verify as a client of the Kubernetes CA: %w", err)
		}
		if cert.Subject.CommonName != user || !slices.Equal(cert.Subject.Organization, []string{adminGroup}) {
			return fmt.Errorf("the certificate is for %q in %v, want %q in [%s]", cert.Subject.CommonName, cert.Subject.Organization, user, adminGroup)
		}
		if left := time.Until(cert.NotAfter); left > validity || left < validity-time.Minute {
			return fmt.Errorf("the certificate expires in %s, want %s", left, validity)
		}
		if got["data.expires_at"] != cert.NotAfter.UTC().Format(time.RFC3339) {
			return fmt.Errorf("expires_at is %q, the certificate expires %s", got["data.expires_at"], cert.NotAfter)
		}
		if _, err := tls.X509KeyPair([]byte(got["data.client_certificate"]), []byte(got["data.client_key"])); err != nil {
			return fmt.Errorf("client_key is not the key of client_certificate: %w", err)
		}
		kc, err := clientcmd.Load([]byte(got["data.kubeconfig"]))
		if err != nil {
			return err
		}
		cur := kc.Contexts[kc.CurrentContext]
		if cur == nil || kc.Clusters[cur.Cluster] == nil || kc.AuthInfos[cur.AuthInfo] == nil {
			return fmt.Errorf("the kubeconfig's current context %q is incomplete", kc.CurrentContext)
		}
		if server := kc.Clusters[cur.Cluster].Server; server != host {
			return fmt.Errorf("the kubeconfig's server is %q, want %q", server, host)
		}
		if string(kc.AuthInfos[cur.AuthInfo].ClientCertificateData) != got["data.client_certificate"] ||
			string(kc.AuthInfos[cur.AuthInfo].ClientKeyData) != got["data.client_key"] {
			return errors.New("the kubeconfig does not hold client_certificate and client_key")
		}
		return nil
	}
}
