package provider

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-testing/config"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/berthlabs/berth/internal/clusterinfo"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/internal/repotest"
	"github.com/berthlabs/berth/test/clustertest"
	"github.com/berthlabs/berth/test/lab"
)

// impostorConfig boots the first control-plane machine from image berthlab-b and asks berth_cluster to
// initialize it as berthlab-a: the attestation must refuse it before any secret is sent, naming the PCR. The
// machine has the example's address in state, so that applying the example replaces it (a resource removed
// from the configuration would not run its destroy-time provisioner).
const impostorConfig = `
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

variable "berth_lab" {
  type = string
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

data "berth_image" "a" {
  path = "${var.lab_dir}/berth-image.json"
  name = "berthlab-a"
}

data "berth_node_config" "control_plane" {
  cluster_name     = "berthlab"
  join_ca_pin      = berth_secrets.lab.join_ca_pin
  init_secret_hash = berth_secrets.lab.init_secret_hash
}

# The example's first machine, but of the other image; its input has the example's shape, because the
# example's destroy-time provisioner removes it with the old input.
resource "terraform_data" "machine" {
  count = 1
  input = {
    name      = "cp-0"
    role      = "control-plane"
    address   = "10.250.0.10"
    image     = "berthlab-b"
    user_data = data.berth_node_config.control_plane.json
    lab       = var.berth_lab
    dir       = var.lab_dir
  }
  provisioner "local-exec" {
    command     = "\"$LAB\" node up --dir \"$DIR\" --name \"$NAME\" --role \"$ROLE\" --addr \"$ADDR\" --image \"$IMAGE\" --user-data \"$USER_DATA\""
    environment = { LAB = self.input.lab, DIR = self.input.dir, NAME = self.input.name, ROLE = self.input.role, ADDR = self.input.address, IMAGE = self.input.image, USER_DATA = self.input.user_data }
  }
}

resource "berth_cluster" "lab" {
  endpoint           = "10.250.0.10:7451"
  cluster_name       = "berthlab"
  kubernetes_version = data.berth_image.a.components["kubernetes"]
  pcrs               = data.berth_image.a.pcrs
  ek_ca_certificates = file("${var.lab_dir}/ek-ca.pem")

  kubernetes_ca_certificate = berth_secrets.lab.kubernetes_ca_certificate
  join_ca_certificate       = berth_secrets.lab.join_ca_certificate
  init_secret_wo            = ephemeral.berth_secrets.lab.init_secret
  master_secret_wo          = ephemeral.berth_secrets.lab.master_secret
  salt_wo                   = ephemeral.berth_secrets.lab.salt
  kubernetes_ca_key_wo      = ephemeral.berth_secrets.lab.kubernetes_ca_key
  join_ca_key_wo            = ephemeral.berth_secrets.lab.join_ca_key

  depends_on = [terraform_data.machine]
}
`

// adoptConfig reaches the lab's cluster through a kubeconfig file, as an operator adopting a running
// cluster's join policy would, to import the policy the example wrote.
const adoptConfig = `
terraform {
  required_providers {
    berth = {
      source = "berthlabs/berth"
    }
  }
}

variable "kubeconfig_path" {
  type = string
}

variable "pcrs" {
  type = map(string)
}

provider "berth" {
  alias      = "lab"
  kubeconfig = file(var.kubeconfig_path)
}

resource "berth_join_policy" "lab" {
  provider = berth.lab
  images = [{
    name  = "berthlab-a"
    roles = ["control-plane", "worker"]
    pcrs  = var.pcrs
  }]
}
`

type labWorker struct {
	name, image string
	host        int
}

// TestAccLab is the acceptance test of issue 4: the real terraform CLI applies examples/lab, the
// configuration of make lab, against a real lab. A machine of the wrong image is refused at init with the
// PCR named; then the cluster is initialized, a worker joins, the policy drops an image and a worker of that
// image is refused; the join policy imports; with another cluster's record, or none, in the cluster a plan
// initializes a new cluster; with its own record back a plan shows no drift; berth_secrets and berth_cluster,
// imported into a new state from the root key and the addresses, agree with the state that made them;
// destroy leaves no machine behind. State and `terraform show -json` never hold a secret. A configuration that reaches the cluster only
// with berth_admin_credentials finds it healthy with berth_cluster_health, keeps no private key, and names
// the refused worker as never admitted.
func TestAccLab(t *testing.T) {
	if os.Getenv(resource.EnvTfAcc) == "" {
		t.Skip("acceptance test against a real lab: make testacc runs it (TF_ACC=1, root)")
	}
	repotest.NeedsRoot(t, "the lab makes network and mount namespaces, cgroups and LUKS images")
	kubeBin := os.Getenv("BERTH_KUBE_BIN")
	if kubeBin == "" {
		t.Fatal("BERTH_KUBE_BIN is not set: make testacc builds Kubernetes once (scripts/build-k8s.sh) and sets it")
	}
	agent := repotest.BuildBinary(t, "./nodeagent/cmd/berth-agent", "")
	labBin := repotest.BuildBinary(t, "./test/lab/cmd/berth-lab", "")

	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Minute)
	defer cancel()
	_, dir, _ := startAccLab(ctx, t, lab.HostConfig{KubeBin: kubeBin, AgentBinary: agent, LabBinary: labBin})

	root := make([]byte, 32)
	if _, err := rand.Read(root); err != nil {
		t.Fatal(err)
	}
	// The example has two configurations of the provider. Served in-process, both are configured on one
	// server, whose resources get whichever configuration came last; a destroy configures both at once, and
	// berth_join_policy now and then got the one without a kubeconfig. From a mirror, each has its process.
	t.Setenv("TF_CLI_CONFIG_FILE", providerMirror(t))
	// Terraform's working directories land here, so the checks can read the raw state files.
	tfDirs := t.TempDir()
	t.Setenv("TF_ACC_TEMP_DIR", tfDirs)

	base := config.Variables{
		"root_key":  config.StringVariable(base64.StdEncoding.EncodeToString(root)),
		"lab_dir":   config.StringVariable(dir),
		"berth_lab": config.StringVariable(labBin),
	}
	vars := func(workers []labWorker, allowed ...string) config.Variables {
		v := config.Variables{}
		for k, val := range base {
			v[k] = val
		}
		var ws []config.Variable
		for _, w := range workers {
			ws = append(ws, config.ObjectVariable(map[string]config.Variable{
				"name": config.StringVariable(w.name), "image": config.StringVariable(w.image), "host": config.IntegerVariable(w.host)}))
		}
		v["workers"] = config.ListVariable(ws...)
		var list []config.Variable
		for _, a := range allowed {
			list = append(list, config.StringVariable(a))
		}
		v["allowed_images"] = config.ListVariable(list...)
		return v
	}
	example := config.StaticDirectory("../examples/lab")
	kubeconfigPath := filepath.Join(t.TempDir(), "admin.conf")
	// record is the cluster's own record, kept while the tests put others in its place.
	var record clusterinfo.Info
	newClusterPlanned := []plancheck.PlanCheck{
		plancheck.ExpectResourceAction("berth_cluster.lab", plancheck.ResourceActionCreate),
		plancheck.ExpectResourceAction("berth_join_policy.lab", plancheck.ResourceActionReplace),
	}
	oneWorker := vars([]labWorker{{"worker-0", "berthlab-a", 20}}, "berthlab-a", "berthlab-b")
	droppedOnly := vars([]labWorker{{"worker-0", "berthlab-a", 20}}, "berthlab-a")
	dropped := vars([]labWorker{{"worker-0", "berthlab-a", 20}, {"worker-1", "berthlab-b", 21}}, "berthlab-a")

	// terraform-plugin-testing runs terraform init on the configuration of a directory with a provider block,
	// but for a configuration in a string only on the providers the step names.
	mirrored := map[string]resource.ExternalProvider{"berth": {Source: "berthlabs/berth"}}
	steps := []resource.TestStep{
		{
			Config:            impostorConfig,
			ExternalProviders: mirrored,
			ConfigVariables:   base,
			ExpectError:       measurementRefusal(11, lab.PredictedPCRs("berthlab-a")[11], lab.PredictedPCRs("berthlab-b")[11]),
		},
		{
			ConfigDirectory: example,
			ConfigVariables: oneWorker,
			Check: resource.ComposeTestCheckFunc(
				resource.TestCheckResourceAttrPair("berth_cluster.lab", "cluster_id", "berth_secrets.lab", "cluster_id"),
				resource.TestCheckResourceAttr("berth_cluster.lab", "api_server_endpoint", "10.250.0.10:6443"),
				resource.TestCheckResourceAttrPair("berth_cluster.lab", "kubernetes_ca_certificate", "berth_secrets.lab", "kubernetes_ca_certificate"),
				resource.TestCheckResourceAttrSet("berth_cluster.lab", "client_certificate"),
				resource.TestCheckResourceAttr("berth_join_policy.lab", "images.#", "2"),
				nodesReady(ctx, dir, "cp-0", "worker-0"),
				noSecretsInState(t, root, tfDirs),
				labHealthy(t, root, "worker-0"),
				importedAgrees(root, dir),
			),
		},
		// The policy drops berthlab-b; the join service has it before the next step boots a node of it.
		{
			ConfigDirectory: example,
			ConfigVariables: droppedOnly,
			Check: resource.ComposeTestCheckFunc(
				resource.TestCheckResourceAttr("berth_join_policy.lab", "images.#", "1"),
				clusterPolicyImages(ctx, "berthlab-a"),
				policyLoaded(dir, 1),
			),
		},
		{
			ConfigDirectory: example,
			ConfigVariables: dropped,
			Check: resource.ComposeTestCheckFunc(
				joinRefused(ctx, dir, "worker-1"),
				nodesReady(ctx, dir, "cp-0", "worker-0"),
				noSecretsInState(t, root, tfDirs),
				labHealthMissing(t, root, "worker-1"),
				writeKubeconfig(kubeconfigPath),
			),
		},
		{
			Config:            adoptConfig,
			ExternalProviders: mirrored,
			ConfigVariables:   config.Variables{"kubeconfig_path": config.StringVariable(kubeconfigPath), "pcrs": pcrVariable(lab.PredictedPCRs("berthlab-a"))},
			ResourceName:      "berth_join_policy.lab",
			ImportState:       true,
			ImportStateId:     "berth-join-policy",
			ImportStateVerify: true,
		},
		// Another cluster answers at the address: berth_cluster leaves state, and the plan initializes a new
		// one and writes the policy into it. A plan only: nothing is applied.
		{
			PreConfig: func() {
				record = replaceClusterRecord(t, kubeconfigPath, &clusterinfo.Info{ID: strings.Repeat("0", 32), Name: "other"})
			},
			ConfigDirectory:    example,
			ConfigVariables:    dropped,
			PlanOnly:           true,
			ExpectNonEmptyPlan: true,
			ConfigPlanChecks:   resource.ConfigPlanChecks{PostApplyPostRefresh: newClusterPlanned},
		},
		// The API server answers without a Berth record: the cluster is gone.
		{
			PreConfig:          func() { replaceClusterRecord(t, kubeconfigPath, nil) },
			ConfigDirectory:    example,
			ConfigVariables:    dropped,
			PlanOnly:           true,
			ExpectNonEmptyPlan: true,
			ConfigPlanChecks:   resource.ConfigPlanChecks{PostApplyPostRefresh: newClusterPlanned},
		},
		// Last, so that the destroy at the end runs with the example's configuration: with the record back, a
		// refresh of everything (berth_cluster reads the record) plans no change.
		{
			PreConfig:       func() { replaceClusterRecord(t, kubeconfigPath, &record) },
			ConfigDirectory: example,
			ConfigVariables: dropped,
			PlanOnly:        true,
		},
	}
	resource.Test(t, resource.TestCase{
		CheckDestroy: func(*terraform.State) error {
			l, err := lab.Open(dir)
			if err != nil {
				return err
			}
			if len(l.Nodes) > 0 {
				return fmt.Errorf("machines left after destroy: %d (the first is %s)", len(l.Nodes), l.Nodes[0].Name)
			}
			return nil
		},
		Steps: steps,
	})
}

// startAccLab sets up a lab host in a directory of the test's from cfg (whose Dir, ImageDir and Progress it
// sets), and takes it down when the test ends, whether or not the host came up whole, logging then what was
// written to the progress writer it returns (the host's progress, and that of the labs the test opens with
// it). The nodes' container images are made once per release for all the tests of the process, as the lab's
// own tests do: each release's took half a minute.
func startAccLab(ctx context.Context, t *testing.T, cfg lab.HostConfig) (*lab.Lab, string, io.Writer) {
	t.Helper()
	var progress clustertest.SafeBuffer
	cfg.Dir, cfg.ImageDir, cfg.Progress = filepath.Join(t.TempDir(), "lab"), filepath.Join(testDir, "lab-images"), &progress
	host, err := lab.StartHost(ctx, cfg)
	t.Cleanup(func() {
		if err := lab.Down(context.Background(), cfg.Dir); err != nil {
			t.Errorf("lab down: %v", err)
		}
		if left := lab.Leftovers(cfg.Dir); len(left) > 0 {
			t.Errorf("the lab left behind: %v", left)
		}
		t.Logf("lab host:\n%s", progress.String())
	})
	if err != nil {
		t.Fatal(err)
	}
	return host, cfg.Dir, &progress
}

// measurementRefusal matches terraform's rendering of the attestation failure, which it wraps at spaces.
func measurementRefusal(pcr int, expected, got []byte) *regexp.Regexp {
	phrase := func(text string) string {
		words := strings.Fields(text)
		for i, w := range words {
			words[i] = regexp.QuoteMeta(w)
		}
		return strings.Join(words, `\s+`)
	}
	return regexp.MustCompile(`(?s)` + phrase("The node does not run the expected image") + `.*` +
		phrase(fmt.Sprintf("was not sent any secret: PCR %d: expected %x, got %x", pcr, expected, got)))
}

// clusterKube connects to the cluster with the kubeconfig berth_cluster keeps in state.
func clusterKube(s *terraform.State) (kubernetes.Interface, string, error) {
	rs, ok := s.RootModule().Resources["berth_cluster.lab"]
	if !ok {
		return nil, "", errors.New("berth_cluster.lab is not in state")
	}
	kubeconfig := rs.Primary.Attributes["kubeconfig"]
	rc, err := clientcmd.RESTConfigFromKubeConfig([]byte(kubeconfig))
	if err != nil {
		return nil, "", err
	}
	kube, err := kubernetes.NewForConfig(rc)
	return kube, kubeconfig, err
}

// nodesReady waits until the named lab nodes are Ready in the cluster berth_cluster initialized.
func nodesReady(ctx context.Context, dir string, names ...string) resource.TestCheckFunc {
	return func(s *terraform.State) error {
		_, kubeconfig, err := clusterKube(s)
		if err != nil {
			return err
		}
		l, err := lab.Open(dir)
		if err != nil {
			return err
		}
		l.Kubeconfig = filepath.Join(dir, "admin.conf")
		if err := os.WriteFile(l.Kubeconfig, []byte(kubeconfig), 0o600); err != nil {
			return err
		}
		var nodes []*lab.Node
		for _, name := range names {
			n := l.Node(name)
			if n == nil {
				return fmt.Errorf("the lab has no machine %s", name)
			}
			nodes = append(nodes, n)
		}
		ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
		defer cancel()
		return l.WaitReady(ctx, nodes)
	}
}

// replaceClusterRecord puts info in place of the cluster's record (deletes it if info is nil) and returns
// the record that was there.
func replaceClusterRecord(t *testing.T, kubeconfigPath string, info *clusterinfo.Info) clusterinfo.Info {
	t.Helper()
	rc, err := clientcmd.BuildConfigFromFlags("", kubeconfigPath)
	if err != nil {
		t.Fatal(err)
	}
	kube, err := kubernetes.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	old, err := clusterinfo.Read(ctx, kube)
	if err != nil && !errors.Is(err, clusterinfo.ErrNotFound) {
		t.Fatal(err)
	}
	err = kube.CoreV1().ConfigMaps(clusterinfo.Namespace).Delete(ctx, clusterinfo.Name, metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		t.Fatal(err)
	}
	if info != nil {
		if err := clusterinfo.Publish(ctx, kube, *info); err != nil {
			t.Fatal(err)
		}
	}
	return old
}

// writeKubeconfig writes the kubeconfig berth_cluster keeps in state to path.
func writeKubeconfig(path string) resource.TestCheckFunc {
	return func(s *terraform.State) error {
		_, kubeconfig, err := clusterKube(s)
		if err != nil {
			return err
		}
		return os.WriteFile(path, []byte(kubeconfig), 0o600)
	}
}

func pcrVariable(pcrs map[int][]byte) config.Variable {
	v := map[string]config.Variable{}
	for i, value := range pcrs {
		v[strconv.Itoa(i)] = config.StringVariable(hex.EncodeToString(value))
	}
	return config.MapVariable(v)
}

// clusterPolicyImages checks the policy the join services read from the cluster.
func clusterPolicyImages(ctx context.Context, want ...string) resource.TestCheckFunc {
	return func(s *terraform.State) error {
		kube, _, err := clusterKube(s)
		if err != nil {
			return err
		}
		cm, err := kube.CoreV1().ConfigMaps("kube-system").Get(ctx, "berth-join-policy", metav1.GetOptions{})
		if err != nil {
			return err
		}
		p, err := policy.Parse([]byte(cm.Data[policy.ConfigMapKey]))
		if err != nil {
			return err
		}
		var got []string
		for _, img := range p.Images {
			got = append(got, img.Name)
		}
		if !slices.Equal(got, want) {
			return fmt.Errorf("the cluster's join policy admits %v, want %v", got, want)
		}
		return nil
	}
}

// policyLoaded waits until the join service on cp-0 has loaded a policy of images images.
func policyLoaded(dir string, images int) resource.TestCheckFunc {
	return func(*terraform.State) error {
		logPath := filepath.Join(dir, "nodes", "cp-0", "logs", "agent.log")
		for deadline := time.Now().Add(time.Minute); ; time.Sleep(time.Second) {
			found, err := hasLogLine(logPath, func(entry map[string]any) bool {
				return entry["msg"] == "join policy loaded" && entry["images"] == float64(images)
			})
			if err != nil || found {
				return err
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("the join service on cp-0 did not load a policy of %d images within a minute (see %s)", images, logPath)
			}
		}
	}
}

// joinRefused waits until the join service on cp-0 has refused node for its measurements, then checks
// that the node is not in the cluster.
func joinRefused(ctx context.Context, dir, node string) resource.TestCheckFunc {
	return func(s *terraform.State) error {
		logPath := filepath.Join(dir, "nodes", "cp-0", "logs", "agent.log")
		deadline := time.Now().Add(3 * time.Minute)
		for {
			found, err := hasLogLine(logPath, func(entry map[string]any) bool {
				reason, _ := entry["reason"].(string)
				return entry["msg"] == "measurements refused" && entry["peer_node"] == node && reason != ""
			})
			if err != nil {
				return err
			}
			if found {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("the join service on cp-0 did not refuse %s within 3 minutes (see %s)", node, logPath)
			}
			time.Sleep(2 * time.Second)
		}
		kube, _, err := clusterKube(s)
		if err != nil {
			return err
		}
		nodes, err := kube.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		for _, n := range nodes.Items {
			if n.Name == node {
				return fmt.Errorf("%s is a cluster node although its image was dropped from the policy", node)
			}
		}
		return nil
	}
}

// hasLogLine reports whether a JSON log line of path is one that match accepts.
func hasLogLine(path string, match func(map[string]any) bool) (bool, error) {
	f, err := os.Open(path)
	if err != nil {
		return false, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		var entry map[string]any
		if json.Unmarshal(sc.Bytes(), &entry) == nil && match(entry) {
			return true, nil
		}
	}
	return false, sc.Err()
}

// noSecretsInState looks for root's secrets in the state terraform-plugin-testing read with `terraform show
// -json` and in every raw state file terraform wrote. berth_cluster's kubeconfig and client_key do hold a
// private key, the admin client's, which state must keep (Sensitive); the cluster's secrets must not be there.
func noSecretsInState(t *testing.T, root []byte, tfDirs string) resource.TestCheckFunc {
	forbidden := forbiddenSecrets(t, root)
	return func(s *terraform.State) error {
		shown, err := json.Marshal(s)
		if err != nil {
			return err
		}
		searched := map[string][]byte{"terraform show -json": shown}
		err = filepath.WalkDir(tfDirs, func(path string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasPrefix(d.Name(), "terraform.tfstate") {
				return err
			}
			data, err := os.ReadFile(path)
			searched[path] = data
			return err
		})
		if err != nil {
			return err
		}
		if len(searched) < 2 {
			return fmt.Errorf("no raw state file under %s", tfDirs)
		}
		if leaks := findSecrets(searched, forbidden); len(leaks) > 0 {
			return errors.New(strings.Join(leaks, "\n"))
		}
		return nil
	}
}
