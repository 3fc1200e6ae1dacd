package provider

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-testing/config"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/berthlabs/berth/internal/clusterinfo"
	"github.com/berthlabs/berth/internal/diskrecord"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/test/kubetest"
)

// ephemeralHealthConfig reaches a cluster with admin credentials minted for the run only, and waits for it:
// what a configuration that keeps no admin credential looks like. The lab acceptance test applies it too.
const ephemeralHealthConfig = `
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

variable "kubernetes_ca_certificate" {
  type = string
}

variable "api_server_endpoint" {
  type = string
}

variable "control_plane_nodes" {
  type    = number
  default = null
}

variable "node_names" {
  type    = set(string)
  default = null
}

variable "timeout" {
  type    = string
  default = "2m"
}

ephemeral "berth_admin_credentials" "admin" {
  root_key                  = var.root_key
  kubernetes_ca_certificate = var.kubernetes_ca_certificate
  api_server_endpoint       = var.api_server_endpoint
  validity                  = "10m"
}

provider "berth" {
  alias      = "admin"
  kubeconfig = ephemeral.berth_admin_credentials.admin.kubeconfig
}

data "berth_cluster_health" "this" {
  provider            = berth.admin
  control_plane_nodes = var.control_plane_nodes
  node_names          = var.node_names
  timeout             = var.timeout
}

output "ready_control_plane_nodes" {
  value = data.berth_cluster_health.this.ready_control_plane_nodes
}

output "ready_worker_nodes" {
  value = data.berth_cluster_health.this.ready_worker_nodes
}
`

// healthWanted is what ephemeralHealthConfig waits for.
type healthWanted struct {
	ControlPlaneNodes *int     `json:"control_plane_nodes,omitempty"`
	NodeNames         []string `json:"node_names,omitempty"`
	Timeout           string   `json:"timeout,omitempty"`
}

// ephemeralHealthRun is one terraform apply of ephemeralHealthConfig in a directory of its own, by the
// built provider binary, as an operator runs it.
type ephemeralHealthRun struct {
	dir    string
	output []byte // stdout and stderr of terraform apply
	ready  map[string][]string
	state  map[string][]byte // the raw state file and `terraform show -json`
}

// applyEphemeralHealth applies ephemeralHealthConfig; a failed apply returns the run with what terraform
// printed, and an error. The root key reaches terraform through the environment only.
func applyEphemeralHealth(t *testing.T, root []byte, caPEM, endpoint string, want healthWanted) (*ephemeralHealthRun, error) {
	t.Helper()
	run := &ephemeralHealthRun{dir: t.TempDir(), state: map[string][]byte{}}
	vars, err := json.Marshal(struct {
		healthWanted
		CA       string `json:"kubernetes_ca_certificate"`
		Endpoint string `json:"api_server_endpoint"`
	}{want, caPEM, endpoint})
	if err != nil {
		return nil, err
	}
	for name, data := range map[string][]byte{"main.tf": []byte(ephemeralHealthConfig), "terraform.tfvars.json": vars} {
		if err := os.WriteFile(filepath.Join(run.dir, name), data, 0o600); err != nil {
			return nil, err
		}
	}
	rootVar := "TF_VAR_root_key=" + base64.StdEncoding.EncodeToString(root)
	run.output, err = terraformIn(t, run.dir, []string{rootVar}, "apply", "-auto-approve", "-input=false", "-no-color")
	if err != nil {
		return run, fmt.Errorf("terraform apply: %w\n%s", err, run.output)
	}
	if !bytes.Contains(run.output, []byte("ephemeral.berth_admin_credentials.admin: Opening...")) {
		return run, fmt.Errorf("terraform apply did not open berth_admin_credentials:\n%s", run.output)
	}
	outputs, err := terraformIn(t, run.dir, nil, "output", "-json")
	if err != nil {
		return run, fmt.Errorf("terraform output: %w\n%s", err, outputs)
	}
	var values map[string]struct{ Value []string }
	if err := json.Unmarshal(outputs, &values); err != nil {
		return run, fmt.Errorf("terraform output -json: %w\n%s", err, outputs)
	}
	run.ready = map[string][]string{}
	for name, v := range values {
		run.ready[name] = v.Value
	}
	if run.state["terraform show -json"], err = terraformIn(t, run.dir, nil, "show", "-json"); err != nil {
		return run, fmt.Errorf("terraform show: %w", err)
	}
	if run.state["terraform.tfstate"], err = os.ReadFile(filepath.Join(run.dir, "terraform.tfstate")); err != nil {
		return run, err
	}
	return run, nil
}

// keyLeaks says where the run's state holds a private key or root's secrets, without printing them.
func (r *ephemeralHealthRun) keyLeaks(t *testing.T, root []byte) []string {
	t.Helper()
	leaks := findSecrets(r.state, forbiddenSecrets(t, root))
	for name, text := range r.state {
		if !bytes.Contains(text, []byte("data.berth_cluster_health.this")) && !bytes.Contains(text, []byte(`"berth_cluster_health"`)) {
			leaks = append(leaks, name+" does not hold the data source: nothing was searched")
		}
		for _, marker := range []string{"PRIVATE KEY", "client-key-data", "client_key", "kubeconfig"} {
			if bytes.Contains(text, []byte(marker)) {
				leaks = append(leaks, fmt.Sprintf("%s contains %q", name, marker))
			}
		}
	}
	return leaks
}

// terraformIn runs the terraform CLI in dir against the built provider, with env added, and returns what it
// printed, stdout then stderr.
func terraformIn(t *testing.T, dir string, env []string, args ...string) ([]byte, error) {
	t.Helper()
	cmd := exec.Command(os.Getenv("TF_ACC_TERRAFORM_PATH"), args...)
	cmd.Dir = dir
	cmd.Env = append(append(os.Environ(), "TF_CLI_CONFIG_FILE="+devOverrides(t), "TF_IN_AUTOMATION=1"), env...)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	return append(out.Bytes(), errOut.Bytes()...), err
}

// healthCluster is a real API server whose CA is the one a root key derives, as a Berth cluster's is.
type healthCluster struct {
	api  *kubetest.APIServer
	root []byte
	ca   *pki.CA
	// endpoint is the API server's host:port, as berth_cluster's api_server_endpoint.
	endpoint string
}

func startHealthCluster(t *testing.T) *healthCluster {
	t.Helper()
	root, ca := newRootKey(t)
	api := kubetest.StartWith(t, kubetest.Options{CA: ca})
	return &healthCluster{api: api, root: root, ca: ca, endpoint: api.URL[len("https://"):]}
}

// bindClusterAdmins makes the ClusterRoleBinding kubeadm init makes, which gives admin credentials their
// rights.
func (c *healthCluster) bindClusterAdmins(t *testing.T) {
	t.Helper()
	_, err := c.api.Client.RbacV1().ClusterRoleBindings().Create(context.Background(), &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: adminGroup},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "cluster-admin"},
		Subjects:   []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.GroupKind, Name: adminGroup}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
}

// putNode registers a node as its kubelet would, or updates it, with a Ready condition of status ready.
func putNode(kube kubernetes.Interface, name string, controlPlane bool, ready corev1.ConditionStatus, reason, message string) error {
	ctx := context.Background()
	node, err := kube.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		node = &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{}}}
		if controlPlane {
			node.Labels[controlPlaneLabel] = ""
		}
		node, err = kube.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{})
	}
	if err != nil {
		return fmt.Errorf("registering node %s: %w", name, err)
	}
	now := metav1.Now()
	if node.Status.NodeInfo.KubeletVersion == "" {
		node.Status.NodeInfo.KubeletVersion = "v1.36.3"
	}
	node.Status.Conditions = []corev1.NodeCondition{
		{Type: corev1.NodeReady, Status: ready, Reason: reason, Message: message, LastHeartbeatTime: now, LastTransitionTime: now},
		{Type: corev1.NodeMemoryPressure, Status: corev1.ConditionFalse, Reason: "KubeletHasSufficientMemory", LastHeartbeatTime: now, LastTransitionTime: now},
	}
	if _, err := kube.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("reporting the status of node %s: %w", name, err)
	}
	return nil
}

// putVersions makes the cluster look halfway through an upgrade from v1.35.4 to v1.36.3, as kubeadm shows
// it: kubeadm-config at the target, one API server (on cp-0) upgraded, another (on cp-1, a node that does
// not report) not yet, and worker-0's kubelet still at v1.35.4.
func putVersions(t *testing.T, kube kubernetes.Interface) {
	t.Helper()
	ctx := context.Background()
	ns := metav1.NamespaceSystem
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "kubeadm-config", Namespace: ns},
		Data: map[string]string{"ClusterConfiguration": "apiVersion: kubeadm.k8s.io/v1beta4\nkind: ClusterConfiguration\nkubernetesVersion: v1.36.3\n"}}
	if _, err := kube.CoreV1().ConfigMaps(ns).Create(ctx, cm, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// The API server admits a pod only with its service account, which no controller manager makes here.
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default", Namespace: ns}}
	if _, err := kube.CoreV1().ServiceAccounts(ns).Create(ctx, sa, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for node, release := range map[string]string{"cp-0": "v1.36.3", "cp-1": "v1.35.4"} {
		pod := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: "kube-apiserver-" + node, Namespace: ns,
				Labels: map[string]string{"component": "kube-apiserver", "tier": "control-plane"}},
			Spec: corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "kube-apiserver", Image: "registry.k8s.io/kube-apiserver:" + release}}},
		}
		if _, err := kube.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	info := clusterinfo.Info{ID: strings.Repeat("0a", 16), Name: "health"}
	if err := clusterinfo.Publish(ctx, kube, info); err != nil {
		t.Fatal(err)
	}
	u, err := clusterinfo.InstructUpgrade(ctx, kube, "v1.36.3", time.Date(2026, 11, 29, 7, 0, 0, 0, time.UTC))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := u.Record(ctx, kube, clusterinfo.PhaseApplied, "cp-0", "", time.Date(2026, 11, 29, 7, 5, 0, 0, time.UTC)); err != nil {
		t.Fatal(err)
	}
	node, err := kube.CoreV1().Nodes().Get(ctx, "worker-0", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	node.Status.NodeInfo.KubeletVersion = "v1.35.4"
	if _, err := kube.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// putReadyNodes registers nodes that are Ready.
func putReadyNodes(t *testing.T, kube kubernetes.Interface, controlPlane bool, names ...string) {
	t.Helper()
	for _, name := range names {
		if err := putNode(kube, name, controlPlane, corev1.ConditionTrue, "KubeletReady", "kubelet is posting ready status"); err != nil {
			t.Fatal(err)
		}
	}
}

// foreignKubeconfig holds a client certificate of another CA, in group kubeadm:cluster-admins, for c's API
// server and CA: what a kubeconfig of another cluster pointed at this one presents.
func foreignKubeconfig(t *testing.T, c *healthCluster) []byte {
	t.Helper()
	_, otherCA := newRootKey(t)
	key, err := pki.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	cert, err := otherCA.IssueClient(pki.ClientTemplate{CommonName: "intruder", Organization: []string{adminGroup}}, key.Public(), time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	keyPEM, err := pki.EncodeKeyPEM(key)
	if err != nil {
		t.Fatal(err)
	}
	kc, err := adminKubeconfig(adminRequest{host: c.api.URL, user: "intruder"}, c.ca.CertPEM(), pki.EncodeCertPEM(cert), keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	return kc
}

// putDiskRecord writes the record the join service keeps of a machine it admitted.
func putDiskRecord(t *testing.T, kube kubernetes.Interface, disk, machine string) {
	t.Helper()
	_, err := kube.CoreV1().ConfigMaps(metav1.NamespaceSystem).Create(context.Background(), &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{
			Name:        diskrecord.Name(disk),
			Labels:      map[string]string{diskrecord.ManagedByLabel: diskrecord.ManagedBy},
			Annotations: map[string]string{diskrecord.InstanceNameAnnotation: machine},
		},
		Data: map[string]string{"ek-sha256": "00"},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
}

// TestClusterHealthEphemeralOnly applies a configuration that reaches a real API server only with
// credentials minted by berth_admin_credentials, with the real terraform and the built provider: the data
// source finds the nodes it waits for, and neither the state file nor `terraform show -json` holds a private
// key, a kubeconfig or a secret of the root key.
func TestClusterHealthEphemeralOnly(t *testing.T) {
	t.Parallel()
	c := startHealthCluster(t)
	c.bindClusterAdmins(t)
	putReadyNodes(t, c.api.Client, true, "cp-0")
	putReadyNodes(t, c.api.Client, false, "worker-0")

	one := 1
	run, err := applyEphemeralHealth(t, c.root, string(c.ca.CertPEM()), c.endpoint, healthWanted{ControlPlaneNodes: &one, NodeNames: []string{"worker-0"}})
	if err != nil {
		t.Fatal(err)
	}
	if got := run.ready["ready_control_plane_nodes"]; !slices.Equal(got, []string{"cp-0"}) {
		t.Errorf("ready_control_plane_nodes = %v, want [cp-0]", got)
	}
	if got := run.ready["ready_worker_nodes"]; !slices.Equal(got, []string{"worker-0"}) {
		t.Errorf("ready_worker_nodes = %v, want [worker-0]", got)
	}
	for _, leak := range run.keyLeaks(t, c.root) {
		t.Error(leak)
	}
}

// healthConfig is berth_cluster_health with args, through a provider configured with the kubeconfig file at
// kubeconfigPath, or with credentials minted by berth_admin_credentials when kubeconfigPath is empty.
func (c *healthCluster) healthConfig(kubeconfigPath, args string) string {
	providerBlock := `
ephemeral "berth_admin_credentials" "admin" {
  root_key                  = var.root_key
  kubernetes_ca_certificate = var.kubernetes_ca_certificate
  api_server_endpoint       = var.api_server_endpoint
}

provider "berth" {
  alias      = "cluster"
  kubeconfig = ephemeral.berth_admin_credentials.admin.kubeconfig
}
`
	if kubeconfigPath != "" {
		providerBlock = fmt.Sprintf("provider \"berth\" {\n  alias      = \"cluster\"\n  kubeconfig = file(%q)\n}\n", kubeconfigPath)
	}
	return `
variable "root_key" {
  type      = string
  ephemeral = true
  sensitive = true
}

variable "kubernetes_ca_certificate" {
  type = string
}

variable "api_server_endpoint" {
  type = string
}
` + providerBlock + `
data "berth_cluster_health" "this" {
  provider = berth.cluster
` + args + `
}
`
}

func (c *healthCluster) vars(endpoint string) config.Variables {
	return config.Variables{
		"root_key":                  config.StringVariable(base64.StdEncoding.EncodeToString(c.root)),
		"kubernetes_ca_certificate": config.StringVariable(string(c.ca.CertPEM())),
		"api_server_endpoint":       config.StringVariable(endpoint),
	}
}

// TestClusterHealthDataSource runs berth_cluster_health under the real terraform against a real API server:
// credentials without the admins' binding fail at once; it waits for a node that becomes Ready during the
// wait; on timeout it names the nodes that are not Ready with their conditions, the nodes that never
// registered and whether the join service admitted them; an API server that does not answer, a certificate
// of another CA, a kubeconfig not known at plan and wrong arguments each fail with their own message.
func TestClusterHealthDataSource(t *testing.T) {
	t.Parallel()
	c := startHealthCluster(t)
	kube := c.api.Client
	foreign := filepath.Join(t.TempDir(), "foreign.conf")
	if err := os.WriteFile(foreign, foreignKubeconfig(t, c), 0o600); err != nil {
		t.Fatal(err)
	}
	closed := fmt.Sprintf("127.0.0.1:%d", kubetest.FreePort(t))

	step := func(kubeconfigPath, endpoint, args string, want *regexp.Regexp, check resource.TestCheckFunc) resource.TestStep {
		return resource.TestStep{Config: c.healthConfig(kubeconfigPath, args), ConfigVariables: c.vars(endpoint), ExpectError: want, Check: check}
	}
	var started time.Time
	resource.UnitTest(t, resource.TestCase{
		ProtoV6ProviderFactories: providers,
		Steps: []resource.TestStep{
			step("", c.endpoint, `nodes = -1`, wrapped("Invalid node count", "nodes is -1; a count of nodes is 0 or more"), nil),
			step("", c.endpoint, `timeout = "soon"`, wrapped("Invalid timeout", `timeout "soon" is not a positive Go duration`), nil),
			step("", c.endpoint, `timeout = "0s"`, wrapped("Invalid timeout", "it must be positive"), nil),
			{
				Config: `
resource "terraform_data" "later" {
  input = "not a kubeconfig"
}

provider "berth" {
  alias      = "cluster"
  kubeconfig = terraform_data.later.output
}

data "berth_cluster_health" "this" {
  provider = berth.cluster
}
`,
				ExpectError: wrapped("The cluster's kubeconfig is not known yet", "Add that resource", "to the data source's depends_on"),
			},
			{
				Config:      "data \"berth_cluster_health\" \"this\" {}\n",
				ExpectError: wrapped("No cluster to check", "needs the kubeconfig of its provider configuration"),
			},
			// kubeadm's binding is not there yet: the minted certificate authenticates, but may not list nodes.
			step("", c.endpoint, `timeout = "5m"`,
				wrapped("Cannot check the cluster", "may not list nodes", `nodes is forbidden: User "berth-admin" cannot list resource "nodes"`), nil),
			step(foreign, c.endpoint, `timeout = "5m"`, wrapped("Cannot check the cluster", "refuses the client certificate", "it was not issued by this cluster's CA"), nil),
			step("", closed, `timeout = "3s"`,
				wrapped("The cluster is not healthy after 3s", "did not answer as ready at the last look", "connection refused", "Is the control-plane node up"), nil),
			{
				PreConfig: func() {
					c.bindClusterAdmins(t)
					putReadyNodes(t, kube, true, "cp-0")
					putReadyNodes(t, kube, false, "worker-0")
					if err := putNode(kube, "worker-1", false, corev1.ConditionFalse, "KubeletNotReady", "container runtime network not ready"); err != nil {
						t.Fatal(err)
					}
					putDiskRecord(t, kube, "6f1c2b1e-9a7d-4c1e-8f57-2a4b8d9e0c11", "worker-2")
					putDiskRecord(t, kube, "0b9e5a3c-1d2f-4e6a-9c8b-7a6d5e4f3a21", "worker-9")
				},
				Config: c.healthConfig("", `
  control_plane_nodes = 1
  worker_nodes        = 3
  node_names          = ["worker-0", "worker-1", "worker-2", "worker-3"]
  timeout             = "4s"`),
				ConfigVariables: c.vars(c.endpoint),
				ExpectError: wrapped(
					"The cluster is not healthy after 4s",
					"Wanted within 4s: the API server ready; 1 control-plane node Ready; 3 workers Ready; worker-0, worker-1, worker-2, worker-3 Ready.",
					"The API server is ready.", "Ready control-plane nodes: cp-0.", "Ready workers: worker-0.",
					"- worker-1: Ready=False KubeletNotReady: container runtime network not ready (since",
					"Too few: 1 of 3 workers Ready.",
					"- worker-2: the join service admitted it (its disk record is from", "but it did not register",
					"- worker-3: the join service never admitted it (no disk record of that name)",
					"Admitted by the join service but not registered as nodes: worker-9 (disk record from",
					"journalctl -u berth-agent"),
			},
			// worker-1 becomes Ready while the data source waits.
			{
				PreConfig: func() {
					putVersions(t, kube)
					started = time.Now()
					go func() {
						time.Sleep(3 * time.Second)
						if err := putNode(kube, "worker-1", false, corev1.ConditionTrue, "KubeletReady", "kubelet is posting ready status"); err != nil {
							t.Error(err)
						}
					}()
				},
				Config: c.healthConfig("", `
  nodes      = 3
  node_names = ["worker-1"]
  timeout    = "2m"`),
				ConfigVariables: c.vars(c.endpoint),
				Check: resource.ComposeAggregateTestCheckFunc(
					resource.TestCheckResourceAttr("data.berth_cluster_health.this", "ready_control_plane_nodes.#", "1"),
					resource.TestCheckResourceAttr("data.berth_cluster_health.this", "ready_control_plane_nodes.0", "cp-0"),
					resource.TestCheckResourceAttr("data.berth_cluster_health.this", "ready_worker_nodes.#", "2"),
					resource.TestCheckResourceAttr("data.berth_cluster_health.this", "ready_worker_nodes.0", "worker-0"),
					resource.TestCheckResourceAttr("data.berth_cluster_health.this", "ready_worker_nodes.1", "worker-1"),
					resource.TestCheckResourceAttr("data.berth_cluster_health.this", "kubernetes_version", "v1.36.3"),
					resource.TestCheckResourceAttr("data.berth_cluster_health.this", "api_server_versions.%", "2"),
					resource.TestCheckResourceAttr("data.berth_cluster_health.this", "api_server_versions.cp-0", "v1.36.3"),
					resource.TestCheckResourceAttr("data.berth_cluster_health.this", "api_server_versions.cp-1", "v1.35.4"),
					resource.TestCheckResourceAttr("data.berth_cluster_health.this", "kubelet_versions.%", "3"),
					resource.TestCheckResourceAttr("data.berth_cluster_health.this", "kubelet_versions.cp-0", "v1.36.3"),
					resource.TestCheckResourceAttr("data.berth_cluster_health.this", "kubelet_versions.worker-0", "v1.35.4"),
					resource.TestCheckResourceAttr("data.berth_cluster_health.this", "upgrade.target", "v1.36.3"),
					resource.TestCheckResourceAttr("data.berth_cluster_health.this", "upgrade.phase", "applied"),
					resource.TestCheckResourceAttr("data.berth_cluster_health.this", "upgrade.node", "cp-0"),
					resource.TestCheckResourceAttr("data.berth_cluster_health.this", "upgrade.time", "2026-11-29T07:05:00Z"),
					resource.TestCheckResourceAttr("data.berth_cluster_health.this", "upgrade.message", ""),
					func(*terraform.State) error {
						if waited := time.Since(started); waited < 3*time.Second {
							return fmt.Errorf("the step took %s: it did not wait for worker-1", waited)
						}
						return nil
					},
				),
			},
		},
	})
}

// TestClusterHealthReadyz checks how a failing /readyz is reported: by the checks that fail.
func TestClusterHealthReadyz(t *testing.T) {
	t.Parallel()
	body := []byte("[+]ping ok\n[-]etcd failed: reason withheld\n[+]log ok\n[-]poststarthook/rbac/bootstrap-roles failed: not finished\nreadyz check failed\n")
	got := readyzError(body, errors.New("the server is currently unable to handle the request")).Error()
	want := "/readyz: not ready: etcd failed: reason withheld; poststarthook/rbac/bootstrap-roles failed: not finished"
	if got != want {
		t.Errorf("readyzError = %q, want %q", got, want)
	}
}

// labCluster reads where the lab acceptance test's cluster answers, and its CA, from the example's state.
func labCluster(s *terraform.State) (caPEM, endpoint string, err error) {
	secrets, ok := s.RootModule().Resources["berth_secrets.lab"]
	cluster, ok2 := s.RootModule().Resources["berth_cluster.lab"]
	if !ok || !ok2 {
		return "", "", errors.New("berth_secrets.lab or berth_cluster.lab is not in state")
	}
	return secrets.Primary.Attributes["kubernetes_ca_certificate"], cluster.Primary.Attributes["api_server_endpoint"], nil
}

// labHealthy applies ephemeralHealthConfig to the lab's cluster, with credentials minted from root only:
// cp-0 and workers are Ready, and the run's state holds no private key.
func labHealthy(t *testing.T, root []byte, workers ...string) resource.TestCheckFunc {
	return func(s *terraform.State) error {
		caPEM, endpoint, err := labCluster(s)
		if err != nil {
			return err
		}
		one := 1
		run, err := applyEphemeralHealth(t, root, caPEM, endpoint, healthWanted{ControlPlaneNodes: &one, NodeNames: workers, Timeout: "5m"})
		if err != nil {
			return err
		}
		if got := run.ready["ready_control_plane_nodes"]; !slices.Equal(got, []string{"cp-0"}) {
			return fmt.Errorf("berth_cluster_health: ready_control_plane_nodes = %v, want [cp-0]", got)
		}
		if got := run.ready["ready_worker_nodes"]; !slices.Equal(got, workers) {
			return fmt.Errorf("berth_cluster_health: ready_worker_nodes = %v, want %v", got, workers)
		}
		if leaks := run.keyLeaks(t, root); len(leaks) > 0 {
			return fmt.Errorf("the ephemeral-only configuration's state: %v", leaks)
		}
		return nil
	}
}

// labHealthMissing applies ephemeralHealthConfig waiting for worker, which the join service refused: it
// must fail after its timeout, saying the join service never admitted worker and where its refusals are.
func labHealthMissing(t *testing.T, root []byte, worker string) resource.TestCheckFunc {
	return func(s *terraform.State) error {
		caPEM, endpoint, err := labCluster(s)
		if err != nil {
			return err
		}
		run, err := applyEphemeralHealth(t, root, caPEM, endpoint, healthWanted{NodeNames: []string{worker}, Timeout: "20s"})
		switch {
		case err == nil:
			return fmt.Errorf("berth_cluster_health found %s Ready, which the join policy refuses", worker)
		case run == nil || run.output == nil:
			return err
		}
		want := wrapped("The cluster is not healthy after 20s", "Ready control-plane nodes: cp-0.",
			"- "+worker+": the join service never admitted it", "journalctl -u berth-agent")
		if !want.Match(run.output) {
			return fmt.Errorf("berth_cluster_health's diagnosis does not match %s:\n%s", want, run.output)
		}
		return nil
	}
}
