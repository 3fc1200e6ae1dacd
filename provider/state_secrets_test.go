package provider

import (
	"archive/zip"
	"bytes"
	"crypto/ecdsa"
	"crypto/rand"
	"crypto/x509"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/berthlabs/berth/internal/clustersecrets"
	"github.com/berthlabs/berth/internal/pki"
)

const stateSecretsConfig = `
terraform {
  required_providers {
    berth = {
      source = "berthlabs/berth"
    }
  }
}

variable "root_key" {
  type      = string
  ephemeral = true
  sensitive = true
}

resource "berth_secrets" "cluster" {
  root_key_wo         = var.root_key
  root_key_wo_version = 1
}

ephemeral "berth_secrets" "cluster" {
  root_key                  = var.root_key
  kubernetes_ca_certificate = berth_secrets.cluster.kubernetes_ca_certificate
  join_ca_certificate       = berth_secrets.cluster.join_ca_certificate
}

data "berth_node_config" "first" {
  cluster_name     = "prod"
  join_ca_pin      = berth_secrets.cluster.join_ca_pin
  init_secret_hash = berth_secrets.cluster.init_secret_hash
}

output "cluster_id" {
  value = berth_secrets.cluster.cluster_id
}
`

// TestStateHoldsNoSecret runs the provider the way operators do, a built binary under the real terraform,
// and searches everything Terraform keeps or prints for every secret the root key yields.
func TestStateHoldsNoSecret(t *testing.T) {
	t.Parallel()
	root := make([]byte, 32)
	if _, err := rand.Read(root); err != nil {
		t.Fatal(err)
	}
	secrets, err := clustersecrets.Derive(root)
	if err != nil {
		t.Fatal(err)
	}
	rootText := base64.StdEncoding.EncodeToString(root)

	work := t.TempDir()
	if err := os.WriteFile(filepath.Join(work, "main.tf"), []byte(stateSecretsConfig), 0o600); err != nil {
		t.Fatal(err)
	}
	var printed bytes.Buffer
	tf := func(args ...string) []byte {
		t.Helper()
		stdout, stderr := runTerraform(t, work, args...)
		printed.Write(stdout)
		printed.Write(stderr)
		return stdout
	}
	rootVar := "root_key=" + rootText
	tf("plan", "-input=false", "-no-color", "-out=tfplan", "-var", rootVar)
	planJSON := tf("show", "-json", "tfplan")
	applied := tf("apply", "-input=false", "-no-color", "-var", rootVar, "tfplan")
	if !bytes.Contains(applied, []byte("ephemeral.berth_secrets.cluster: Opening...")) {
		t.Fatalf("terraform did not open the ephemeral berth_secrets during apply:\n%s", applied)
	}
	stateJSON := tf("show", "-json")
	rawState, err := os.ReadFile(filepath.Join(work, "terraform.tfstate"))
	if err != nil {
		t.Fatal(err)
	}

	forbidden := forbiddenSecrets(t, root)
	searched := map[string][]byte{
		"terraform show -json tfplan": planJSON,
		"terraform show -json":        stateJSON,
		"terraform.tfstate":           rawState,
		"terraform's output":          printed.Bytes(),
	}
	// A saved plan is a zip archive (plan, prior state, configuration); CI systems keep it as an artifact.
	for name, data := range unzip(t, filepath.Join(work, "tfplan")) {
		searched["tfplan:"+name] = data
	}
	for _, leak := range findSecrets(searched, forbidden) {
		t.Error(leak)
	}
	for name, text := range searched {
		if bytes.Contains(text, []byte("PRIVATE KEY")) {
			t.Errorf("%s contains a PEM private key", name)
		}
	}

	// The public half is there, for the keys the root key derives.
	for name, text := range map[string][]byte{"terraform show -json": stateJSON, "terraform.tfstate": rawState} {
		for attr, key := range map[string]*ecdsa.PrivateKey{
			"kubernetes_ca_certificate": secrets.KubernetesCAKey,
			"join_ca_certificate":       secrets.JoinCAKey,
		} {
			cert, err := pki.ParseCertPEM([]byte(findAttribute(t, text, attr)))
			if err != nil {
				t.Fatalf("%s: %s: %v", name, attr, err)
			}
			if !key.PublicKey.Equal(cert.PublicKey) {
				t.Errorf("%s: %s is not the certificate of the derived key", name, attr)
			}
		}
	}
}

func unzip(t *testing.T, name string) map[string][]byte {
	t.Helper()
	r, err := zip.OpenReader(name)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	files := make(map[string][]byte)
	for _, f := range r.File {
		rc, err := f.Open()
		if err != nil {
			t.Fatal(err)
		}
		data, err := io.ReadAll(rc)
		rc.Close()
		if err != nil {
			t.Fatal(err)
		}
		files[f.Name] = data
	}
	if len(files) == 0 {
		t.Fatalf("%s holds no files", name)
	}
	return files
}

// leakForm is one spelling of a secret; name says which, so that a failure names it without printing it.
// forbiddenSecrets are root's secrets, by name, in every form a provider could store them in.
func forbiddenSecrets(t *testing.T, root []byte) map[string][]byte {
	t.Helper()
	secrets, err := clustersecrets.Derive(root)
	if err != nil {
		t.Fatal(err)
	}
	kubeKey, err := x509.MarshalPKCS8PrivateKey(secrets.KubernetesCAKey)
	if err != nil {
		t.Fatal(err)
	}
	joinKey, err := x509.MarshalPKCS8PrivateKey(secrets.JoinCAKey)
	if err != nil {
		t.Fatal(err)
	}
	return map[string][]byte{
		"root key":                  root,
		"master secret":             secrets.MasterSecret,
		"salt":                      secrets.Salt,
		"init secret":               []byte(secrets.InitSecret),
		"init secret bytes":         mustDecodeRawURL(t, secrets.InitSecret),
		"Kubernetes CA private key": scalar(t, secrets.KubernetesCAKey),
		"join CA private key":       scalar(t, secrets.JoinCAKey),
		"Kubernetes CA PKCS#8 key":  kubeKey,
		"join CA PKCS#8 key":        joinKey,
	}
}

// findSecrets says which forbidden secret appears in which searched text, in any of its leak forms.
func findSecrets(searched, forbidden map[string][]byte) []string {
	var found []string
	for name, text := range searched {
		flat := unwrap(text)
		for what, secret := range forbidden {
			for _, form := range leakForms(secret) {
				if bytes.Contains(text, []byte(form.text)) || bytes.Contains(flat, []byte(form.text)) {
					found = append(found, fmt.Sprintf("%s contains the %s (%s)", name, what, form.name))
				}
			}
		}
	}
	return found
}

type leakForm struct{ name, text string }

// leakForms lists the spellings in which secret could appear in a text: as it is, in hex, and in base64
// with either alphabet at each of the three alignments it can have inside a longer encoded value (only
// the characters that depend on secret alone are kept).
func leakForms(secret []byte) []leakForm {
	forms := []leakForm{
		{"raw", string(secret)},
		{"hex", hex.EncodeToString(secret)},
		{"upper-case hex", strings.ToUpper(hex.EncodeToString(secret))},
	}
	for k := range 3 {
		padded := append(make([]byte, k), secret...)
		start, end := (8*k+5)/6, 8*len(padded)/6
		for name, enc := range map[string]*base64.Encoding{"base64": base64.StdEncoding, "base64url": base64.URLEncoding} {
			forms = append(forms, leakForm{fmt.Sprintf("%s at byte offset %d", name, k), enc.EncodeToString(padded)[start:end]})
		}
	}
	return forms
}

// unwrap removes line breaks, raw and JSON-escaped, so that a base64 value split into PEM lines is found.
func unwrap(text []byte) []byte {
	return []byte(strings.NewReplacer(`\n`, "", "\n", "", `\r`, "", "\r", "").Replace(string(text)))
}

func scalar(t *testing.T, key *ecdsa.PrivateKey) []byte {
	t.Helper()
	b, err := key.Bytes()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func mustDecodeRawURL(t *testing.T, s string) []byte {
	t.Helper()
	b, err := base64.RawURLEncoding.DecodeString(s)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// findAttribute returns the value of the first JSON object key named attr anywhere in doc.
func findAttribute(t *testing.T, doc []byte, attr string) string {
	t.Helper()
	var v any
	if err := json.Unmarshal(doc, &v); err != nil {
		t.Fatal(err)
	}
	var find func(any) (string, bool)
	find = func(v any) (string, bool) {
		switch v := v.(type) {
		case map[string]any:
			if s, ok := v[attr].(string); ok {
				return s, true
			}
			for _, child := range v {
				if s, ok := find(child); ok {
					return s, true
				}
			}
		case []any:
			for _, child := range v {
				if s, ok := find(child); ok {
					return s, true
				}
			}
		}
		return "", false
	}
	s, ok := find(v)
	if !ok {
		t.Fatalf("no %q in %s", attr, doc)
	}
	return s
}
