// Package release tests Berth's release archives as a user installs them: scripts/release.sh (make release)
// builds them for this machine's platform, the real terraform installs the provider's zip from a filesystem
// mirror and plans an example with it, and the real packer finds the plugin unpacked from its zip the way
// packer init lays it out, and validates a template with it.
package release

import (
	"archive/zip"
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/hashicorp/hcl/v2"
	"github.com/hashicorp/hcl/v2/hclsyntax"

	"github.com/berthlabs/berth/internal/repotest"
)

const platform = runtime.GOOS + "_" + runtime.GOARCH

// release runs scripts/release.sh, as make release does, for this machine's platform only into a directory
// of the test's, and returns that directory and the version it built: the newest in CHANGELOG.md, which the
// script insists on.
func release(t *testing.T) (dist, version string) {
	t.Helper()
	version = changelogVersion(t)
	dist = t.TempDir()
	t.Setenv("VERSION", version)
	t.Setenv("RELEASE_PLATFORMS", runtime.GOOS+"/"+runtime.GOARCH)
	t.Setenv("RELEASE_DIST", dist)
	if got := repotest.Script(t, "release.sh", "go, zip and sha256sum; make release"); got != dist {
		t.Fatalf("release.sh says it wrote the archives to %s, not RELEASE_DIST %s", got, dist)
	}
	return dist, version
}

// changelogVersion is the version of CHANGELOG.md's first section, "## 0.1.0 (Unreleased)".
func changelogVersion(t *testing.T) string {
	t.Helper()
	changelog, err := os.ReadFile(filepath.Join(repotest.Root(t), "CHANGELOG.md"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^## ([0-9]+\.[0-9]+\.[0-9]+\S*)`).FindSubmatch(changelog)
	if m == nil {
		t.Fatal("CHANGELOG.md has no section headed ## <version>")
	}
	return string(m[1])
}

// checkSums reads the SHA256SUMS file and checks that it lists exactly want, each with the sha256 of the file
// of that name beside it, as terraform's and packer's installers check an archive against it.
func checkSums(t *testing.T, dist, sumsName string, want ...string) {
	t.Helper()
	sums, err := os.ReadFile(filepath.Join(dist, sumsName))
	if err != nil {
		t.Fatalf("the release has no %s: %v", sumsName, err)
	}
	var names []string
	for _, line := range strings.Split(strings.TrimSuffix(string(sums), "\n"), "\n") {
		sum, name, ok := strings.Cut(line, "  ")
		if !ok {
			t.Fatalf("%s: line %q is not <sha256>  <name>", sumsName, line)
		}
		if got := fileSHA256(t, filepath.Join(dist, name)); got != sum {
			t.Errorf("%s says %s has sha256 %s; it has %s", sumsName, name, sum, got)
		}
		names = append(names, name)
	}
	sort.Strings(want)
	if !slices.Equal(names, want) {
		t.Fatalf("%s lists %q, want %q", sumsName, names, want)
	}
}

func fileSHA256(t *testing.T, name string) string {
	t.Helper()
	data, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(data)
	return hex.EncodeToString(sum[:])
}

// zipEntries returns the archive's files by name, with their content and mode.
func zipEntries(t *testing.T, name string) map[string]*zip.File {
	t.Helper()
	r, err := zip.OpenReader(name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	files := map[string]*zip.File{}
	for _, f := range r.File {
		files[f.Name] = f
	}
	return files
}

func readZipped(t *testing.T, f *zip.File) []byte {
	t.Helper()
	rc, err := f.Open()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	data, err := io.ReadAll(rc)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// hash1 is Terraform's "h1:" package hash of a provider zip (Go's dirhash Hash1 over the archive's files),
// what a lock file records for a package installed from a filesystem mirror.
func hash1(t *testing.T, files map[string]*zip.File) string {
	t.Helper()
	names := make([]string, 0, len(files))
	for name := range files {
		names = append(names, name)
	}
	sort.Strings(names)
	summary := sha256.New()
	for _, name := range names {
		sum := sha256.Sum256(readZipped(t, files[name]))
		fmt.Fprintf(summary, "%x  %s\n", sum, name)
	}
	return "h1:" + base64.StdEncoding.EncodeToString(summary.Sum(nil))
}

// run runs a command in dir with env (and nothing of the caller's Terraform or Packer settings) and returns
// what it printed; it fails t when the command does not exit 0, unless failing is expected.
func run(t *testing.T, dir string, env []string, expectFailure bool, name string, args ...string) string {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	cmd.Env = env
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	if expectFailure && err == nil {
		t.Fatalf("%s %s succeeded, want a failure:\n%s", filepath.Base(name), strings.Join(args, " "), out.Bytes())
	}
	if !expectFailure && err != nil {
		t.Fatalf("%s %s: %v\n%s", filepath.Base(name), strings.Join(args, " "), err, out.Bytes())
	}
	return out.String()
}

// cleanEnv is the process's environment without any TF_ or PACKER_ setting (dev_overrides in a CLI config,
// reattached providers, plugin caches and paths), with a HOME of the test's so that no ~/.terraformrc,
// ~/.terraform.d or ~/.packer.d of the machine is read, plus extra.
func cleanEnv(t *testing.T, extra ...string) []string {
	t.Helper()
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "TF_") && !strings.HasPrefix(kv, "PACKER_") && !strings.HasPrefix(kv, "HOME=") {
			env = append(env, kv)
		}
	}
	return append(env, append([]string{"HOME=" + t.TempDir(), "CHECKPOINT_DISABLE=1"}, extra...)...)
}

// TestProviderArchiveInstalls installs the provider's release zip the way a machine without the registry
// does: copied into a filesystem mirror that the CLI configuration names as the only installation method for
// berthlabs/berth. The real terraform init must install it from there, as registry.terraform.io/berthlabs/berth
// at the release's version with the zip's own h1 hash in the lock file, and plan the berth_image example,
// copied alone, with it; the release's checksums and registry manifest must be those the registry asks for.
func TestProviderArchiveInstalls(t *testing.T) {
	dist, version := release(t)
	repotest.NeedsTools(t, "terraform")
	const name = "terraform-provider-berth"
	zipName := fmt.Sprintf("%s_%s_%s.zip", name, version, platform)
	manifestName := fmt.Sprintf("%s_%s_manifest.json", name, version)
	checkSums(t, dist, fmt.Sprintf("%s_%s_SHA256SUMS", name, version), zipName, manifestName)

	var manifest struct {
		Version  int `json:"version"`
		Metadata struct {
			ProtocolVersions []string `json:"protocol_versions"`
		} `json:"metadata"`
	}
	data, err := os.ReadFile(filepath.Join(dist, manifestName))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(data, &manifest); err != nil {
		t.Fatalf("%s: %v", manifestName, err)
	}
	// main.go serves the provider with terraform-plugin-framework's providerserver: protocol 6.
	if manifest.Version != 1 || !slices.Equal(manifest.Metadata.ProtocolVersions, []string{"6.0"}) {
		t.Errorf("%s: version %d, protocol versions %q; want version 1 and [6.0]", manifestName, manifest.Version, manifest.Metadata.ProtocolVersions)
	}

	files := zipEntries(t, filepath.Join(dist, zipName))
	binary := fmt.Sprintf("%s_v%s", name, version)
	var entries []string
	for entry := range files {
		entries = append(entries, entry)
	}
	sort.Strings(entries)
	if want := []string{"CHANGELOG.md", "LICENSE", "README.md", binary}; !slices.Equal(entries, want) {
		t.Fatalf("%s holds %q, want %q", zipName, entries, want)
	}
	if mode := files[binary].Mode(); mode&0o111 == 0 {
		t.Errorf("%s in %s has mode %v: not executable", binary, zipName, mode)
	}
	license, err := os.ReadFile(filepath.Join(repotest.Root(t), "LICENSE"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(readZipped(t, files["LICENSE"]), license) {
		t.Errorf("the LICENSE in %s is not the repository's", zipName)
	}

	// The packed layout of a filesystem mirror: HOSTNAME/NAMESPACE/TYPE/<the release's zip, as named>.
	mirror := t.TempDir()
	mirrored := filepath.Join(mirror, "registry.terraform.io", "berthlabs", "berth", zipName)
	if err := os.MkdirAll(filepath.Dir(mirrored), 0o755); err != nil {
		t.Fatal(err)
	}
	zipped, err := os.ReadFile(filepath.Join(dist, zipName))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(mirrored, zipped, 0o644); err != nil {
		t.Fatal(err)
	}
	cliConfig := filepath.Join(t.TempDir(), "terraform.tfrc")
	conf := fmt.Sprintf(`provider_installation {
  filesystem_mirror {
    path    = %q
    include = ["registry.terraform.io/berthlabs/berth"]
  }
  direct {
    exclude = ["registry.terraform.io/berthlabs/berth"]
  }
}
`, mirror)
	if err := os.WriteFile(cliConfig, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	env := cleanEnv(t, "TF_CLI_CONFIG_FILE="+cliConfig, "TF_IN_AUTOMATION=1")

	// The example exactly as the documentation shows it, with the Packer manifest it reads.
	work := t.TempDir()
	example, err := os.ReadFile(filepath.Join(repotest.Root(t), "examples", "data-sources", "berth_image", "data-source.tf"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(work, "main.tf"), example, 0o600); err != nil {
		t.Fatal(err)
	}
	pcr11 := strings.Repeat("b1", 32)
	imageManifest := fmt.Sprintf(`{"version": 1, "images": [{"name": "berth-2026-11-22", "builder": "qemu",
  "artifact_id": "output/berth.qcow2", "region": "", "pcrs": {"11": %q}}]}`, pcr11)
	if err := os.WriteFile(filepath.Join(work, "berth-image.json"), []byte(imageManifest), 0o600); err != nil {
		t.Fatal(err)
	}

	out := run(t, work, env, false, "terraform", "init", "-no-color", "-input=false")
	for _, want := range []string{
		"Finding latest version of berthlabs/berth...",
		"Installing berthlabs/berth v" + version + "...",
		"Installed berthlabs/berth v" + version,
		"Terraform has been successfully initialized!",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("terraform init did not say %q:\n%s", want, out)
		}
	}
	lockedVersion, hashes := lockedProvider(t, filepath.Join(work, ".terraform.lock.hcl"), "registry.terraform.io/berthlabs/berth")
	if lockedVersion != version {
		t.Errorf("the lock file has registry.terraform.io/berthlabs/berth at %s, want %s", lockedVersion, version)
	}
	if want := hash1(t, files); !slices.Contains(hashes, want) {
		t.Errorf("the lock file's hashes for berthlabs/berth are %q; want the zip's %s among them", hashes, want)
	}
	installed := filepath.Join(work, ".terraform", "providers", "registry.terraform.io", "berthlabs", "berth", version, platform, binary)
	if got, want := fileSHA256(t, installed), fmt.Sprintf("%x", sha256.Sum256(readZipped(t, files[binary]))); got != want {
		t.Errorf("terraform installed %s with sha256 %s; the zip's binary has %s", installed, got, want)
	}

	out = run(t, work, env, false, "terraform", "plan", "-no-color", "-input=false", "-out=tfplan")
	if !strings.Contains(out, "Changes to Outputs:") || !strings.Contains(out, pcr11) {
		t.Errorf("terraform plan shows no output with PCR 11 %s:\n%s", pcr11, out)
	}
	var plan struct {
		OutputChanges map[string]struct {
			After json.RawMessage `json:"after"`
		} `json:"output_changes"`
	}
	planJSON := run(t, work, env, false, "terraform", "show", "-json", "tfplan")
	if err := json.Unmarshal([]byte(planJSON), &plan); err != nil {
		t.Fatalf("terraform show -json: %v\n%s", err, planJSON)
	}
	for output, want := range map[string]string{
		"images": `["berth-2026-11-22"]`,
		"pcrs":   fmt.Sprintf(`{"11":%q}`, pcr11),
	} {
		if got := string(plan.OutputChanges[output].After); got != want {
			t.Errorf("the plan's output %s is %s, want %s", output, got, want)
		}
	}

	var schema struct {
		Schemas map[string]struct {
			Resources          map[string]json.RawMessage `json:"resource_schemas"`
			DataSources        map[string]json.RawMessage `json:"data_source_schemas"`
			EphemeralResources map[string]json.RawMessage `json:"ephemeral_resource_schemas"`
		} `json:"provider_schemas"`
	}
	schemaJSON := run(t, work, env, false, "terraform", "providers", "schema", "-json")
	if err := json.Unmarshal([]byte(schemaJSON), &schema); err != nil {
		t.Fatalf("terraform providers schema -json: %v", err)
	}
	berth, ok := schema.Schemas["registry.terraform.io/berthlabs/berth"]
	if !ok {
		t.Fatalf("terraform providers schema -json has no registry.terraform.io/berthlabs/berth:\n%s", schemaJSON)
	}
	t.Run("changelog", func(t *testing.T) {
		changelogLists(t, "Resource", keys(berth.Resources))
		changelogLists(t, "Data Source", keys(berth.DataSources))
		changelogLists(t, "Ephemeral Resource", keys(berth.EphemeralResources))
	})
}

// lockedProvider reads a provider's version and hashes from a dependency lock file.
func lockedProvider(t *testing.T, lockFile, address string) (version string, hashes []string) {
	t.Helper()
	src, err := os.ReadFile(lockFile)
	if err != nil {
		t.Fatalf("terraform init wrote no lock file: %v", err)
	}
	parsed, diags := hclsyntax.ParseConfig(src, lockFile, hcl.InitialPos)
	if diags.HasErrors() {
		t.Fatal(diags)
	}
	for _, block := range parsed.Body.(*hclsyntax.Body).Blocks {
		if block.Type != "provider" || len(block.Labels) != 1 || block.Labels[0] != address {
			continue
		}
		attrs := block.Body.Attributes
		if attrs["version"] == nil || attrs["hashes"] == nil {
			t.Fatalf("%s: the provider block for %s has no version or no hashes:\n%s", lockFile, address, src)
		}
		v, diags := attrs["version"].Expr.Value(nil)
		if diags.HasErrors() {
			t.Fatal(diags)
		}
		h, diags := attrs["hashes"].Expr.Value(nil)
		if diags.HasErrors() {
			t.Fatal(diags)
		}
		for _, hash := range h.AsValueSlice() {
			hashes = append(hashes, hash.AsString())
		}
		return v.AsString(), hashes
	}
	t.Fatalf("%s locks no provider %s:\n%s", lockFile, address, src)
	return "", nil
}

func keys[V any](m map[string]V) []string {
	names := make([]string, 0, len(m))
	for name := range m {
		names = append(names, name)
	}
	return names
}

// changelogLists checks that CHANGELOG.md announces exactly these components of a kind, each in a
// "* **New <kind>:** `<name>`" line, as HashiCorp's changelogs do: what the release ships, read from the
// installed programs themselves, is what its notes say.
func changelogLists(t *testing.T, kind string, shipped []string) {
	t.Helper()
	f, err := os.Open(filepath.Join(repotest.Root(t), "CHANGELOG.md"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	prefix := "* **New " + kind + ":** `"
	var announced []string
	scanner := bufio.NewScanner(f)
	for scanner.Scan() {
		if rest, ok := strings.CutPrefix(scanner.Text(), prefix); ok {
			name, _, _ := strings.Cut(rest, "`")
			announced = append(announced, name)
		}
	}
	if err := scanner.Err(); err != nil {
		t.Fatal(err)
	}
	if len(shipped) == 0 {
		t.Fatalf("the release ships no %s: the program's own listing is empty", kind)
	}
	sort.Strings(announced)
	sort.Strings(shipped)
	if !slices.Equal(announced, shipped) {
		t.Errorf("CHANGELOG.md announces the %ss %q; the release ships %q", kind, announced, shipped)
	}
}

// TestPackerPluginArchiveInstalls installs the plugin's release zip as Packer 1.9's packer init does after
// downloading it: the zip checked against the release's SHA256SUMS, the one binary of the archive's own name
// unpacked into <plugin dir>/github.com/berthlabs/berth/ beside a _SHA256SUM file of its hex sha256. The real
// packer (make packer-tools) must then find it: packer init has nothing to fetch for a template that
// requires github.com/berthlabs/berth at the release's version, packer plugins installed lists it, and
// packer validate starts it to check a berth-manifest post-processor, accepting a valid one and reporting
// the plugin's own error for one without image_name.
func TestPackerPluginArchiveInstalls(t *testing.T) {
	dist, version := release(t)
	packerBin := repotest.BinDir(t, "BERTH_PACKER_BIN", "build-packer.sh", "Packer v1.9.4 built from test/packertools")
	packer := filepath.Join(packerBin, "packer")
	const name = "packer-plugin-berth"

	zips, err := filepath.Glob(filepath.Join(dist, fmt.Sprintf("%s_v%s_x*_%s.zip", name, version, platform)))
	if err != nil {
		t.Fatal(err)
	}
	if len(zips) != 1 {
		t.Fatalf("want one %s_v%s_x<api>_%s.zip in the release, found %q", name, version, platform, zips)
	}
	zipName := filepath.Base(zips[0])
	checkSums(t, dist, fmt.Sprintf("%s_v%s_SHA256SUMS", name, version), zipName)

	binary := strings.TrimSuffix(zipName, ".zip")
	files := zipEntries(t, zips[0])
	if len(files) != 1 || files[binary] == nil {
		t.Fatalf("%s holds %q; packer init wants exactly %s", zipName, keys(files), binary)
	}
	pluginDir := t.TempDir()
	installed := filepath.Join(pluginDir, "github.com", "berthlabs", "berth", binary)
	if err := os.MkdirAll(filepath.Dir(installed), 0o755); err != nil {
		t.Fatal(err)
	}
	content := readZipped(t, files[binary])
	if err := os.WriteFile(installed, content, 0o755); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(content)
	if err := os.WriteFile(installed+"_SHA256SUM", []byte(hex.EncodeToString(sum[:])), 0o555); err != nil {
		t.Fatal(err)
	}

	// The name's API version must be the one the binary speaks: packer refuses a plugin whose name says
	// another, and packer-plugin-sdk decides it, not the release script.
	var describe struct {
		Version        string   `json:"version"`
		APIVersion     string   `json:"api_version"`
		Builders       []string `json:"builders"`
		Provisioners   []string `json:"provisioners"`
		PostProcessors []string `json:"post_processors"`
	}
	described := run(t, pluginDir, cleanEnv(t), false, installed, "describe")
	if err := json.Unmarshal([]byte(described), &describe); err != nil {
		t.Fatalf("%s describe: %v\n%s", binary, err, described)
	}
	if want := fmt.Sprintf("%s_v%s_%s_%s", name, describe.Version, describe.APIVersion, platform); binary != want {
		t.Errorf("the release names the plugin %s; by its own description (%s) it is %s", binary, strings.TrimSpace(described), want)
	}

	env := cleanEnv(t, "PACKER_PLUGIN_PATH="+pluginDir)
	work := t.TempDir()
	template := func(imageName string) string {
		return fmt.Sprintf(`packer {
  required_plugins {
    berth = {
      version = "= %s"
      source  = "github.com/berthlabs/berth"
    }
  }
}

source "null" "image" {
  communicator = "none"
}

build {
  sources = ["source.null.image"]

  post-processor "berth-manifest" {
    image_name = %q
  }
}
`, version, imageName)
	}
	if err := os.WriteFile(filepath.Join(work, "image.pkr.hcl"), []byte(template("berth-2026-11-26")), 0o600); err != nil {
		t.Fatal(err)
	}
	out := run(t, work, env, false, packer, "init", "image.pkr.hcl")
	if strings.Contains(out, "Installed plugin") {
		t.Errorf("packer init installed a plugin: it did not find the unpacked release:\n%s", out)
	}
	out = run(t, work, env, false, packer, "plugins", "installed")
	if strings.TrimSpace(out) != installed {
		t.Errorf("packer plugins installed lists %q, want only %s", strings.TrimSpace(out), installed)
	}
	out = run(t, work, env, false, packer, "validate", "image.pkr.hcl")
	if !strings.Contains(out, "The configuration is valid.") {
		t.Errorf("packer validate did not find the template valid:\n%s", out)
	}
	if err := os.WriteFile(filepath.Join(work, "image.pkr.hcl"), []byte(template("")), 0o600); err != nil {
		t.Fatal(err)
	}
	out = run(t, work, env, true, packer, "validate", "image.pkr.hcl")
	if !strings.Contains(out, "image_name is required") {
		t.Errorf("packer validate of a berth-manifest without image_name did not report the plugin's error:\n%s", out)
	}

	t.Run("changelog", func(t *testing.T) {
		changelogLists(t, "Builder", prefixed(describe.Builders))
		changelogLists(t, "Provisioner", prefixed(describe.Provisioners))
		changelogLists(t, "Post-Processor", prefixed(describe.PostProcessors))
	})
}

// prefixed is the names templates use for the plugin's components: berth-<name>.
func prefixed(components []string) []string {
	names := make([]string, len(components))
	for i, c := range components {
		names[i] = "berth-" + c
	}
	return names
}

// TestPackerExamplesRequirePlugin checks that every Packer template under examples/ requires the plugin by
// its source, github.com/berthlabs/berth, in its packer block's required_plugins: without it packer init
// installs nothing for a template copied alone, and packer build cannot find the berth components.
func TestPackerExamplesRequirePlugin(t *testing.T) {
	templates, err := filepath.Glob(filepath.Join(repotest.Root(t), "examples", "*", "*.pkr.hcl"))
	if err != nil {
		t.Fatal(err)
	}
	// examples/packer: local, node, qemu, aws and gcp.
	if len(templates) < 5 {
		t.Fatalf("found %d Packer templates under examples/, want at least 5: %q", len(templates), templates)
	}
	for _, template := range templates {
		t.Run(filepath.Base(template), func(t *testing.T) {
			src, err := os.ReadFile(template)
			if err != nil {
				t.Fatal(err)
			}
			parsed, diags := hclsyntax.ParseConfig(src, template, hcl.InitialPos)
			if diags.HasErrors() {
				t.Fatal(diags)
			}
			var sources []string
			for _, block := range parsed.Body.(*hclsyntax.Body).Blocks {
				if block.Type != "packer" {
					continue
				}
				for _, inner := range block.Body.Blocks {
					attr := inner.Body.Attributes["berth"]
					if inner.Type != "required_plugins" || attr == nil {
						continue
					}
					value, diags := attr.Expr.Value(nil)
					if diags.HasErrors() {
						t.Fatalf("required_plugins.berth: %s", diags)
					}
					if !value.Type().IsObjectType() || !value.Type().HasAttribute("source") {
						t.Fatalf("required_plugins.berth is %s, want an object with a source", value.GoString())
					}
					sources = append(sources, value.GetAttr("source").AsString())
				}
			}
			if len(sources) != 1 || sources[0] != "github.com/berthlabs/berth" {
				t.Errorf("required_plugins.berth sources are %q, want exactly one, github.com/berthlabs/berth", sources)
			}
		})
	}
}
