package provider

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"

	"github.com/hashicorp/terraform-plugin-testing/terraform"
)

// labImportConfig is the example's berth_secrets and berth_cluster in a new working directory, as after a lost
// state, with import blocks and the provider's root key.
const labImportConfig = `
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

variable "lab_dir" {
  type = string
}

provider "berth" {
  root_key = var.root_key
}

import {
  to = berth_secrets.lab
  id = "10.250.0.10:6443"
}

import {
  to = berth_cluster.lab
  id = "10.250.0.10:7451"
}

resource "berth_secrets" "lab" {
  root_key_wo         = var.root_key
  root_key_wo_version = 1
}

ephemeral "berth_secrets" "lab" {
  root_key                  = var.root_key
  kubernetes_ca_certificate = berth_secrets.lab.kubernetes_ca_certificate
  join_ca_certificate       = berth_secrets.lab.join_ca_certificate
}

data "berth_image" "control_plane" {
  path = "${var.lab_dir}/berth-image.json"
  name = "berthlab-a"
}

resource "berth_cluster" "lab" {
  endpoint           = "10.250.0.10:7451"
  cluster_name       = "berthlab"
  kubernetes_version = data.berth_image.control_plane.components["kubernetes"]
  pcrs               = data.berth_image.control_plane.pcrs
  ek_ca_certificates = file("${var.lab_dir}/ek-ca.pem")

  kubernetes_ca_certificate = berth_secrets.lab.kubernetes_ca_certificate
  join_ca_certificate       = berth_secrets.lab.join_ca_certificate
  init_secret_wo            = ephemeral.berth_secrets.lab.init_secret
  master_secret_wo          = ephemeral.berth_secrets.lab.master_secret
  salt_wo                   = ephemeral.berth_secrets.lab.salt
  kubernetes_ca_key_wo      = ephemeral.berth_secrets.lab.kubernetes_ca_key
  join_ca_key_wo            = ephemeral.berth_secrets.lab.join_ca_key
}
`

// importedAgrees imports the lab's running cluster into a new state with the real terraform, from the root key
// and its addresses only, and checks it against the state that made the cluster: berth_secrets the same (its
// init secret hash too, so the first control-plane node's user-data would not change), berth_cluster the same
// cluster and settings; the apply after the import reaches no node, and the plan after it is empty.
func importedAgrees(root []byte, labDir string) func(*terraform.State) error {
	return func(s *terraform.State) error {
		work, err := os.MkdirTemp("", "berth-import-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(work)
		if err := os.WriteFile(filepath.Join(work, "main.tf"), []byte(labImportConfig), 0o600); err != nil {
			return err
		}
		vars := []string{"-input=false", "-no-color", "-var", "root_key=" + base64.StdEncoding.EncodeToString(root), "-var", "lab_dir=" + labDir}
		tf := func(args ...string) ([]byte, error) {
			cmd := exec.Command(os.Getenv("TF_ACC_TERRAFORM_PATH"), args...)
			cmd.Dir = work
			cmd.Env = append(os.Environ(), "TF_IN_AUTOMATION=1")
			var out, errOut bytes.Buffer
			cmd.Stdout, cmd.Stderr = &out, &errOut
			if err := cmd.Run(); err != nil {
				return out.Bytes(), fmt.Errorf("terraform %s: %w\n%s\n%s", args[0], err, out.Bytes(), errOut.Bytes())
			}
			return out.Bytes(), nil
		}
		if _, err := tf("init", "-input=false", "-no-color"); err != nil {
			return err
		}
		if _, err := tf(append([]string{"apply", "-auto-approve"}, vars...)...); err != nil {
			return err
		}
		if out, err := tf(append([]string{"plan", "-detailed-exitcode"}, vars...)...); err != nil {
			return fmt.Errorf("the plan after the import is not empty: %w\n%s", err, out)
		}
		shown, err := tf("show", "-json")
		if err != nil {
			return err
		}
		imported, err := stateValues(shown)
		if err != nil {
			return err
		}
		for _, c := range []struct {
			address string
			attrs   []string
		}{
			{"berth_secrets.lab", []string{"cluster_id", "kubernetes_ca_certificate", "join_ca_certificate", "kubernetes_ca_pin",
				"join_ca_pin", "init_secret_hash", "ca_validity_days", "root_key_wo_version"}},
			{"berth_cluster.lab", []string{"cluster_id", "endpoint", "cluster_name", "kubernetes_version", "api_server_endpoint",
				"pod_network", "kubernetes_ca_certificate", "join_ca_certificate"}},
		} {
			made, ok := s.RootModule().Resources[c.address]
			if !ok {
				return fmt.Errorf("%s is not in the example's state", c.address)
			}
			for _, attr := range c.attrs {
				got, want := fmt.Sprint(imported[c.address][attr]), made.Primary.Attributes[attr]
				if got != want {
					return fmt.Errorf("imported %s.%s = %q, but the state that made the cluster has %q", c.address, attr, got, want)
				}
			}
		}
		return nil
	}
}

// stateValues is each root-module resource's values in `terraform show -json` output, by address.
func stateValues(shown []byte) (map[string]map[string]any, error) {
	var doc struct {
		Values struct {
			RootModule struct {
				Resources []struct {
					Address string         `json:"address"`
					Values  map[string]any `json:"values"`
				} `json:"resources"`
			} `json:"root_module"`
		} `json:"values"`
	}
	if err := json.Unmarshal(shown, &doc); err != nil {
		return nil, fmt.Errorf("terraform show -json: %w", err)
	}
	out := map[string]map[string]any{}
	for _, r := range doc.Values.RootModule.Resources {
		out[r.Address] = r.Values
	}
	if len(out) == 0 {
		return nil, errors.New("terraform show -json lists no resource")
	}
	return out, nil
}
