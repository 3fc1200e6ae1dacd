package provider

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// requiredProviders is what every example but the provider's own leaves out, as documentation snippets do.
const requiredProviders = `terraform {
  required_providers {
    berth = {
      source = "berthlabs/berth"
    }
  }
}
`

// TestExamplesValidate checks that the examples that tfplugindocs puts in the documentation are formatted
// and valid against the provider's real schema.
func TestExamplesValidate(t *testing.T) {
	dirs, err := filepath.Glob("../examples/*/berth_*")
	if err != nil {
		t.Fatal(err)
	}
	dirs = append(dirs, "../examples/provider", "../examples/lab")
	if len(dirs) < 5 {
		t.Fatalf("found %d example directories, want at least 5", len(dirs))
	}
	runTerraform(t, "..", "fmt", "-check", "-recursive", "-diff", "examples")
	for _, dir := range dirs {
		t.Run(filepath.ToSlash(strings.TrimPrefix(dir, "../examples/")), func(t *testing.T) {
			files, err := filepath.Glob(filepath.Join(dir, "*.tf"))
			if err != nil || len(files) == 0 {
				t.Fatalf("no .tf files in %s (%v)", dir, err)
			}
			work := t.TempDir()
			for _, f := range files {
				data, err := os.ReadFile(f)
				if err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(filepath.Join(work, filepath.Base(f)), data, 0o600); err != nil {
					t.Fatal(err)
				}
			}
			if base := filepath.Base(dir); base != "provider" && base != "lab" {
				if err := os.WriteFile(filepath.Join(work, "versions.tf"), []byte(requiredProviders), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			runTerraform(t, work, "validate", "-no-color")
		})
	}
}
