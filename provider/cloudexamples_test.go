package provider

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/hashicorp/hcl/v2"
	"github.com/hashicorp/hcl/v2/hclsyntax"
	"github.com/zclconf/go-cty/cty"
)

// The cloud examples need providers this machine cannot download (hashicorp/aws, hashicorp/google), so
// terraform validate never sees them. These tests read their HCL instead and keep each setting that a first
// apply on the real cloud depends on, with the reason in the failure.

// cloudExample is the blocks of every .tf file of an example directory.
type cloudExample struct {
	t      *testing.T
	blocks hclsyntax.Blocks
}

func loadCloudExample(t *testing.T, dir string) cloudExample {
	t.Helper()
	files, err := filepath.Glob(filepath.Join("..", "examples", dir, "*.tf"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no .tf files in examples/%s: %v", dir, err)
	}
	var blocks hclsyntax.Blocks
	for _, name := range files {
		src, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		f, diags := hclsyntax.ParseConfig(src, name, hcl.InitialPos)
		if diags.HasErrors() {
			t.Fatal(diags)
		}
		blocks = append(blocks, f.Body.(*hclsyntax.Body).Blocks...)
	}
	return cloudExample{t: t, blocks: blocks}
}

// block is the top-level block of that type and those labels; it fails the test if there is none.
func (e cloudExample) block(typ string, labels ...string) *hclsyntax.Block {
	e.t.Helper()
	for _, b := range e.blocks {
		if b.Type == typ && slices.Equal(b.Labels, labels) {
			return b
		}
	}
	e.t.Fatalf("no %s %q block", typ, labels)
	return nil
}

// literal is the value of an attribute that is a literal (true, 3, "udp", ["8472"]), or cty.NilVal.
func literal(b *hclsyntax.Body, name string) cty.Value {
	attr, ok := b.Attributes[name]
	if !ok {
		return cty.NilVal
	}
	v, diags := attr.Expr.Value(nil)
	if diags.HasErrors() {
		return cty.NilVal
	}
	return v
}

// references is the root.name references an attribute's expression makes (var.x, aws_security_group.y).
func references(b *hclsyntax.Body, name string) []string {
	attr, ok := b.Attributes[name]
	if !ok {
		return nil
	}
	var refs []string
	for _, tr := range attr.Expr.Variables() {
		parts := []string{tr.RootName()}
		for _, step := range tr[1:] {
			if a, ok := step.(hcl.TraverseAttr); ok {
				parts = append(parts, a.Name)
			}
		}
		refs = append(refs, strings.Join(parts, "."))
	}
	return refs
}

// ignoredChanges is what a block's lifecycle ignore_changes lists.
func ignoredChanges(b *hclsyntax.Block) []string {
	for _, lc := range b.Body.Blocks {
		if lc.Type == "lifecycle" {
			return references(lc.Body, "ignore_changes")
		}
	}
	return nil
}

// allowsUDP8472 says whether a rule block (an AWS ingress or a GCP allow) opens UDP 8472, Flannel's VXLAN.
func allowsUDP8472(b *hclsyntax.Body) bool {
	proto := literal(b, "protocol")
	if proto == cty.NilVal || proto.AsString() != "udp" {
		return false
	}
	if from, to := literal(b, "from_port"), literal(b, "to_port"); from != cty.NilVal && to != cty.NilVal {
		return from.Equals(cty.NumberIntVal(8472)).True() && to.Equals(cty.NumberIntVal(8472)).True()
	}
	ports := literal(b, "ports")
	return ports != cty.NilVal && ports.LengthInt() == 1 && ports.Index(cty.NumberIntVal(0)).AsString() == "8472"
}

func TestAWSExampleFirstApply(t *testing.T) {
	e := loadCloudExample(t, "aws")

	lb := e.block("resource", "aws_lb", "control_plane").Body
	if v := literal(lb, "enable_cross_zone_load_balancing"); v == cty.NilVal || v.False() {
		t.Error("aws_lb.control_plane: enable_cross_zone_load_balancing must be true: a network load balancer's default is off, and a zone without a control-plane node would answer nothing")
	}
	if v := literal(e.block("resource", "aws_lb_target_group", "join").Body, "preserve_client_ip"); v == cty.NilVal || v.False() {
		t.Error("aws_lb_target_group.join: preserve_client_ip must be true: the join service admits nodes by their source address")
	}
	if v := literal(e.block("resource", "aws_lb_target_group", "api").Body, "preserve_client_ip"); v == cty.NilVal || v.True() {
		t.Error("aws_lb_target_group.api: preserve_client_ip must be false: a node reaching its own API server through the load balancer (kubeadm init) would hang")
	}

	if v := literal(e.block("variable", "control_plane_nodes").Body, "default"); v == cty.NilVal || !v.Equals(cty.NumberIntVal(3)).True() {
		t.Errorf("variable control_plane_nodes defaults to %#v, want 3: one control-plane node is a cluster that dies with its instance", v)
	}
	group := e.block("resource", "aws_autoscaling_group", "control_plane").Body
	for _, size := range []string{"min_size", "max_size", "desired_capacity"} {
		if refs := references(group, size); !slices.Equal(refs, []string{"var.control_plane_nodes"}) {
			t.Errorf("aws_autoscaling_group.control_plane: %s is %v, want var.control_plane_nodes", size, refs)
		}
	}
	if ignored := ignoredChanges(e.block("resource", "berth_cluster", "prod")); !slices.Contains(ignored, "endpoint") || !slices.Contains(ignored, "aws") {
		t.Errorf("berth_cluster.prod ignores changes of %v, want endpoint and aws: the instance that initialized the cluster matters only at init, and the group lists several in no fixed order", ignored)
	}

	pods := e.block("resource", "aws_security_group", "pod_network").Body
	opened := false
	for _, rule := range pods.Blocks {
		if rule.Type == "ingress" && allowsUDP8472(rule.Body) {
			selfRule := literal(rule.Body, "self")
			opened = selfRule != cty.NilVal && selfRule.True()
		}
	}
	if !opened {
		t.Error("aws_security_group.pod_network must let its members send UDP 8472 (Flannel's VXLAN) to each other")
	}
	nodes := e.block("resource", "aws_launch_template", "node").Body
	if !slices.Contains(references(nodes, "vpc_security_group_ids"), "aws_security_group.pod_network.id") {
		t.Error("aws_launch_template.node must put every node in aws_security_group.pod_network")
	}

	// The cloud controller manager reads the cluster's id from its own instance's tags.
	locals := &hcl.EvalContext{Variables: map[string]cty.Value{"local": cty.ObjectVal(map[string]cty.Value{"cluster_name": cty.StringVal("prod")})}}
	for _, name := range []string{"control_plane", "worker"} {
		tagged := false
		for _, tag := range e.block("resource", "aws_autoscaling_group", name).Body.Blocks {
			if tag.Type != "tag" || tag.Body.Attributes["key"] == nil {
				continue
			}
			key, diags := tag.Body.Attributes["key"].Expr.Value(locals)
			propagate := literal(tag.Body, "propagate_at_launch")
			tagged = tagged || !diags.HasErrors() && key.AsString() == "kubernetes.io/cluster/prod" &&
				literal(tag.Body, "value").RawEquals(cty.StringVal("owned")) && propagate != cty.NilVal && propagate.True()
		}
		if !tagged {
			t.Errorf("aws_autoscaling_group.%s must tag its instances kubernetes.io/cluster/<cluster> = owned at launch, for the cloud controller manager", name)
		}
	}
	iam := e.block("data", "aws_iam_policy_document", "cloud_controller_manager").Body
	var actions []string
	for _, st := range iam.Blocks {
		if v := literal(st.Body, "actions"); v != cty.NilVal {
			for _, a := range v.AsValueSlice() {
				actions = append(actions, a.AsString())
			}
		}
	}
	for _, want := range []string{"ec2:DescribeInstances", "ec2:DescribeAvailabilityZones", "ec2:DescribeInstanceTopology", "elasticloadbalancing:CreateLoadBalancer"} {
		if !slices.Contains(actions, want) {
			t.Errorf("the cloud controller manager's policy lacks %s (it has %v)", want, actions)
		}
	}
}

func TestGCPExampleFirstApply(t *testing.T) {
	e := loadCloudExample(t, "gcp")
	rule := e.block("resource", "google_compute_firewall", "pod_network").Body
	opened := false
	for _, allow := range rule.Blocks {
		opened = opened || (allow.Type == "allow" && allowsUDP8472(allow.Body))
	}
	if !opened {
		t.Error("google_compute_firewall.pod_network must allow UDP 8472 (Flannel's VXLAN) between nodes")
	}
	if ignored := ignoredChanges(e.block("resource", "berth_cluster", "prod")); !slices.Contains(ignored, "endpoint") || !slices.Contains(ignored, "gcp") {
		t.Errorf("berth_cluster.prod ignores changes of %v, want endpoint and gcp", ignored)
	}

	// A Shared VPC: the network's resources are the host project's, and the rules are made there.
	for _, b := range e.blocks {
		if b.Type != "resource" || len(b.Labels) != 2 {
			continue
		}
		switch b.Labels[0] {
		case "google_compute_network", "google_compute_subnetwork", "google_compute_router", "google_compute_router_nat":
			if refs := references(b.Body, "count"); !slices.Equal(refs, []string{"var.shared_vpc"}) {
				t.Errorf("%s.%s: count depends on %v, want var.shared_vpc: with a Shared VPC the host project owns it", b.Labels[0], b.Labels[1], refs)
			}
		case "google_compute_firewall":
			if refs := references(b.Body, "project"); !slices.Equal(refs, []string{"local.network_project"}) {
				t.Errorf("google_compute_firewall.%s: project is %v, want local.network_project: a Shared VPC's rules live in its host project", b.Labels[1], refs)
			}
			if refs := references(b.Body, "network"); !slices.Equal(refs, []string{"local.network"}) {
				t.Errorf("google_compute_firewall.%s: network is %v, want local.network", b.Labels[1], refs)
			}
		}
	}

	// The cloud controller manager runs as the control-plane nodes' service account, and opens the firewall
	// for LoadBalancer Services to the nodes' network tag, its cloud config's node-tags.
	ccm := e.block("resource", "google_project_iam_member", "cloud_controller_manager").Body
	if refs := references(ccm, "member"); !slices.Equal(refs, []string{"google_service_account.control_plane.email"}) {
		t.Errorf("google_project_iam_member.cloud_controller_manager: member is %v, want the control-plane service account", refs)
	}
	if refs := references(e.block("resource", "google_compute_instance_template", "node").Body, "tags"); !slices.Equal(refs, []string{"local.cluster_name"}) {
		t.Errorf("google_compute_instance_template.node: tags %v, want the cluster's node tag", refs)
	}
}

// resolved is the references of an attribute's expression with every local.x replaced, recursively, by the
// references of that local's own expression: what the value is made of, whichever locals it went through.
func (e cloudExample) resolved(b *hclsyntax.Body, name string) []string {
	var out []string
	var walk func(refs []string, depth int)
	walk = func(refs []string, depth int) {
		for _, ref := range refs {
			local, ok := strings.CutPrefix(ref, "local.")
			if !ok || depth > 10 {
				if !slices.Contains(out, ref) {
					out = append(out, ref)
				}
				continue
			}
			found := false
			for _, lb := range e.blocks {
				if _, ok := lb.Body.Attributes[local]; ok && lb.Type == "locals" {
					walk(references(lb.Body, local), depth+1)
					found = true
				}
			}
			if !found && !slices.Contains(out, ref) {
				out = append(out, ref)
			}
		}
	}
	walk(references(b, name), 0)
	slices.Sort(out)
	return out
}

// preventsDestroy says whether a block's lifecycle sets prevent_destroy.
func preventsDestroy(b *hclsyntax.Block) bool {
	for _, lc := range b.Body.Blocks {
		if lc.Type == "lifecycle" {
			v := literal(lc.Body, "prevent_destroy")
			return v != cty.NilVal && v.True()
		}
	}
	return false
}

// rootKeyStore names, for one cloud, the secret store's resources and arguments the root key goes through.
type rootKeyStore struct {
	secret, version       string // resource types: the secret, and its version that holds the key
	versionSecret         string // the version's argument naming its secret, which the read names too
	writeOnly, woVersion  string // the version's write-only value and its version
	plain                 string // the version's argument that would keep the key in Terraform state
	readSecret, readValue string // the ephemeral read's argument naming the secret, and its attribute holding the key
}

// checkRootKeyFromStore keeps the root key's life: made once, kept in the cloud's secret store, read back by
// every run. Never a variable filled in at each apply: a fresh random value there derives another CA, and
// berth_cluster fails at the next apply.
func checkRootKeyFromStore(t *testing.T, e cloudExample, s rootKeyStore) {
	t.Helper()
	for _, b := range e.blocks {
		if b.Type == "variable" && slices.Equal(b.Labels, []string{"root_key"}) {
			t.Errorf("variable \"root_key\" at %s: a key given at each apply is how a fresh random key reached berth_secrets; the key must come from the %s", b.DefRange(), s.secret)
		}
	}

	read := "ephemeral." + s.version + ".root_key." + s.readValue
	for _, use := range []struct {
		name, attr string
		body       *hclsyntax.Body
	}{
		{"berth_secrets.cluster", "root_key_wo", e.block("resource", "berth_secrets", "cluster").Body},
		{"ephemeral.berth_secrets.cluster", "root_key", e.block("ephemeral", "berth_secrets", "cluster").Body},
	} {
		if refs := e.resolved(use.body, use.attr); !slices.Equal(refs, []string{read}) {
			t.Errorf("%s: %s is made of %v, want %s only: the key read back from the store, the same at every run", use.name, use.attr, refs, read)
		}
	}

	readBlock := e.block("ephemeral", s.version, "root_key").Body
	if refs := e.resolved(readBlock, s.readSecret); !slices.Contains(refs, s.version+".root_key."+s.versionSecret) || !slices.Contains(refs, "var.root_key_secret") {
		t.Errorf("ephemeral.%s.root_key: %s is made of %v, want %s.root_key.%s and var.root_key_secret: named through the version, the first apply reads the key only after writing it, and a team's own secret is read instead",
			s.version, s.readSecret, refs, s.version, s.versionSecret)
	}

	version := e.block("resource", s.version, "root_key")
	if _, ok := version.Body.Attributes[s.plain]; ok {
		t.Errorf("%s.root_key sets %s: Terraform state would hold the root key; use the write-only %s", s.version, s.plain, s.writeOnly)
	}
	if refs := e.resolved(version.Body, s.writeOnly); !slices.Equal(refs, []string{"ephemeral.random_bytes.root_key.base64"}) {
		t.Errorf("%s.root_key: %s is made of %v, want ephemeral.random_bytes.root_key.base64: random bytes in base64, which nothing stores", s.version, s.writeOnly, refs)
	}
	if v := literal(version.Body, s.woVersion); v == cty.NilVal || !v.Equals(cty.NumberIntVal(1)).True() {
		t.Errorf("%s.root_key: %s is %#v, want the literal 1: a fixed version writes the key once, and no later apply writes another", s.version, s.woVersion, v)
	}

	bytes := e.block("ephemeral", "random_bytes", "root_key").Body
	if v := literal(bytes, "length"); v == cty.NilVal || v.LessThan(cty.NumberIntVal(32)).True() {
		t.Errorf("ephemeral.random_bytes.root_key: length is %#v, want 32 or more: berth refuses a root key of fewer than 32 bytes", v)
	}

	for _, typ := range []string{s.secret, s.version} {
		if !preventsDestroy(e.block("resource", typ, "root_key")) {
			t.Errorf("%s.root_key must set lifecycle.prevent_destroy: losing the root key loses every disk key of the cluster", typ)
		}
	}
	made := map[string]*hclsyntax.Body{
		"ephemeral.random_bytes.root_key": bytes,
		s.secret + ".root_key":            e.block("resource", s.secret, "root_key").Body,
		s.version + ".root_key":           version.Body,
	}
	for name, body := range made {
		if refs := e.resolved(body, "count"); !slices.Equal(refs, []string{"var.root_key_secret"}) {
			t.Errorf("%s: count depends on %v, want var.root_key_secret: with a secret of the team's own, nothing is made and nothing written", name, refs)
		}
	}
}

func TestAWSExampleRootKey(t *testing.T) {
	checkRootKeyFromStore(t, loadCloudExample(t, "aws"), rootKeyStore{
		secret:        "aws_secretsmanager_secret",
		version:       "aws_secretsmanager_secret_version",
		versionSecret: "secret_id",
		writeOnly:     "secret_string_wo",
		woVersion:     "secret_string_wo_version",
		plain:         "secret_string",
		readSecret:    "secret_id",
		readValue:     "secret_string",
	})
}

func TestGCPExampleRootKey(t *testing.T) {
	checkRootKeyFromStore(t, loadCloudExample(t, "gcp"), rootKeyStore{
		secret:        "google_secret_manager_secret",
		version:       "google_secret_manager_secret_version",
		versionSecret: "secret",
		writeOnly:     "secret_data_wo",
		woVersion:     "secret_data_wo_version",
		plain:         "secret_data",
		readSecret:    "secret",
		readValue:     "secret_data",
	})
}
