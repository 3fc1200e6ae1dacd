package provider

import (
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hashicorp/hcl/v2"
	"github.com/hashicorp/hcl/v2/hclsyntax"
	"github.com/zclconf/go-cty/cty"
)

// TestExamplesValidate checks that the examples that tfplugindocs puts in the documentation are formatted
// and valid against the provider's real schema, each directory copied alone as a user would copy it: with
// nothing added, its own required_providers must name berthlabs/berth, or terraform looks for hashicorp/berth.
func TestExamplesValidate(t *testing.T) {
	t.Parallel()
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
			runTerraform(t, work, "validate", "-no-color")
		})
	}
}

// exampleDirs are the directories under examples/ that hold Terraform configuration: each is a module a
// user may copy alone.
func exampleDirs(t *testing.T) []string {
	t.Helper()
	var dirs []string
	err := filepath.WalkDir("../examples", func(path string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return err
		}
		files, err := filepath.Glob(filepath.Join(path, "*.tf"))
		if len(files) > 0 {
			dirs = append(dirs, path)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	// resources/*, data-sources/*, ephemeral-resources/*, provider, lab, aws and gcp.
	if len(dirs) < 10 {
		t.Fatalf("found %d example directories with .tf files, want at least 10: %v", len(dirs), dirs)
	}
	return dirs
}

// TestExamplesDeclareProvider checks every example directory, those that need other providers (aws, gcp)
// included, which no test here can init: one of its files has a terraform block whose required_providers
// gives berth the source berthlabs/berth. Without it an example copied alone fails at terraform init, which
// looks for hashicorp/berth.
func TestExamplesDeclareProvider(t *testing.T) {
	t.Parallel()
	for _, dir := range exampleDirs(t) {
		t.Run(filepath.ToSlash(strings.TrimPrefix(dir, "../examples/")), func(t *testing.T) {
			files, err := filepath.Glob(filepath.Join(dir, "*.tf"))
			if err != nil {
				t.Fatal(err)
			}
			var sources []string
			for _, f := range files {
				sources = append(sources, berthSources(t, f)...)
			}
			if len(sources) != 1 || sources[0] != "berthlabs/berth" {
				t.Errorf("%s: berth's required_providers sources are %q, want exactly one, berthlabs/berth", dir, sources)
			}
		})
	}
}

// berthSources returns the source of every berth entry in the terraform blocks' required_providers of file.
func berthSources(t *testing.T, file string) []string {
	t.Helper()
	src, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	parsed, diags := hclsyntax.ParseConfig(src, file, hcl.InitialPos)
	if diags.HasErrors() {
		t.Fatal(diags)
	}
	var sources []string
	for _, block := range parsed.Body.(*hclsyntax.Body).Blocks {
		if block.Type != "terraform" {
			continue
		}
		for _, inner := range block.Body.Blocks {
			if inner.Type != "required_providers" {
				continue
			}
			attr, ok := inner.Body.Attributes["berth"]
			if !ok {
				continue
			}
			value, diags := attr.Expr.Value(nil)
			if diags.HasErrors() {
				t.Fatalf("%s: required_providers.berth: %s", file, diags)
			}
			if !value.Type().IsObjectType() || !value.Type().HasAttribute("source") {
				t.Fatalf("%s: required_providers.berth is %s, want an object with a source", file, value.GoString())
			}
			source := value.GetAttr("source")
			if source.Type() != cty.String || !source.IsKnown() || source.IsNull() {
				t.Fatalf("%s: required_providers.berth.source is %s, want a string", file, source.GoString())
			}
			sources = append(sources, source.AsString())
		}
	}
	return sources
}
