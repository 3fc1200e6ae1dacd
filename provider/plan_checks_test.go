package provider

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-testing/config"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"

	"github.com/berthlabs/berth/internal/kubeadm"
	"github.com/berthlabs/berth/test/swtpm/swtpmtest"
)

// cliProvider makes a configuration run the provider binary that devOverrides builds.
const cliProvider = `
terraform {
  required_providers {
    berth = {
      source = "berthlabs/berth"
    }
  }
}
`

// planCLI writes main.tf into a new directory and runs the real terraform there against the built provider,
// with env added; it returns what terraform printed, stdout then stderr, and whether it succeeded.
func planCLI(t *testing.T, mainTF string, env []string, args ...string) (string, error) {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "main.tf"), []byte(mainTF), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Getenv("TF_ACC_TERRAFORM_PATH"), args...)
	cmd.Dir = dir
	cmd.Env = append(append(os.Environ(), "TF_CLI_CONFIG_FILE="+devOverrides(t), "TF_IN_AUTOMATION=1"), env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.String(), err
}

// diagnostic matches terraform's output of an error or warning with summary whose detail holds detail,
// however terraform wraps its lines.
func diagnostic(summary, detail string) *regexp.Regexp {
	return regexp.MustCompile(`(?s)` + phrase(summary).String() + `\s+with .*?` + phrase(detail).String())
}

// validateDiag is one diagnostic of `terraform validate -json`.
type validateDiag struct {
	Severity string `json:"severity"`
	Summary  string `json:"summary"`
	Detail   string `json:"detail"`
	Range    *struct {
		Start struct {
			Line int `json:"line"`
		} `json:"start"`
	} `json:"range"`
}

// validateJSON runs `terraform validate -json` on mainTF and returns its diagnostics.
func validateJSON(t *testing.T, mainTF string) []validateDiag {
	t.Helper()
	out, _ := planCLI(t, mainTF, nil, "validate", "-json", "-no-color")
	var res struct {
		Diagnostics []validateDiag `json:"diagnostics"`
	}
	// Terraform prints a warning about dev_overrides before the JSON document.
	start := strings.Index(out, "{")
	if start < 0 {
		t.Fatalf("terraform validate -json printed no JSON:\n%s", out)
	}
	if err := json.NewDecoder(strings.NewReader(out[start:])).Decode(&res); err != nil {
		t.Fatalf("terraform validate -json: %v\n%s", err, out)
	}
	return res.Diagnostics
}

// lineOf is the line of mainTF, from 1, on which marker is.
func lineOf(t *testing.T, mainTF, marker string) int {
	t.Helper()
	i := strings.Index(mainTF, marker)
	if i < 0 || strings.Count(mainTF, marker) != 1 {
		t.Fatalf("marker %q is not once in the configuration", marker)
	}
	return strings.Count(mainTF[:i], "\n") + 1
}

// TestJoinPolicyAllMistakesAtOnce checks, with the real terraform and the built provider, that one validate
// of a policy with a mistake in every field of an image, and more in other images, reports every mistake,
// naming the image and the value; and that an image already expired is a warning naming it. Terraform 1.11
// shows a diagnostic inside a list of objects at the resource block; TestJoinPolicyDiagnosticPaths checks
// the paths the provider gives.
func TestJoinPolicyAllMistakesAtOnce(t *testing.T) {
	t.Parallel()
	mainTF := cliProvider + fmt.Sprintf(`
resource "berth_join_policy" "this" {
  images = [
    {
      name  = "berth-2026-11-22"
      roles = ["worker", "admin"]
      pcrs = {
        "24" = %[1]q
        "9"  = "ABC"
      }
      expires = "2027-01-01"
      kubernetes_version = "1.36.3"
    },
    {
      name    = "berth-2025-01-01"
      roles   = ["worker"]
      pcrs    = { "4" = %[1]q }
      expires = "2025-06-30T00:00:00Z"
    },
    {
      name  = "Berth_3"
      roles = []
      pcrs  = { "4" = %[1]q }
    },
  ]
}
`, pcr0)
	type want struct {
		severity, summary, detail string
	}
	wants := []want{
		{"error", "Invalid role", `Image "berth-2026-11-22" (images[0]): role "admin" is not "control-plane" or "worker".`},
		{"error", "Invalid PCR index", `Image "berth-2026-11-22" (images[0]): PCR index "24" is not a plain decimal number 0-23.`},
		{"error", "Invalid PCR value", `Image "berth-2026-11-22" (images[0]): PCR 9 must be 64 lowercase hex digits (a SHA-256 value), got "ABC".`},
		{"error", "Invalid expiry", `Image "berth-2026-11-22" (images[0]): expires is "2027-01-01", which is not an RFC 3339 time in UTC such as 2026-12-31T00:00:00Z.`},
		{"error", "Invalid Kubernetes version", `Image "berth-2026-11-22" (images[0]): kubernetes_version is "1.36.3": write the release with its "v", "v1.36.3"`},
		{"warning", "Image already expired", `Image "berth-2025-01-01" (images[1]) expired at 2025-06-30T00:00:00Z: the join services refuse every node of it.`},
		{"error", "Invalid image name", `images[2].name is "Berth_3": name has 'B' at position 0`},
		{"error", "No roles", `Image "Berth_3" (images[2]) has no roles: list "control-plane", "worker" or both.`},
	}
	blockLine := lineOf(t, mainTF, `resource "berth_join_policy" "this" {`)
	var diags []validateDiag
	for _, d := range validateJSON(t, mainTF) {
		if d.Summary != "Provider development overrides are in effect" {
			diags = append(diags, d)
		}
	}
	if len(diags) != len(wants) {
		t.Errorf("terraform validate gave %d diagnostics, want %d: %+v", len(diags), len(wants), diags)
	}
	for _, w := range wants {
		found := false
		for _, d := range diags {
			if d.Severity != w.severity || d.Summary != w.summary || !strings.Contains(d.Detail, w.detail) {
				continue
			}
			found = true
			if d.Range == nil || d.Range.Start.Line != blockLine {
				t.Errorf("%s %q is at %+v, want line %d (the resource)", w.severity, w.summary, d.Range, blockLine)
			}
		}
		if !found {
			t.Errorf("no %s %q with %q among %+v", w.severity, w.summary, w.detail, diags)
		}
	}
}

// TestJoinPolicyPlanNeedsKubeconfig checks with the real terraform that a join policy without the
// provider's kubeconfig is refused by plan, saying what to set, and that one whose kubeconfig is known only
// at apply (a berth_cluster of the same run) plans.
func TestJoinPolicyPlanNeedsKubeconfig(t *testing.T) {
	t.Parallel()
	policy := fmt.Sprintf(`
resource "berth_join_policy" "this" {
  images = [%s]
}
`, policyImage("berth-2026-11-22", `"worker"`, ""))
	resource.UnitTest(t, resource.TestCase{
		ProtoV6ProviderFactories: providers,
		Steps: []resource.TestStep{
			{
				Config:   policy,
				PlanOnly: true,
				ExpectError: diagnostic("Error: No cluster to write the join policy into", "berth_join_policy writes into the cluster "+
					"through the provider's kubeconfig, and the provider has none. Set it to the admin kubeconfig's "+
					"content, for example `provider \"berth\" { kubeconfig = berth_cluster.<name>.kubeconfig }`"),
			},
			{
				// timestamp() is known only at apply, as a new cluster's kubeconfig is.
				Config: `
resource "terraform_data" "cluster" {
  input = timestamp()
}

provider "berth" {
  kubeconfig = terraform_data.cluster.output
}
` + policy,
				PlanOnly:           true,
				ExpectNonEmptyPlan: true,
			},
		},
	})
}

// TestKubeconfigErrors checks with the real terraform and the built provider what an unusable kubeconfig
// says: what Berth needs, never client-go's advice to set KUBERNETES_MASTER, and never the kubeconfig.
func TestKubeconfigErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, kubeconfig, want string
	}{
		{"empty", `""`, "kubeconfig is empty. Berth needs the admin kubeconfig's content, such as " +
			"`kubeconfig = berth_cluster.<name>.kubeconfig`, or `file(\"admin.conf\")` for a cluster made elsewhere."},
		{"a path", `"~/.kube/config"`, "kubeconfig is one line that is not YAML, such as a file's path: it takes " +
			"the file's content, `kubeconfig = file(\"<path>\")`. Berth needs the admin kubeconfig's content"},
		{"no cluster", `"apiVersion: v1\nkind: Config\n"`, "The kubeconfig names no cluster. Berth needs the admin kubeconfig's content"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mainTF := cliProvider + `
provider "berth" {
  kubeconfig = ` + tc.kubeconfig + `
}

resource "berth_join_policy" "this" {
  images = []
}
`
			out, err := planCLI(t, mainTF, nil, "plan", "-input=false", "-no-color")
			if err == nil {
				t.Fatalf("terraform plan succeeded:\n%s", out)
			}
			if !phrase("Error: Invalid kubeconfig").MatchString(out) || !phrase(tc.want).MatchString(out) {
				t.Errorf("terraform plan says:\n%s\nwant: %s", out, tc.want)
			}
			if strings.Contains(out, "KUBERNETES_MASTER") {
				t.Errorf("terraform plan repeats client-go's advice:\n%s", out)
			}
		})
	}
}

// TestClusterPlanChecksVersionAndSubnets checks with the real terraform the plan-time refusals of
// kubernetes_version, the subnets and the endpoints, each naming the attribute and the value, and that one
// plan shows them all.
func TestClusterPlanChecksVersionAndSubnets(t *testing.T) {
	t.Parallel()
	ca := swtpmtest.NewCA(t)
	vars := config.Variables{
		"root_key": config.StringVariable(base64.StdEncoding.EncodeToString(make([]byte, 32))),
		"ek_ca":    config.StringVariable(string(ca.BundlePEM())),
	}
	good := clusterArgs("127.0.0.1:7451", "lab", zeroPCR11)
	planOnly := func(args string, want *regexp.Regexp) resource.TestStep {
		return resource.TestStep{Config: clusterConfig(args), ConfigVariables: vars, PlanOnly: true, ExpectError: want}
	}
	version := func(v string) string {
		return strings.Replace(good, `kubernetes_version = "v1.36.3"`, fmt.Sprintf("kubernetes_version = %q", v), 1)
	}
	resource.UnitTest(t, resource.TestCase{
		ProtoV6ProviderFactories: providers,
		Steps: []resource.TestStep{
			planOnly(version("1.36"), diagnostic("Error: Invalid Kubernetes version", `kubernetes_version is "1.36", a minor version: `+
				`an image carries one exact release, "v1.36.<patch>" such as "v1.36.3" (the release baked into the `+
				`image, data.berth_image.<name>.components.kubernetes).`)),
			planOnly(version("1.36.3"), phrase(`kubernetes_version is "1.36.3": write the release with its "v", "v1.36.3"`)),
			planOnly(version("latest"), phrase(`kubernetes_version is "latest", which is not a Kubernetes release such as "v1.36.3"`)),
			planOnly(good+`  pod_subnet = "10.244.0.0"`, diagnostic("Error: Invalid subnet", `pod_subnet is "10.244.0.0": 10.244.0.0 is an `+
				`address, not a CIDR: add the network's prefix length, "10.244.0.0/<length>" such as "10.244.0.0/16".`)),
			planOnly(good+`  service_subnet = "10.96.0.1/12"`, phrase(`service_subnet is "10.96.0.1/12": 10.96.0.1/12 has host bits set: the network is "10.96.0.0/12".`)),
			planOnly(good+`  pod_subnet = "10.96.0.0/16"`, diagnostic("Error: Overlapping subnets", `pod_subnet "10.96.0.0/16" and service_subnet's `+
				`default "10.96.0.0/12" (it is unset) overlap`)),
			planOnly(good+`  control_plane_endpoint = "api.example.com"`, diagnostic("Error: Invalid endpoint", `control_plane_endpoint is "api.example.com", `+
				`which is not host:port such as "api.example.com:6443": missing port in address.`)),
			planOnly(good+`  pod_network = "calico"`, diagnostic("Error: Unknown pod network", `pod_network is "calico"; it takes `+
				`one of flannel, none (none: you install a pod network yourself).`)),
			// Every mistake in one plan.
			planOnly(strings.Replace(version("1.36"), `"127.0.0.1:7451"`, `"127.0.0.1:0"`, 1)+`  pod_subnet = "10.244.0.0"`,
				regexp.MustCompile(`(?s)`+phrase(`endpoint is "127.0.0.1:0"`).String()+`.*`+
					phrase(`kubernetes_version is "1.36"`).String()+`.*`+phrase(`pod_subnet is "10.244.0.0"`).String())),
		},
	})
}

// TestClusterRefusesInitSettingChange initializes a cluster on a node with a real TPM (the test node), then
// checks with the real terraform that a plan changing an init setting, or kubernetes_version by a step the
// version skew policy forbids, fails with the reason and what to do, rather than planning a replacement, and
// that a change of what mattered only at init (pcrs, init_timeout) plans an update in place and keeps the
// cluster. Upgrades themselves are TestClusterUpgrade's.
func TestClusterRefusesInitSettingChange(t *testing.T) {
	t.Parallel()
	ca := swtpmtest.NewCA(t)
	node := startTestNode(t, ca.NewTPM(t))
	vars := config.Variables{
		"root_key": config.StringVariable(base64.StdEncoding.EncodeToString(make([]byte, 32))),
		"ek_ca":    config.StringVariable(string(ca.BundlePEM())),
	}
	args := clusterArgs(node, "lab", zeroPCR11) + clusterSecrets
	step := func(args string) resource.TestStep {
		return resource.TestStep{Config: clusterConfig(args), ConfigVariables: vars}
	}
	refused := func(args string, want *regexp.Regexp) resource.TestStep {
		s := step(args)
		s.PlanOnly, s.ExpectError = true, want
		return s
	}
	inPlace := step(strings.Replace(args, zeroPCR11, fmt.Sprintf(`{ "11" = %q }`, pcr9), 1) + `  init_timeout = "2m"`)
	inPlace.ConfigPlanChecks = resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{
		plancheck.ExpectResourceAction("berth_cluster.test", plancheck.ResourceActionUpdate)}}
	inPlace.Check = resource.ComposeTestCheckFunc(
		resource.TestCheckResourceAttr("berth_cluster.test", "pcrs.11", pcr9),
		resource.TestCheckResourceAttrSet("berth_cluster.test", "kubeconfig"),
		resource.TestCheckResourceAttrPair("berth_cluster.test", "cluster_id", "berth_secrets.test", "cluster_id"),
	)
	resource.UnitTest(t, resource.TestCase{
		ProtoV6ProviderFactories: providers,
		Steps: []resource.TestStep{
			func() resource.TestStep {
				s := step(args)
				s.Check = resource.ComposeTestCheckFunc(resource.TestCheckResourceAttrSet("berth_cluster.test", "kubeconfig"),
					resource.TestCheckResourceAttr("berth_cluster.test", "pod_network", "flannel"))
				return s
			}(),
			// The next minor and a patch are steps the version skew policy allows. This cluster's API server
			// does not answer: the plan cannot check the join policy and says so, and the apply refuses to
			// instruct an upgrade it could not check, keeping the cluster as it was.
			func() resource.TestStep {
				s := step(strings.Replace(args, `"v1.36.3"`, `"v1.36.4"`, 1))
				s.PlanOnly, s.ExpectNonEmptyPlan = true, true
				return s
			}(),
			func() resource.TestStep {
				s := step(strings.Replace(args, `"v1.36.3"`, `"v1.37.0"`, 1))
				s.ExpectError = diagnostic("Error: Cannot check the join policy", `runs Kubernetes "v1.36.3"; kubernetes_version `+
					`is now "v1.37.0", but the cluster's join policy could not be read to check that nodes of v1.37.0 may `+
					`join: reading the join policy:`)
				return s
			}(),
			refused(strings.Replace(args, `"v1.36.3"`, `"v1.38.0"`, 1), diagnostic("Error: Kubernetes version change not allowed",
				`runs Kubernetes "v1.36.3"; kubernetes_version is now "v1.38.0": v1.36.3 to v1.38.0 skips a minor: kubeadm `+
					`upgrades one minor at a time, so go to v1.37 first, then to v1.38. Keep kubernetes_version = "v1.36.3".`)),
			refused(strings.Replace(args, `"v1.36.3"`, `"v1.35.4"`, 1), diagnostic("Error: Kubernetes version change not allowed",
				`v1.36.3 to v1.35.4 is a downgrade: Kubernetes does not go back to an earlier release`)),
			refused(args+`  pod_subnet = "10.200.0.0/16"`, diagnostic("Error: Fixed once the cluster exists",
				`was initialized with pod_subnet = unset; the configuration now says "10.200.0.0/16". The node used `+
					`pod_subnet only when it ran kubeadm init, so a change cannot reach the running cluster, and `+
					`replacing the cluster for it would drop it, and its admin kubeconfig, from state before a new init `+
					`failed. Leave pod_subnet unset, or list pod_subnet in lifecycle { ignore_changes }.`)),
			refused(args+`  certificate_validity = "2160h"`, diagnostic("Error: Fixed once the cluster exists",
				`was initialized with certificate_validity = unset; the configuration now says "2160h".`)),
			refused(args+`  pod_network = "none"`, diagnostic("Error: Fixed once the cluster exists",
				`was initialized with pod_network = "flannel"; the configuration now says "none".`)),
			refused(strings.Replace(args, `cluster_name = "lab"`, `cluster_name = "prod"`, 1), diagnostic("Error: Fixed once the cluster exists",
				`was initialized with cluster_name = "lab"; the configuration now says "prod".`)),
			inPlace,
		},
	})
}

// TestInitWaitLogsEachAttempt applies berth_cluster with the real terraform and the built provider at
// INFO, first at an address where nothing listens, then at a node that answers, and checks that the
// provider's log shows each attempt and what it got.
func TestInitWaitLogsEachAttempt(t *testing.T) {
	t.Parallel()
	ca := swtpmtest.NewCA(t)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	// A port that was free a moment ago and is closed now: connection refused, as a booting node gives.
	dead := lis.Addr().String()
	lis.Close()
	node := startTestNode(t, ca.NewTPM(t))

	apply := func(endpoint, timeout string) (string, string, error) {
		logFile := filepath.Join(t.TempDir(), "terraform.log")
		mainTF := cliProvider + clusterConfig(clusterArgs(endpoint, "lab", zeroPCR11)+`  init_timeout = "`+timeout+`"`+clusterSecrets)
		out, err := planCLI(t, mainTF, []string{"TF_LOG_PROVIDER=INFO", "TF_LOG_PATH=" + logFile,
			"TF_VAR_root_key=" + base64.StdEncoding.EncodeToString(make([]byte, 32)), "TF_VAR_ek_ca=" + string(ca.BundlePEM())},
			"apply", "-input=false", "-no-color", "-auto-approve")
		log, rerr := os.ReadFile(logFile)
		if rerr != nil {
			t.Fatal(rerr)
		}
		return out, string(log), err
	}

	out, log, err := apply(dead, "4s")
	if err == nil || !diagnostic("Error: Initializing the cluster at "+dead+" failed", "No init server answered in time.").MatchString(out) {
		t.Fatalf("terraform apply against %s (nothing listens): %v\n%s", dead, err, out)
	}
	for _, attempt := range []string{"1", "2"} {
		line := regexp.MustCompile(`\[INFO\]\s+provider\.terraform-provider-berth[^:]*: attempt ` + attempt + `: no init server at ` +
			regexp.QuoteMeta(dead) + ` yet: .*connection refused`)
		if !line.MatchString(log) {
			t.Errorf("the provider's log has no INFO line for attempt %s with what it got:\n%s", attempt, log)
		}
	}

	out, log, err = apply(node, "1m")
	if err != nil {
		t.Fatalf("terraform apply against the test node: %v\n%s", err, out)
	}
	if !regexp.MustCompile(`\[INFO\]\s+provider\.terraform-provider-berth[^:]*: attempt 1: the node's init server at ` +
		regexp.QuoteMeta(node) + ` answers with a TPM quote`).MatchString(log) {
		t.Errorf("the provider's log does not say that the node answered:\n%s", log)
	}
}

// TestImageManifestErrors checks with the real terraform what berth_image says of a manifest that is not
// there (who writes it) and of one with a bad value (the value).
func TestImageManifestErrors(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.json")
	doc := `{"version": 1, "images": [{"name": "berth-1", "builder": "qemu", "artifact_id": "disk.raw", "pcrs": {"4": "4A4A"}}]}`
	if err := os.WriteFile(bad, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(dir, "berth-image.json")
	resource.UnitTest(t, resource.TestCase{
		ProtoV6ProviderFactories: providers,
		Steps: []resource.TestStep{
			{
				Config: fmt.Sprintf(`data "berth_image" "x" { path = %q }`, missing),
				ExpectError: diagnostic("Error: Cannot read the image manifest", missing+" does not exist. `packer build` with the "+
					"Berth plugin's post-processor berth-manifest writes it (to its `output`, berth-image.json by default): "+
					"run the build first, or set path to where it wrote the manifest"),
			},
			{
				Config: fmt.Sprintf(`data "berth_image" "x" { path = %q }`, bad),
				ExpectError: phrase(bad + `: image manifest image 0 ("berth-1"): PCR 4: value "4A4A" is not 64 lowercase ` +
					`hex digits (a SHA-256 digest)`),
			},
		},
	})
}

// TestPlanChecksAgreeWithTheNode checks that what the provider checks at plan time is what the node's
// kubeadm configuration takes: the default subnets and the endpoint rule, which the provider repeats
// rather than import (its messages say more). The kubernetes_version pattern is kubeadm.IsRelease for both.
func TestPlanChecksAgreeWithTheNode(t *testing.T) {
	t.Parallel()
	if defaultPodSubnet != kubeadm.DefaultPodSubnet || defaultServiceSubnet != kubeadm.DefaultServiceSubnet {
		t.Errorf("the provider's default subnets %s, %s are not the node's %s, %s",
			defaultPodSubnet, defaultServiceSubnet, kubeadm.DefaultPodSubnet, kubeadm.DefaultServiceSubnet)
	}
	for _, ep := range []string{"10.0.0.10:7451", "api.example.com:6443", "[fd00::1]:6443", "10.0.0.10", "10.0.0.10:0",
		"10.0.0.10:65536", "Api_Server:6443", ":6443", "a..b:1", "host:port"} {
		if got, want := hostPortError(ep) == "", kubeadm.ValidateEndpoint(ep) == nil; got != want {
			t.Errorf("%q: the provider accepts it: %t, kubeadm: %t", ep, got, want)
		}
	}
}

// TestJoinPolicyDiagnosticPaths checks the attribute path of each of a policy's mistakes, which Terraform's
// output shows only as the images attribute: every one on the field it is about, all in one pass.
func TestJoinPolicyDiagnosticPaths(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	image := func(name string, roles []string, pcrs map[string]string, expires string) attr.Value {
		roleValues := make([]attr.Value, len(roles))
		for i, r := range roles {
			roleValues[i] = types.StringValue(r)
		}
		pcrValues := map[string]attr.Value{}
		for k, v := range pcrs {
			pcrValues[k] = types.StringValue(v)
		}
		exp := types.StringNull()
		if expires != "" {
			exp = types.StringValue(expires)
		}
		version := types.StringNull()
		if name == "berth-a" {
			version = types.StringValue("v1.36")
		}
		return types.ObjectValueMust(imageAttrTypes, map[string]attr.Value{
			"name": types.StringValue(name), "roles": types.SetValueMust(types.StringType, roleValues),
			"pcrs": types.MapValueMust(types.StringType, pcrValues), "expires": exp, "kubernetes_version": version})
	}
	m := joinPolicyModel{Images: types.ListValueMust(types.ObjectType{AttrTypes: imageAttrTypes}, []attr.Value{
		image("berth-a", []string{"worker", "admin"}, map[string]string{"24": pcr0, "9": "ABC"}, "2027-01-01"),
		image("berth-old", []string{"worker"}, map[string]string{"4": pcr0}, "2025-06-30T00:00:00Z"),
		image("Berth_3", nil, map[string]string{"4": pcr0}, ""),
		image("berth-a", []string{"worker"}, map[string]string{}, ""),
	})}
	p, diags := m.policy(ctx, time.Date(2026, 11, 26, 0, 0, 0, 0, time.UTC))
	if p != nil {
		t.Errorf("policy() returned a policy despite its errors: %+v", p)
	}
	want := map[string]string{
		"error images[0].roles":              `role "admin" is not`,
		"error images[0].pcrs":               `PCR index "24"`,
		`error images[0].pcrs["9"]`:          `got "ABC"`,
		"error images[0].expires":            `expires is "2027-01-01"`,
		"error images[0].kubernetes_version": `kubernetes_version is "v1.36", a minor version`,
		"error images[3].kubernetes_version": `kubernetes_version is "v1.36", a minor version`,
		"warning images[1].expires":          `Image "berth-old" (images[1]) expired at 2025-06-30T00:00:00Z`,
		"error images[2].name":               `images[2].name is "Berth_3"`,
		"error images[2].roles":              `Image "Berth_3" (images[2]) has no roles`,
		"error images[3].name":               `images[0] and images[3] are both named "berth-a"`,
		"error images[3].pcrs":               `Image "berth-a" (images[3]) has no pcrs`,
	}
	got := map[string]string{}
	for _, d := range diags {
		dp, ok := d.(diag.DiagnosticWithPath)
		if !ok {
			t.Errorf("diagnostic without a path: %s: %s", d.Summary(), d.Detail())
			continue
		}
		key := strings.ToLower(d.Severity().String()) + " " + dp.Path().String()
		if _, dup := got[key]; dup {
			t.Errorf("two diagnostics at %s", key)
		}
		got[key] = d.Detail()
	}
	for key, detail := range want {
		if !strings.Contains(got[key], detail) {
			t.Errorf("%s: %q, want %q", key, got[key], detail)
		}
	}
	for key, detail := range got {
		if _, ok := want[key]; !ok {
			t.Errorf("unexpected %s: %s", key, detail)
		}
	}
}
