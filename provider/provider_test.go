package provider

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/hashicorp/terraform-plugin-framework/providerserver"
	"github.com/hashicorp/terraform-plugin-go/tfprotov6"
	"github.com/hashicorp/terraform-plugin-testing/echoprovider"
)

// TestMain points the Terraform CLI that the tests drive at an empty CLI configuration of their own. The
// environment's TF_CLI_CONFIG_FILE names a file that may not exist (Terraform then warns on every command)
// or may hold an operator's settings (dev_overrides, plugin cache, credentials) that would change what the
// tests run; an empty file makes every run the same. The tests use the terraform found on PATH and never
// ask checkpoint.hashicorp.com for versions: the machines that run them have no network.
func TestMain(m *testing.M) {
	code, err := setUpTerraform(m)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Exit(code)
}

// testDir is removed when the tests end; the provider binary built for the CLI tests goes there.
var testDir string

func setUpTerraform(m *testing.M) (int, error) {
	if os.Getenv("TF_ACC_TERRAFORM_PATH") == "" {
		tf, err := exec.LookPath("terraform")
		if err != nil {
			return 0, fmt.Errorf("terraform not found on PATH: the provider tests need the Terraform CLI (1.11 or later): %w", err)
		}
		os.Setenv("TF_ACC_TERRAFORM_PATH", tf)
	}
	dir, err := os.MkdirTemp("", "berth-provider-test-")
	if err != nil {
		return 0, err
	}
	defer os.RemoveAll(dir)
	testDir = dir
	cliConfig := filepath.Join(dir, "terraformrc")
	if err := os.WriteFile(cliConfig, nil, 0o600); err != nil {
		return 0, err
	}
	os.Setenv("TF_CLI_CONFIG_FILE", cliConfig)
	os.Setenv("CHECKPOINT_DISABLE", "1")
	return m.Run(), nil
}

// providers serves the provider in-process to the Terraform CLI of terraform-plugin-testing.
var providers = map[string]func() (tfprotov6.ProviderServer, error){
	"berth": providerserver.NewProtocol6WithError(New("test")()),
}

// providersWithEcho adds the echo provider, which copies ephemeral values into state so that a test can
// look at them; only tests do that.
var providersWithEcho = map[string]func() (tfprotov6.ProviderServer, error){
	"berth": providerserver.NewProtocol6WithError(New("test")()),
	"echo":  echoprovider.NewProviderServer(),
}
