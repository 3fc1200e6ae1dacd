package provider

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-testing/config"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"

	"github.com/berthlabs/berth/internal/clusterinfo"
	"github.com/berthlabs/berth/internal/kubeadm"
	"github.com/berthlabs/berth/internal/repotest"
	"github.com/berthlabs/berth/test/lab"
)

// upgradeConfig is a lab cluster of one control-plane node and one worker, with its Kubernetes version, the
// image its machines boot and the images its join policy admits as variables. Unlike examples/lab, a
// machine is not replaced when its image changes: the new image is what the machine group boots from now on,
// as a launch template change is, and the group's roll puts it on the machines (here the test, reimaging
// them in place; on AWS an instance refresh). berth_cluster is not bound to its first machine's resource
// either: the cluster outlives the image it was made with.
const upgradeConfig = `
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

variable "kubernetes_version" {
  type = string
}

variable "image" {
  type = string
}

variable "allowed_images" {
  type = list(string)
}

variable "second_control_plane" {
  type = bool
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

data "berth_image" "lab" {
  path = "${var.lab_dir}/berth-image.json"
}

data "berth_image" "first" {
  path = "${var.lab_dir}/berth-image.json"
  name = "berthlab-a"
}

data "berth_node_config" "control_plane" {
  cluster_name     = "berthlab"
  join_ca_pin      = berth_secrets.lab.join_ca_pin
  init_secret_hash = berth_secrets.lab.init_secret_hash
}

data "berth_node_config" "worker" {
  cluster_name = "berthlab"
  join_ca_pin  = berth_secrets.lab.join_ca_pin
}

# The second control-plane machine comes last, so that adding it leaves the others' indexes as they are.
locals {
  machines = concat([
    { name = "cp-0", role = "control-plane", address = "10.250.0.10", user_data = data.berth_node_config.control_plane.json },
    { name = "worker-0", role = "worker", address = "10.250.0.20", user_data = data.berth_node_config.worker.json },
    ], var.second_control_plane ? [
    { name = "cp-1", role = "control-plane", address = "10.250.0.11", user_data = data.berth_node_config.control_plane.json },
  ] : [])
}

resource "terraform_data" "machine" {
  count            = length(local.machines)
  input            = merge(local.machines[count.index], { image = var.image, lab = var.berth_lab, dir = var.lab_dir })
  triggers_replace = local.machines[count.index]

  provisioner "local-exec" {
    command     = "\"$LAB\" node up --dir \"$DIR\" --name \"$NAME\" --role \"$ROLE\" --addr \"$ADDR\" --image \"$IMAGE\" --user-data \"$USER_DATA\""
    environment = { LAB = self.input.lab, DIR = self.input.dir, NAME = self.input.name, ROLE = self.input.role, ADDR = self.input.address, IMAGE = self.input.image, USER_DATA = self.input.user_data }
  }

  provisioner "local-exec" {
    when        = destroy
    command     = "\"$LAB\" node down --dir \"$DIR\" --name \"$NAME\""
    environment = { LAB = self.input.lab, DIR = self.input.dir, NAME = self.input.name }
  }
}

resource "berth_cluster" "lab" {
  endpoint           = "10.250.0.10:7451"
  cluster_name       = "berthlab"
  kubernetes_version = var.kubernetes_version
  upgrade_timeout    = "20m"
  pcrs               = data.berth_image.first.pcrs
  ek_ca_certificates = file("${var.lab_dir}/ek-ca.pem")
  # kubeadm joins a second control-plane node only to a cluster made with an endpoint for its API servers.
  control_plane_endpoint = "10.250.0.10:6443"

  kubernetes_ca_certificate = berth_secrets.lab.kubernetes_ca_certificate
  join_ca_certificate       = berth_secrets.lab.join_ca_certificate
  init_secret_wo            = ephemeral.berth_secrets.lab.init_secret
  master_secret_wo          = ephemeral.berth_secrets.lab.master_secret
  salt_wo                   = ephemeral.berth_secrets.lab.salt
  kubernetes_ca_key_wo      = ephemeral.berth_secrets.lab.kubernetes_ca_key
  join_ca_key_wo            = ephemeral.berth_secrets.lab.join_ca_key

  depends_on = [terraform_data.machine]
}

provider "berth" {
  alias      = "lab"
  kubeconfig = berth_cluster.lab.kubeconfig
}

resource "berth_join_policy" "lab" {
  provider   = berth.lab
  cluster_id = berth_cluster.lab.cluster_id
  images = [for image in data.berth_image.lab.images : {
    name               = image.name
    roles              = ["control-plane", "worker"]
    pcrs               = image.pcrs
    kubernetes_version = image.components["kubernetes"]
  } if contains(var.allowed_images, image.name)]
}
`

// TestKubernetesUpgrade is issue 31's test: a lab cluster made at the previous minor release
// (BERTH_KUBE_PREV_BIN) by the real terraform is upgraded by it to the lab's release (BERTH_KUBE_BIN) in two
// steps, a minor and a patch: to the patch release before the lab's (BERTH_KUBE_PATCH_BIN, the lab's code
// stamped with that version), then to the lab's. The join policy gains images of both first; then for each
// step kubernetes_version moves while the roll, as the apply waits, brings the new image to the control
// plane: for the minor by reimaging the control-plane node, which leads; for the patch by a new
// control-plane node, which joins and leads, and then by reimaging the first, which follows. The worker rolls
// after, and the agents upgrade the addons. A Deployment with a replica on cp-0 and on the worker answers
// through a NodePort Service from start to end, the ConfigMaps and Secrets of before are all there after,
// and after each step every node, the API servers, kube-proxy and CoreDNS run its release. Plans refuse a
// skipped minor and a downgrade, and after the upgrade plan nothing.
func TestKubernetesUpgrade(t *testing.T) {
	if os.Getenv(resource.EnvTfAcc) == "" {
		t.Skip("acceptance test against a real lab: make testacc runs it (TF_ACC=1, root)")
	}
	repotest.NeedsRoot(t, "the lab makes network and mount namespaces, cgroups and LUKS images")
	var bins []string
	for _, env := range []string{"BERTH_KUBE_PREV_BIN", "BERTH_KUBE_PATCH_BIN", "BERTH_KUBE_BIN"} {
		if bins = append(bins, os.Getenv(env)); bins[len(bins)-1] == "" {
			t.Fatalf("%s is not set: make testacc builds the three releases (scripts/build-k8s.sh with --module "+
				"test/k8sprevtools, with --patch-before, and alone)", env)
		}
	}
	agent := repotest.BuildBinary(t, "./nodeagent/cmd/berth-agent", "")
	labBin := repotest.BuildBinary(t, "./test/lab/cmd/berth-lab", "")

	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Minute)
	defer cancel()
	host, dir, progress := startAccLab(ctx, t, lab.HostConfig{KubeBin: bins[0], UpgradeKubeBins: bins[1:], AgentBinary: agent, LabBinary: labBin})
	releases := []string{host.KubernetesVersion()}
	for _, bin := range bins[1:] {
		r, err := (&kubeadm.Exec{Binary: filepath.Join(bin, "kubeadm")}).Version(ctx)
		if err != nil {
			t.Fatal(err)
		}
		releases = append(releases, r)
	}
	for i, want := range []kubeadm.Step{kubeadm.StepMinor, kubeadm.StepPatch} {
		if step, err := kubeadm.UpgradeStep(releases[i], releases[i+1]); err != nil || step != want {
			t.Fatalf("%s to %s is not the step the test needs (%v, %v)", releases[i], releases[i+1], step, err)
		}
	}
	from, mid, target := releases[0], releases[1], releases[2]
	t.Logf("upgrading a cluster of %s to %s, then to %s", from, mid, target)

	root := make([]byte, 32)
	if _, err := rand.Read(root); err != nil {
		t.Fatal(err)
	}
	t.Setenv("TF_CLI_CONFIG_FILE", providerMirror(t))
	old, up1, up2 := lab.ImageNames[0], lab.UpgradeImage(0), lab.UpgradeImage(1)
	all := []string{old, up1, up2}
	vars := func(version, image string, allowed []string, secondControlPlane bool) config.Variables {
		var list []config.Variable
		for _, a := range allowed {
			list = append(list, config.StringVariable(a))
		}
		return config.Variables{
			"root_key":             config.StringVariable(base64.StdEncoding.EncodeToString(root)),
			"lab_dir":              config.StringVariable(dir),
			"berth_lab":            config.StringVariable(labBin),
			"kubernetes_version":   config.StringVariable(version),
			"image":                config.StringVariable(image),
			"allowed_images":       config.ListVariable(list...),
			"second_control_plane": config.BoolVariable(secondControlPlane),
		}
	}
	skipped, err := otherMinor(from, 2)
	if err != nil {
		t.Fatal(err)
	}
	down, err := otherMinor(from, -1)
	if err != nil {
		t.Fatal(err)
	}
	u := &upgradeRun{dir: dir, progress: progress}
	mirrored := map[string]resource.ExternalProvider{"berth": {Source: "berthlabs/berth"}}
	step := func(s resource.TestStep) resource.TestStep {
		s.Config, s.ExternalProviders = upgradeConfig, mirrored
		return s
	}
	// upgrade is the step of an upgrade to release, whose machines boot image. Without a second
	// control-plane node, the roll reimages cp-0 as soon as the record names the target, and cp-0 leads the
	// upgrade (`kubeadm upgrade apply`). With one, cp-1 is a new machine of image: it joins at the current
	// release and leads, and the roll reimages cp-0 once kubeadm-config names the target, which then upgrades
	// its own control plane (`kubeadm upgrade node`). The worker rolls after the apply.
	upgrade := func(release, image string, secondControlPlane bool) resource.TestStep {
		leader, rollAfter, followers, nodes := "cp-0", clusterinfo.PhaseInstructed, []string(nil), []string{"cp-0", "worker-0"}
		if secondControlPlane {
			leader, rollAfter, followers, nodes = "cp-1", clusterinfo.PhaseApplied, []string{"cp-0"}, append(nodes, "cp-1")
		}
		return step(resource.TestStep{
			PreConfig:       func() { u.rollControlPlane(ctx, t, release, image, rollAfter) },
			ConfigVariables: vars(release, image, all, secondControlPlane),
			ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{
				plancheck.ExpectResourceAction("berth_cluster.lab", plancheck.ResourceActionUpdate),
			}},
			Check: resource.ComposeTestCheckFunc(
				resource.TestCheckResourceAttr("berth_cluster.lab", "kubernetes_version", release),
				u.checkControlPlane(ctx, t, release, leader, followers...),
				u.rollWorker(ctx, t, image),
				u.checkUpgraded(ctx, t, release, nodes...),
			),
		})
	}
	resource.Test(t, resource.TestCase{
		Steps: []resource.TestStep{
			step(resource.TestStep{
				ConfigVariables: vars(from, old, []string{old}, false),
				Check: resource.ComposeTestCheckFunc(
					resource.TestCheckResourceAttr("berth_cluster.lab", "kubernetes_version", from),
					nodesReady(ctx, dir, "cp-0", "worker-0"),
					u.startWorkload(ctx, t),
				),
			}),
			// The images of the new releases join the policy first: the plan of an upgrade looks for them in
			// the live policy, and the control-plane node seals its disk key to it before the roll reimages it.
			step(resource.TestStep{
				ConfigVariables: vars(from, old, all, false),
				Check:           u.diskKeySealed(ctx, all...),
			}),
			step(resource.TestStep{
				ConfigVariables: vars(skipped, old, all, false),
				PlanOnly:        true,
				ExpectError:     regexp.MustCompile(`skips\s+a\s+minor:\s+kubeadm\s+upgrades\s+one\s+minor\s+at\s+a\s+time`),
			}),
			step(resource.TestStep{
				ConfigVariables: vars(down, old, all, false),
				PlanOnly:        true,
				ExpectError:     regexp.MustCompile(`is\s+a\s+downgrade`),
			}),
			upgrade(mid, up1, false),
			upgrade(target, up2, true),
			step(resource.TestStep{
				ConfigVariables: vars(target, up2, all, true),
				PlanOnly:        true,
			}),
		},
	})
}

// otherMinor is the first release of the minor delta minors from release's.
func otherMinor(release string, delta int) (string, error) {
	var major, minor, patch int
	if _, err := fmt.Sscanf(release, "v%d.%d.%d", &major, &minor, &patch); err != nil {
		return "", fmt.Errorf("release %q: %w", release, err)
	}
	return fmt.Sprintf("v%d.%d.0", major, minor+delta), nil
}

// upgradeRun is what the steps of TestKubernetesUpgrade share: the lab, the workload and what was in the
// cluster before the upgrade.
type upgradeRun struct {
	dir      string
	progress io.Writer
	kube     kubernetes.Interface
	lab      *lab.Lab
	// objects are the namespace/name of every ConfigMap and Secret before the upgrade, and kept the data
	// of the two the test wrote.
	objects []string
	kept    map[string]string
	probe   *serviceProbe
	// rolled is closed when the control-plane roll ends, and rollErr says how.
	rolled  chan struct{}
	rollErr error
}

const (
	upgradeWorkload = "web"
	// upgradeNodePort is where the workload's NodePort Service answers on every node: the host asks it
	// there, as a load balancer in front of the nodes would.
	upgradeNodePort = 30080
)

// startWorkload runs the probe's Deployment with a replica on each node behind a NodePort Service, starts
// asking it, and writes a ConfigMap and a Secret.
func (u *upgradeRun) startWorkload(ctx context.Context, t *testing.T) resource.TestCheckFunc {
	return func(s *terraform.State) error {
		kube, kubeconfig, err := clusterKube(s)
		if err != nil {
			return err
		}
		u.kube = kube
		if u.lab, err = lab.Open(u.dir); err != nil {
			return err
		}
		u.lab.Progress = u.progress
		u.lab.Kubeconfig = filepath.Join(u.dir, "admin.conf")
		if err := os.WriteFile(u.lab.Kubeconfig, []byte(kubeconfig), 0o600); err != nil {
			return err
		}
		if err := u.lab.WaitAddons(ctx); err != nil {
			return err
		}
		if err := u.lab.ServeProbe(ctx, upgradeWorkload, []string{"cp-0", "worker-0"}); err != nil {
			return err
		}
		svc := &corev1.Service{
			ObjectMeta: metav1.ObjectMeta{Name: upgradeWorkload + "-nodeport", Namespace: "default"},
			Spec: corev1.ServiceSpec{
				Type:     corev1.ServiceTypeNodePort,
				Selector: map[string]string{"app": upgradeWorkload},
				Ports:    []corev1.ServicePort{{Port: 8080, TargetPort: intstr.FromInt32(8080), NodePort: upgradeNodePort}},
			},
		}
		if _, err := kube.CoreV1().Services("default").Create(ctx, svc, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("the workload's NodePort Service: %w", err)
		}
		u.kept = map[string]string{"config": "kept across the upgrade", "secret": "still secret after it"}
		_, err = kube.CoreV1().ConfigMaps("default").Create(ctx, &corev1.ConfigMap{
			ObjectMeta: metav1.ObjectMeta{Name: "upgrade-kept"}, Data: map[string]string{"v": u.kept["config"]}}, metav1.CreateOptions{})
		if err != nil {
			return err
		}
		_, err = kube.CoreV1().Secrets("default").Create(ctx, &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Name: "upgrade-kept"}, StringData: map[string]string{"v": u.kept["secret"]}}, metav1.CreateOptions{})
		if err != nil {
			return err
		}
		if u.objects, err = configObjects(ctx, kube); err != nil {
			return err
		}
		var addrs []string
		for _, n := range u.lab.Nodes {
			addrs = append(addrs, fmt.Sprintf("%s:%d", n.Addr, upgradeNodePort))
		}
		u.probe = startServiceProbe(addrs)
		t.Cleanup(u.probe.stop)
		return u.probe.waitAnswered(ctx, 2)
	}
}

// configObjects names every ConfigMap and Secret of the cluster, as namespace/kind/name, but bootstrap
// tokens: the token cleaner deletes them when they expire, as it should.
func configObjects(ctx context.Context, kube kubernetes.Interface) ([]string, error) {
	var out []string
	cms, err := kube.CoreV1().ConfigMaps("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	for _, cm := range cms.Items {
		out = append(out, cm.Namespace+"/ConfigMap/"+cm.Name)
	}
	secrets, err := kube.CoreV1().Secrets("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	for _, s := range secrets.Items {
		if s.Type != corev1.SecretTypeBootstrapToken {
			out = append(out, s.Namespace+"/Secret/"+s.Name)
		}
	}
	slices.Sort(out)
	return out, nil
}

// diskKeySealed waits until cp-0's agent has sealed its disk key to a policy of exactly images: only then
// does a reimaged cp-0 unlock its disk with its TPM.
func (u *upgradeRun) diskKeySealed(ctx context.Context, images ...string) resource.TestCheckFunc {
	return func(*terraform.State) error {
		want := `"images":["` + strings.Join(images, `","`) + `"]`
		logPath := u.lab.Node("cp-0").AgentLog()
		for deadline := time.Now().Add(3 * time.Minute); ; time.Sleep(time.Second) {
			found, err := hasLogLine(logPath, func(entry map[string]any) bool {
				got, _ := entry["images"].([]any)
				var names []string
				for _, g := range got {
					name, _ := g.(string)
					names = append(names, name)
				}
				return entry["msg"] == "disk key sealed to the join policy" && slices.Equal(names, images)
			})
			if err != nil || found {
				return err
			}
			if time.Now().After(deadline) || ctx.Err() != nil {
				return fmt.Errorf("cp-0 did not seal its disk key to %s within 3 minutes (see %s)", want, logPath)
			}
		}
	}
}

// rollControlPlane starts the control-plane group's roll, as an operator starts an instance refresh while
// terraform apply waits: once the cluster record names release as the target and the upgrade has reached
// phase after, cp-0 is drained and reimaged with image.
func (u *upgradeRun) rollControlPlane(ctx context.Context, t *testing.T, release, image string, after clusterinfo.Phase) {
	u.rolled = make(chan struct{})
	go func() {
		defer close(u.rolled)
		u.rollErr = func() error {
			for {
				rec, err := clusterinfo.ReadUpgrade(ctx, u.kube)
				if err == nil && rec.Target == release && reached(rec.Phase, after) {
					break
				}
				select {
				case <-ctx.Done():
					return fmt.Errorf("the upgrade to %s never reached %s (last read: %+v, %v)", release, after, rec, err)
				case <-time.After(2 * time.Second):
				}
			}
			t.Logf("the upgrade to %s is %s: rolling cp-0 to %s", release, after, image)
			return u.reimage(ctx, "cp-0", image)
		}()
	}()
}

// reimage drains the node, reimages it with image, and makes it schedulable again once it is Ready.
func (u *upgradeRun) reimage(ctx context.Context, name, image string) error {
	if _, err := u.lab.Kubectl(ctx, "drain", name, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=3m"); err != nil {
		return fmt.Errorf("draining %s: %w", name, err)
	}
	n := u.lab.Node(name)
	since := time.Now()
	if err := n.Reimage(ctx, image); err != nil {
		return err
	}
	if err := u.lab.WaitRestarted(ctx, n, since); err != nil {
		return err
	}
	// The API server may restart meanwhile (the reimaged control-plane node upgrades its own).
	if err := u.kubectlUntil(ctx, "uncordon", name); err != nil {
		return fmt.Errorf("uncordoning %s: %w", name, err)
	}
	if err := u.kubectlUntil(ctx, "rollout", "status", "deployment/"+upgradeWorkload, "--timeout=3m"); err != nil {
		return fmt.Errorf("the workload after %s's roll: %w", name, err)
	}
	return nil
}

// kubectlUntil runs kubectl with args until it succeeds, for up to 10 minutes.
func (u *upgradeRun) kubectlUntil(ctx context.Context, args ...string) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	for {
		_, err := u.lab.Kubectl(ctx, args...)
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(5 * time.Second):
		}
	}
}

// reached says whether an upgrade in phase got as far as phase want.
func reached(phase, want clusterinfo.Phase) bool {
	order := []clusterinfo.Phase{clusterinfo.PhaseInstructed, clusterinfo.PhaseApplying, clusterinfo.PhaseApplied, clusterinfo.PhaseAddons, clusterinfo.PhaseDone}
	return slices.Index(order, phase) >= slices.Index(order, want)
}

// checkControlPlane checks, once the apply has returned, that the roll of cp-0 ended well, that the API
// servers and kubeadm-config run release, and that leader ran `kubeadm upgrade apply` and each of
// followers `kubeadm upgrade node` to it.
func (u *upgradeRun) checkControlPlane(ctx context.Context, t *testing.T, release, leader string, followers ...string) resource.TestCheckFunc {
	return func(*terraform.State) error {
		select {
		case <-u.rolled:
		case <-ctx.Done():
			return errors.New("the control-plane roll did not end")
		}
		if u.rollErr != nil {
			return fmt.Errorf("the control-plane roll: %w", u.rollErr)
		}
		look, err := lookUpgrade(ctx, u.kube)
		if err != nil {
			return err
		}
		if !look.reached(release) {
			return fmt.Errorf("the apply returned, but the control plane is not at %s: %s", release, look.describe(release))
		}
		rec, err := clusterinfo.ReadUpgrade(ctx, u.kube)
		if err != nil {
			return err
		}
		if rec.Target != release {
			return fmt.Errorf("the cluster record after the control plane's upgrade: %+v", rec)
		}
		t.Logf("control plane at %s; the record says %s by %s: %s", release, rec.Phase, rec.Node, rec.Message)
		steps := map[string]string{leader: "upgrade apply"}
		for _, f := range followers {
			steps[f] = "upgrade node"
		}
		for node, step := range steps {
			// By its path: cp-1 came after the lab was opened, from terraform's berth-lab node up.
			logPath := filepath.Join(u.dir, "nodes", node, "logs", "agent.log")
			ran, err := hasLogLine(logPath, func(entry map[string]any) bool {
				return entry["msg"] == "kubeadm" && entry["step"] == step && entry["target"] == release
			})
			if err != nil {
				return err
			}
			if !ran {
				return fmt.Errorf("%s's agent never ran kubeadm %s to %s (see %s)", node, step, release, logPath)
			}
		}
		return nil
	}
}

// rollWorker rolls the worker to image, as its group would after the control plane.
func (u *upgradeRun) rollWorker(ctx context.Context, t *testing.T, image string) resource.TestCheckFunc {
	return func(*terraform.State) error {
		t.Logf("rolling worker-0 to %s", image)
		return u.reimage(ctx, "worker-0", image)
	}
}

// checkUpgraded waits until the control plane's agents have upgraded the addons, then checks that every
// node, kube-proxy and CoreDNS run release, that the workload answered throughout, and that nothing was lost.
func (u *upgradeRun) checkUpgraded(ctx context.Context, t *testing.T, release string, want ...string) resource.TestCheckFunc {
	return func(*terraform.State) error {
		var rec clusterinfo.Upgrade
		for deadline := time.Now().Add(10 * time.Minute); rec.Target != release || rec.Phase != clusterinfo.PhaseDone; time.Sleep(5 * time.Second) {
			var err error
			if rec, err = clusterinfo.ReadUpgrade(ctx, u.kube); err != nil {
				return err
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("the upgrade did not reach %q within 10 minutes of the roll's end: %+v", clusterinfo.PhaseDone, rec)
			}
		}
		var errs []error
		nodes, err := u.kube.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		var names []string
		for _, n := range nodes.Items {
			names = append(names, n.Name)
			if v := n.Status.NodeInfo.KubeletVersion; v != release {
				errs = append(errs, fmt.Errorf("node %s's kubelet runs %s", n.Name, v))
			}
		}
		if slices.Sort(names); !slices.Equal(names, slices.Sorted(slices.Values(want))) {
			errs = append(errs, fmt.Errorf("nodes %v, want %v", names, want))
		}
		if err := u.addonsAt(ctx, release); err != nil {
			errs = append(errs, err)
		}
		after, err := configObjects(ctx, u.kube)
		if err != nil {
			return err
		}
		for _, o := range u.objects {
			if !slices.Contains(after, o) {
				errs = append(errs, fmt.Errorf("%s is gone after the upgrade", o))
			}
		}
		cm, err := u.kube.CoreV1().ConfigMaps("default").Get(ctx, "upgrade-kept", metav1.GetOptions{})
		if err != nil || cm.Data["v"] != u.kept["config"] {
			errs = append(errs, fmt.Errorf("ConfigMap upgrade-kept after the upgrade: %v %v", cm.Data, err))
		}
		secret, err := u.kube.CoreV1().Secrets("default").Get(ctx, "upgrade-kept", metav1.GetOptions{})
		if err != nil || string(secret.Data["v"]) != u.kept["secret"] {
			errs = append(errs, fmt.Errorf("Secret upgrade-kept after the upgrade: %v", err))
		}
		answered, failed, retried := u.probe.result()
		t.Logf("the workload's Service answered %d times so far, from pods %v; %d requests failed and were asked again",
			sum(answered), slices.Sorted(maps.Keys(answered)), retried)
		if len(failed) > 0 {
			errs = append(errs, fmt.Errorf("the workload's Service did not answer %d times during the upgrade; the first:\n%s",
				len(failed), strings.Join(failed[:min(len(failed), 5)], "\n")))
		}
		return errors.Join(errs...)
	}
}

// addonsAt checks that kube-proxy and CoreDNS were upgraded to release as its kubeadm does it, and that
// their pods run.
func (u *upgradeRun) addonsAt(ctx context.Context, release string) error {
	ds, err := u.kube.AppsV1().DaemonSets("kube-system").Get(ctx, "kube-proxy", metav1.GetOptions{})
	if err != nil {
		return err
	}
	if img := ds.Spec.Template.Spec.Containers[0].Image; !strings.HasSuffix(img, ":"+release) {
		return fmt.Errorf("kube-proxy runs %s after the upgrade to %s", img, release)
	}
	if _, err := u.lab.Kubectl(ctx, "-n", "kube-system", "rollout", "status", "daemonset/kube-proxy", "--timeout=3m"); err != nil {
		return fmt.Errorf("kube-proxy after the upgrade: %w", err)
	}
	dep, err := u.kube.AppsV1().Deployments("kube-system").Get(ctx, "coredns", metav1.GetOptions{})
	if err != nil {
		return err
	}
	if img, want := dep.Spec.Template.Spec.Containers[0].Image, u.lab.Node("cp-0").CoreDNSImage(); img != want {
		return fmt.Errorf("CoreDNS runs %s after the upgrade, kubeadm %s names %s", img, release, want)
	}
	if _, err := u.lab.Kubectl(ctx, "-n", "kube-system", "rollout", "status", "deployment/coredns", "--timeout=3m"); err != nil {
		return fmt.Errorf("CoreDNS after the upgrade: %w", err)
	}
	return nil
}

// serviceProbe asks the workload's NodePort Service on every node, once a second, as a load balancer in
// front of the nodes would: a round succeeds when any node answers. It records which pods answered and,
// from the first answer on (kube-proxy takes a moment to serve a new Service), every round that got none
// and how many requests failed in rounds that did.
type serviceProbe struct {
	addrs    []string
	mu       sync.Mutex
	answered map[string]int
	failed   []string
	retried  int
	done     chan struct{}
	stopped  chan struct{}
	once     sync.Once
}

func startServiceProbe(addrs []string) *serviceProbe {
	p := &serviceProbe{addrs: addrs, answered: map[string]int{}, done: make(chan struct{}), stopped: make(chan struct{})}
	go p.run()
	return p
}

func (p *serviceProbe) run() {
	defer close(p.stopped)
	// A new connection each time: kube-proxy picks a pod per connection, and a kept one would always reach
	// the same pod.
	client := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	for {
		var errs []string
		answered := ""
		// Three passes over the nodes, as a client that retries: a request in flight to a node that
		// powers off is reset, and the rules of the node it reaches next may lag that by a moment.
		for pass := 0; pass < 3 && answered == ""; pass++ {
			if pass > 0 {
				time.Sleep(300 * time.Millisecond)
			}
			for _, addr := range p.addrs {
				pod, err := askPod(client, "http://"+addr+"/")
				if err == nil {
					answered = pod
					break
				}
				errs = append(errs, err.Error())
			}
		}
		p.mu.Lock()
		if len(p.answered) > 0 {
			p.retried += len(errs)
		}
		if answered != "" {
			p.answered[answered]++
		} else if len(p.answered) > 0 {
			p.failed = append(p.failed, time.Now().Format(time.RFC3339)+": "+strings.Join(errs, "; "))
		}
		p.mu.Unlock()
		select {
		case <-p.done:
			return
		case <-time.After(time.Second):
		}
	}
}

func sum(counts map[string]int) int {
	n := 0
	for _, c := range counts {
		n += c
	}
	return n
}

func askPod(client *http.Client, url string) (string, error) {
	resp, err := client.Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1024))
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("%s: %s", url, resp.Status)
	}
	return strings.TrimSpace(string(body)), nil
}

// waitAnswered waits until pods different pods have answered since the probe started.
func (p *serviceProbe) waitAnswered(ctx context.Context, pods int) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	for {
		p.mu.Lock()
		n, failed := len(p.answered), slices.Clone(p.failed)
		p.mu.Unlock()
		if n >= pods {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("the workload's Service: %d pods answered, want %d; failed rounds: %q", n, pods, failed)
		case <-time.After(time.Second):
		}
	}
}

func (p *serviceProbe) stop() {
	p.once.Do(func() { close(p.done) })
	<-p.stopped
}

func (p *serviceProbe) result() (answered map[string]int, failed []string, retried int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return maps.Clone(p.answered), slices.Clone(p.failed), p.retried
}
