package provider

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/datasource"
	"github.com/hashicorp/terraform-plugin-framework/datasource/schema"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-log/tflog"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/berthlabs/berth/internal/backoff"
	"github.com/berthlabs/berth/internal/clusterinfo"
	"github.com/berthlabs/berth/internal/diskrecord"
	"github.com/berthlabs/berth/internal/kubeadm"
)

const (
	defaultHealthTimeout = "10m"
	// healthLookTimeout bounds one look at the cluster (/readyz and the node list), so that an API server
	// that accepts connections and never answers still leaves time for the next look.
	healthLookTimeout = 15 * time.Second
	// controlPlaneLabel is the label kubeadm puts on control-plane nodes; a node without it is a worker.
	controlPlaneLabel = "node-role.kubernetes.io/control-plane"
)

// healthPolling spaces the looks at the cluster: quick at first, since a run that just made the cluster
// often finds it healthy within seconds, then at most every 10 s, so that a 10-minute wait costs the API
// server about a hundred small requests.
var healthPolling = backoff.Policy{Initial: time.Second, Max: 10 * time.Second}

// joinLogHint is what the API does not hold: the join service keeps its refusals in its log only.
const joinLogHint = "Berth's join service keeps the reason it refuses a machine in its log only, not in the cluster: " +
	"on the control-plane nodes, `journalctl -u berth-agent` has one line per refusal (\"measurements refused\", " +
	"\"role refused\", \"attestation refused\", \"no instance record for this address\", ...) with the machine's " +
	"name in peer_node and the whole reason in reason."

var (
	_ datasource.DataSource                   = (*clusterHealthDataSource)(nil)
	_ datasource.DataSourceWithConfigure      = (*clusterHealthDataSource)(nil)
	_ datasource.DataSourceWithValidateConfig = (*clusterHealthDataSource)(nil)
)

// clusterHealthDataSource is berth_cluster_health: it waits until the cluster of its provider's kubeconfig
// answers and has the nodes it is asked for Ready.
type clusterHealthDataSource struct {
	kube        kubernetes.Interface
	kubeUnknown bool
}

func newClusterHealthDataSource() datasource.DataSource { return &clusterHealthDataSource{} }

type clusterHealthModel struct {
	Nodes                  types.Int64  `tfsdk:"nodes"`
	ControlPlaneNodes      types.Int64  `tfsdk:"control_plane_nodes"`
	WorkerNodes            types.Int64  `tfsdk:"worker_nodes"`
	NodeNames              types.Set    `tfsdk:"node_names"`
	Timeout                types.String `tfsdk:"timeout"`
	ReadyControlPlaneNodes types.List   `tfsdk:"ready_control_plane_nodes"`
	ReadyWorkerNodes       types.List   `tfsdk:"ready_worker_nodes"`
	KubernetesVersion      types.String `tfsdk:"kubernetes_version"`
	APIServerVersions      types.Map    `tfsdk:"api_server_versions"`
	KubeletVersions        types.Map    `tfsdk:"kubelet_versions"`
	Upgrade                types.Object `tfsdk:"upgrade"`
}

// upgradeAttrTypes are the attributes of berth_cluster_health's upgrade.
var upgradeAttrTypes = map[string]attr.Type{
	"target": types.StringType, "phase": types.StringType, "node": types.StringType,
	"time": types.StringType, "message": types.StringType,
}

func (d *clusterHealthDataSource) Metadata(_ context.Context, req datasource.MetadataRequest, resp *datasource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_cluster_health"
}

func (d *clusterHealthDataSource) Schema(_ context.Context, _ datasource.SchemaRequest, resp *datasource.SchemaResponse) {
	count := func(desc string) schema.Int64Attribute {
		return schema.Int64Attribute{Optional: true, MarkdownDescription: desc}
	}
	resp.Schema = schema.Schema{
		MarkdownDescription: "Waits until a cluster is usable: its API server answers `/readyz` and the nodes " +
			"asked for are `Ready`. Resources that need a working cluster (workloads through the `kubernetes` " +
			"or `helm` provider) then `depends_on` this data source.\n\n" +
			"It reaches the cluster through the **kubeconfig of its provider configuration**, like " +
			"`berth_join_policy`: an aliased `berth` provider with `kubeconfig = berth_cluster.<name>.kubeconfig` " +
			"(the stored admin credentials) or `kubeconfig = ephemeral.berth_admin_credentials.<name>.kubeconfig` " +
			"(credentials minted for each run, never stored). Terraform accepts ephemeral values in provider " +
			"configuration but not in a data source's arguments, and provider configuration is never stored: " +
			"so the credentials stay out of this data source's state either way.\n\n" +
			"**When it runs.** Terraform reads a data source while it plans, unless its arguments are unknown " +
			"then or a resource in its `depends_on` has changes planned: then it reads it during apply, after " +
			"those resources. Give it `depends_on` on the resources that make the cluster and let machines " +
			"join (`berth_cluster`, `berth_join_policy`, the instances or groups of the nodes): in the run that " +
			"creates the cluster it then waits during apply, once the cluster exists; in later runs it checks " +
			"the running cluster while planning. Without that `depends_on`, the run that creates the cluster " +
			"fails at plan, since the provider's kubeconfig is not known yet.\n\n" +
			"Between looks it waits with a capped exponential backoff (1 s up to 10 s) and logs what it sees " +
			"at INFO (`TF_LOG_PROVIDER=INFO`). When `timeout` passes it fails with a diagnosis: the API " +
			"server's last answer, the nodes that are not `Ready` with their conditions' reasons, the wanted " +
			"nodes that never registered and whether the join service ever admitted them. The join service " +
			"keeps the reasons it refuses machines in its log only (`journalctl -u berth-agent` on the " +
			"control-plane nodes), which the diagnosis points to. Wrong credentials (a certificate the API " +
			"server refuses, one of another cluster, no right to list nodes) fail at once rather than after " +
			"the timeout.\n\n" +
			"A control-plane node is a node with the label `" + controlPlaneLabel + "` (kubeadm sets it); " +
			"every other node is a worker. With no node argument, it waits for the API server alone.\n\n" +
			"Once the cluster is healthy it reports the Kubernetes versions: the cluster's (kubeadm's " +
			"ClusterConfiguration), each API server's and each kubelet's, which show how far an upgrade or an " +
			"image roll has come. Credentials that may not list pods in `kube-system` or read " +
			"`kube-system/kubeadm-config` get a warning and null versions instead.",
		Attributes: map[string]schema.Attribute{
			"nodes": count("At least this many nodes, of any role, must be `Ready`."),
			"control_plane_nodes": count("At least this many control-plane nodes must be `Ready`, such as the size " +
				"of the control-plane group."),
			"worker_nodes": count("At least this many workers must be `Ready`, such as the desired capacity of the " +
				"worker groups."),
			"node_names": schema.SetAttribute{
				Optional:    true,
				ElementType: types.StringType,
				MarkdownDescription: "These nodes must be `Ready`: Kubernetes node names, the names the join " +
					"service gives machines (on EC2 the private DNS name, on Compute Engine the instance name).",
			},
			"timeout": schema.StringAttribute{
				Optional: true,
				MarkdownDescription: "How long to wait, as a Go duration (`90s`, `15m`). Default `" +
					defaultHealthTimeout + "`. Nodes booted in the same run need time to boot, attest and " +
					"join: a few minutes.",
			},
			"ready_control_plane_nodes": schema.ListAttribute{
				Computed:            true,
				ElementType:         types.StringType,
				MarkdownDescription: "Names of the `Ready` control-plane nodes when the wait ended, sorted.",
			},
			"ready_worker_nodes": schema.ListAttribute{
				Computed:            true,
				ElementType:         types.StringType,
				MarkdownDescription: "Names of the `Ready` workers when the wait ended, sorted.",
			},
			"kubernetes_version": schema.StringAttribute{
				Computed: true,
				MarkdownDescription: "The cluster's Kubernetes release as kubeadm records it (`kubernetesVersion` of " +
					"the ClusterConfiguration in `kube-system/kubeadm-config`): the one `kubeadm init` deployed, raised " +
					"by each `kubeadm upgrade apply`, and the one a joining control-plane node runs. Null for a cluster " +
					"kubeadm did not make.",
			},
			"api_server_versions": schema.MapAttribute{
				Computed:    true,
				ElementType: types.StringType,
				MarkdownDescription: "Release of each API server, by control-plane node: the tag of its `kube-apiserver` " +
					"image, which kubeadm tags with the release. During an upgrade the control-plane nodes differ " +
					"by one minor at most.",
			},
			"kubelet_versions": schema.MapAttribute{
				Computed:            true,
				ElementType:         types.StringType,
				MarkdownDescription: "Release of each node's kubelet, by node, as the node reports it.",
			},
			"upgrade": schema.SingleNestedAttribute{
				Computed: true,
				MarkdownDescription: "The Kubernetes upgrade the cluster was last told to make, as its record " +
					"(`kube-system/berth-cluster`) keeps it: null when none was. See docs/kubernetes-upgrades.md.",
				Attributes: map[string]schema.Attribute{
					"target": schema.StringAttribute{Computed: true, MarkdownDescription: "The release the cluster is to run."},
					"phase": schema.StringAttribute{Computed: true, MarkdownDescription: "`instructed` (no control-plane " +
						"node has acted yet), `applying` (a node runs `kubeadm upgrade apply`), `applied` (kubeadm's " +
						"configuration names the target; the other control-plane nodes and the roll follow), `addons` " +
						"(every node runs the target; kube-proxy and CoreDNS follow) or `done`."},
					"node":    schema.StringAttribute{Computed: true, MarkdownDescription: "The control-plane node that moved the upgrade to its phase."},
					"time":    schema.StringAttribute{Computed: true, MarkdownDescription: "When it did (RFC 3339)."},
					"message": schema.StringAttribute{Computed: true, MarkdownDescription: "The last failure of the phase's step, which its node retries; empty when none."},
				},
			},
		},
	}
}

func (d *clusterHealthDataSource) Configure(_ context.Context, req datasource.ConfigureRequest, _ *datasource.ConfigureResponse) {
	if data, ok := req.ProviderData.(*providerData); ok {
		d.kube, d.kubeUnknown = data.kube, data.kubeUnknown
	}
}

func (d *clusterHealthDataSource) ValidateConfig(ctx context.Context, req datasource.ValidateConfigRequest, resp *datasource.ValidateConfigResponse) {
	var m clusterHealthModel
	resp.Diagnostics.Append(req.Config.Get(ctx, &m)...)
	if resp.Diagnostics.HasError() {
		return
	}
	m.want(ctx, &resp.Diagnostics)
	m.timeout(&resp.Diagnostics)
}

// healthWant is what a healthy cluster shows besides a ready API server.
type healthWant struct {
	nodes, controlPlanes, workers int
	names                         []string
}

// want reads the node arguments; unknown ones (from resources not made yet) count as not set, which only
// ValidateConfig sees: Terraform reads a data source only once its arguments are known.
func (m *clusterHealthModel) want(ctx context.Context, diags *diag.Diagnostics) healthWant {
	var w healthWant
	for _, c := range []struct {
		name string
		v    types.Int64
		out  *int
	}{{"nodes", m.Nodes, &w.nodes}, {"control_plane_nodes", m.ControlPlaneNodes, &w.controlPlanes}, {"worker_nodes", m.WorkerNodes, &w.workers}} {
		if !known(c.v) {
			continue
		}
		if n := c.v.ValueInt64(); n < 0 {
			diags.AddAttributeError(path.Root(c.name), "Invalid node count", fmt.Sprintf("%s is %d; a count of nodes is 0 or more.", c.name, n))
		} else {
			*c.out = int(n)
		}
	}
	if known(m.NodeNames) && !slices.ContainsFunc(m.NodeNames.Elements(), func(v attr.Value) bool { return v.IsUnknown() }) {
		diags.Append(m.NodeNames.ElementsAs(ctx, &w.names, false)...)
		for _, n := range w.names {
			if n == "" {
				diags.AddAttributeError(path.Root("node_names"), "Invalid node name", "node_names holds an empty name.")
			}
		}
		slices.Sort(w.names)
	}
	return w
}

func (m *clusterHealthModel) timeout(diags *diag.Diagnostics) time.Duration {
	text := defaultHealthTimeout
	if m.Timeout.IsUnknown() {
		return 0
	}
	if !m.Timeout.IsNull() {
		text = m.Timeout.ValueString()
	}
	d, err := time.ParseDuration(text)
	if err == nil && d <= 0 {
		err = errors.New("it must be positive")
	}
	if err != nil {
		diags.AddAttributeError(path.Root("timeout"), "Invalid timeout",
			fmt.Sprintf("timeout %q is not a positive Go duration such as \"10m\" or \"90s\": %v", text, err))
	}
	return d
}

func (w healthWant) String() string {
	parts := []string{"the API server ready"}
	plural := func(n int, one, many string) string {
		if n == 1 {
			return "1 " + one
		}
		return fmt.Sprintf("%d %s", n, many)
	}
	if w.nodes > 0 {
		parts = append(parts, plural(w.nodes, "node", "nodes")+" Ready")
	}
	if w.controlPlanes > 0 {
		parts = append(parts, plural(w.controlPlanes, "control-plane node", "control-plane nodes")+" Ready")
	}
	if w.workers > 0 {
		parts = append(parts, plural(w.workers, "worker", "workers")+" Ready")
	}
	if len(w.names) > 0 {
		parts = append(parts, strings.Join(w.names, ", ")+" Ready")
	}
	return strings.Join(parts, "; ")
}

// nodeHealth is one node as the API server reports it.
type nodeHealth struct {
	name         string
	controlPlane bool
	ready        bool
	// why tells, for a node that is not Ready, what its conditions say.
	why string
	// kubelet is the release its kubelet reports.
	kubelet string
}

// healthReport is one look at the cluster.
type healthReport struct {
	// apiErr is why the look failed: /readyz did not answer 200, or the nodes could not be listed.
	apiErr error
	nodes  []nodeHealth // sorted by name
}

func (r *healthReport) node(name string) *nodeHealth {
	for i := range r.nodes {
		if r.nodes[i].name == name {
			return &r.nodes[i]
		}
	}
	return nil
}

func (r *healthReport) ready(controlPlane bool) []string {
	var names []string
	for _, n := range r.nodes {
		if n.ready && n.controlPlane == controlPlane {
			names = append(names, n.name)
		}
	}
	return names
}

// gaps says what keeps r from what w wants, one phrase each; none means the cluster is healthy.
func (w healthWant) gaps(r *healthReport) []string {
	if r.apiErr != nil {
		return []string{"API server: " + r.apiErr.Error()}
	}
	gaps := w.tooFew(r)
	for _, name := range w.names {
		switch n := r.node(name); {
		case n == nil:
			gaps = append(gaps, name+" not registered")
		case !n.ready:
			gaps = append(gaps, name+" not Ready ("+n.why+")")
		}
	}
	return gaps
}

// tooFew says which node counts r falls short of.
func (w healthWant) tooFew(r *healthReport) []string {
	var short []string
	cps, workers := len(r.ready(true)), len(r.ready(false))
	for _, c := range []struct {
		what       string
		want, have int
	}{{"nodes", w.nodes, cps + workers}, {"control-plane nodes", w.controlPlanes, cps}, {"workers", w.workers, workers}} {
		if c.have < c.want {
			short = append(short, fmt.Sprintf("%d of %d %s Ready", c.have, c.want, c.what))
		}
	}
	return short
}

// look asks the API server whether it is ready and lists the nodes. Credentials or a server that can never
// work are returned as permanent errors; anything else is in the report, to be looked at again.
func look(ctx context.Context, kube kubernetes.Interface) (*healthReport, error) {
	ctx, cancel := context.WithTimeout(ctx, healthLookTimeout)
	defer cancel()
	body, err := kube.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
	if err != nil {
		if perm := credentialsRefused(err); perm != nil {
			return nil, perm
		}
		return &healthReport{apiErr: readyzError(body, err)}, nil
	}
	list, err := kube.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		if perm := credentialsRefused(err); perm != nil {
			return nil, perm
		}
		return &healthReport{apiErr: fmt.Errorf("listing nodes: %w", err)}, nil
	}
	r := &healthReport{}
	for _, n := range list.Items {
		_, cp := n.Labels[controlPlaneLabel]
		ready, why := nodeReady(&n)
		r.nodes = append(r.nodes, nodeHealth{name: n.Name, controlPlane: cp, ready: ready, why: why,
			kubelet: n.Status.NodeInfo.KubeletVersion})
	}
	slices.SortFunc(r.nodes, func(a, b nodeHealth) int { return strings.Compare(a.name, b.name) })
	return r, nil
}

// readyzError names the checks that fail, which /readyz lists as "[-]<check> failed: ..." lines.
func readyzError(body []byte, err error) error {
	var failing []string
	for line := range strings.Lines(string(body)) {
		if check, ok := strings.CutPrefix(strings.TrimSpace(line), "[-]"); ok {
			failing = append(failing, check)
		}
	}
	if len(failing) > 0 {
		return fmt.Errorf("/readyz: not ready: %s", strings.Join(failing, "; "))
	}
	return fmt.Errorf("/readyz: %w", err)
}

// credentialsRefused tells failures that no wait mends: the server refuses the credentials, may not be
// asked for nodes by them, or proves it is not the cluster the kubeconfig's CA names.
func credentialsRefused(err error) error {
	var unknownCA x509.UnknownAuthorityError
	var verify *tls.CertificateVerificationError
	switch {
	case apierrors.IsUnauthorized(err):
		return backoff.Permanent(fmt.Errorf("the API server refuses the client certificate of the provider's "+
			"kubeconfig (%w): it was not issued by this cluster's CA, or it has expired", err))
	case apierrors.IsForbidden(err):
		return backoff.Permanent(fmt.Errorf("the credentials of the provider's kubeconfig may not list nodes "+
			"(%w): berth_cluster's kubeconfig and berth_admin_credentials are in the group kubeadm:cluster-admins, "+
			"which kubeadm binds to cluster-admin; other credentials need the right to get /readyz and list nodes", err))
	case errors.As(err, &unknownCA), errors.As(err, &verify):
		return backoff.Permanent(fmt.Errorf("the server's certificate does not verify against the CA of the "+
			"provider's kubeconfig (%w): another cluster, or something else, answers at that address", err))
	}
	return nil
}

// nodeReady reads the node's Ready condition, and for a node that is not Ready, what its conditions say.
func nodeReady(n *corev1.Node) (bool, string) {
	var why []string
	ready := false
	for _, c := range n.Status.Conditions {
		switch {
		case c.Type == corev1.NodeReady:
			ready = c.Status == corev1.ConditionTrue
			if !ready {
				why = append([]string{describeCondition(c)}, why...)
			}
		case c.Status == corev1.ConditionTrue:
			// Every other node condition (MemoryPressure, DiskPressure, PIDPressure, NetworkUnavailable) is a
			// trouble when true.
			why = append(why, describeCondition(c))
		}
	}
	if ready {
		return true, ""
	}
	if len(why) == 0 {
		return false, "no Ready condition yet: its kubelet has not reported"
	}
	return false, strings.Join(why, "; ")
}

func describeCondition(c corev1.NodeCondition) string {
	s := fmt.Sprintf("%s=%s", c.Type, c.Status)
	if c.Reason != "" {
		s += " " + c.Reason
	}
	if c.Message != "" {
		s += ": " + c.Message
	}
	if !c.LastTransitionTime.IsZero() {
		s += " (since " + c.LastTransitionTime.UTC().Format(time.RFC3339) + ")"
	}
	return s
}

// errStillWaiting makes backoff.Retry look again; the report says what is missing.
var errStillWaiting = errors.New("the cluster is not healthy yet")

// waitHealthy looks at the cluster until it shows what w wants or timeout passes. It returns the last
// report in either case; the error is permanent (credentials), the timeout, or the caller's cancellation.
// A look begun before the timeout may finish after it (within healthLookTimeout): cut short by the
// timeout, the last look would report the deadline (client-go's rate limiter refuses to wait past it)
// rather than the cluster, and the diagnosis would blame the API server.
func waitHealthy(ctx context.Context, kube kubernetes.Interface, w healthWant, timeout time.Duration,
	progress func(attempt int, r *healthReport, next time.Duration)) (*healthReport, error) {
	waitCtx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var last *healthReport
	err := backoff.Retry(waitCtx, healthPolling, nil, nil, func(context.Context) error {
		r, err := look(ctx, kube)
		if err != nil {
			return err
		}
		last = r
		if len(w.gaps(r)) > 0 {
			return errStillWaiting
		}
		return nil
	}, func(attempt int, _ error, next time.Duration) { progress(attempt, last, next) })
	return last, err
}

func (d *clusterHealthDataSource) Read(ctx context.Context, req datasource.ReadRequest, resp *datasource.ReadResponse) {
	var m clusterHealthModel
	resp.Diagnostics.Append(req.Config.Get(ctx, &m)...)
	if resp.Diagnostics.HasError() {
		return
	}
	want := m.want(ctx, &resp.Diagnostics)
	timeout := m.timeout(&resp.Diagnostics)
	switch {
	case d.kubeUnknown:
		resp.Diagnostics.AddError("The cluster's kubeconfig is not known yet",
			"berth_cluster_health was read while planning, but its provider's kubeconfig comes from a resource "+
				"that this run creates or changes. Add that resource (berth_cluster, and berth_join_policy and the "+
				"nodes' instances when waiting for nodes) to the data source's depends_on: Terraform then reads it "+
				"during apply, once the cluster exists.")
	case d.kube == nil:
		resp.Diagnostics.AddError("No cluster to check",
			"berth_cluster_health needs the kubeconfig of its provider configuration, for example "+
				"`provider \"berth\" { alias = \"cluster\" kubeconfig = ephemeral.berth_admin_credentials.this.kubeconfig }` "+
				"and `provider = berth.cluster` in the data source.")
	}
	if resp.Diagnostics.HasError() {
		return
	}

	tflog.Info(ctx, "waiting for the cluster", map[string]any{"wanted": want.String(), "timeout": timeout.String()})
	start := time.Now()
	report, err := waitHealthy(ctx, d.kube, want, timeout, func(attempt int, r *healthReport, next time.Duration) {
		tflog.Info(ctx, "the cluster is not healthy yet", map[string]any{
			"attempt": attempt, "waiting_for": strings.Join(want.gaps(r), "; "),
			"ready": readySummary(r), "next_look_in": next.Round(time.Millisecond).String()})
	})
	switch {
	case err == nil:
		tflog.Info(ctx, "the cluster is healthy", map[string]any{"ready": readySummary(report), "seconds": time.Since(start).Seconds()})
	case backoff.IsPermanent(err):
		resp.Diagnostics.AddError("Cannot check the cluster", "berth_cluster_health stopped: "+errors.Unwrap(err).Error()+".")
		return
	case ctx.Err() != nil:
		resp.Diagnostics.AddError("Waiting for the cluster was interrupted", err.Error())
		return
	default:
		resp.Diagnostics.AddError(fmt.Sprintf("The cluster is not healthy after %s", timeout),
			diagnose(ctx, d.kube, want, report, timeout))
		return
	}
	var diags diag.Diagnostics
	m.ReadyControlPlaneNodes, diags = types.ListValueFrom(ctx, types.StringType, nonNilStrings(report.ready(true)))
	resp.Diagnostics.Append(diags...)
	m.ReadyWorkerNodes, diags = types.ListValueFrom(ctx, types.StringType, nonNilStrings(report.ready(false)))
	resp.Diagnostics.Append(diags...)
	kubelets := map[string]string{}
	for _, n := range report.nodes {
		if n.kubelet != "" {
			kubelets[n.name] = n.kubelet
		}
	}
	m.KubeletVersions, diags = types.MapValueFrom(ctx, types.StringType, kubelets)
	resp.Diagnostics.Append(diags...)
	m.KubernetesVersion, m.APIServerVersions = types.StringNull(), types.MapNull(types.StringType)
	release, apiServers, err := readVersions(ctx, d.kube)
	if err != nil {
		resp.Diagnostics.AddWarning("The control plane's versions were not read",
			"berth_cluster_health found the cluster healthy but could not read its Kubernetes versions, so "+
				"kubernetes_version and api_server_versions are null: "+err.Error()+".")
	} else {
		if release != "" {
			m.KubernetesVersion = types.StringValue(release)
		}
		m.APIServerVersions, diags = types.MapValueFrom(ctx, types.StringType, apiServers)
		resp.Diagnostics.Append(diags...)
		tflog.Info(ctx, "Kubernetes versions", map[string]any{"cluster": release, "api_servers": apiServers, "kubelets": kubelets})
	}
	m.Upgrade = types.ObjectNull(upgradeAttrTypes)
	if u, err := readUpgrade(ctx, d.kube); err != nil {
		resp.Diagnostics.AddWarning("The cluster's upgrade was not read",
			"berth_cluster_health found the cluster healthy but could not read the upgrade in its record, so upgrade is null: "+err.Error()+".")
	} else if u.Target != "" {
		at := ""
		if !u.Time.IsZero() {
			at = u.Time.UTC().Format(time.RFC3339)
		}
		m.Upgrade, diags = types.ObjectValue(upgradeAttrTypes, map[string]attr.Value{
			"target": types.StringValue(u.Target), "phase": types.StringValue(string(u.Phase)), "node": types.StringValue(u.Node),
			"time": types.StringValue(at), "message": types.StringValue(u.Message),
		})
		resp.Diagnostics.Append(diags...)
		tflog.Info(ctx, "Kubernetes upgrade", map[string]any{"target": u.Target, "phase": string(u.Phase), "node": u.Node, "message": u.Message})
	}
	if resp.Diagnostics.HasError() {
		return
	}
	resp.Diagnostics.Append(resp.State.Set(ctx, &m)...)
}

// readUpgrade reads the cluster record's upgrade; none for a cluster without a record.
func readUpgrade(ctx context.Context, kube kubernetes.Interface) (clusterinfo.Upgrade, error) {
	ctx, cancel := context.WithTimeout(ctx, healthLookTimeout)
	defer cancel()
	u, err := clusterinfo.ReadUpgrade(ctx, kube)
	if errors.Is(err, clusterinfo.ErrNotFound) {
		return clusterinfo.Upgrade{}, nil
	}
	return u, err
}

// readVersions reads the cluster's release from kubeadm's configuration ("" when kubeadm did not make it)
// and each API server's.
func readVersions(ctx context.Context, kube kubernetes.Interface) (string, map[string]string, error) {
	ctx, cancel := context.WithTimeout(ctx, healthLookTimeout)
	defer cancel()
	release, _, err := kubeadm.ClusterRelease(ctx, kube)
	if err != nil {
		return "", nil, err
	}
	apiServers, err := kubeadm.APIServerReleases(ctx, kube)
	if err != nil {
		return "", nil, err
	}
	return release, apiServers, nil
}

// nonNilStrings makes an empty list of none, so that an output reads [] rather than null.
func nonNilStrings(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

func readySummary(r *healthReport) string {
	if r == nil || r.apiErr != nil {
		return "unknown"
	}
	var names []string
	for _, n := range r.nodes {
		if n.ready {
			names = append(names, n.name)
		}
	}
	if len(names) == 0 {
		return "none"
	}
	return strings.Join(names, ", ")
}

// diagnose explains a wait that timed out from its last report and, for nodes that never registered, the
// join service's records of the machines it admitted.
func diagnose(ctx context.Context, kube kubernetes.Interface, w healthWant, r *healthReport, timeout time.Duration) string {
	var b strings.Builder
	fmt.Fprintf(&b, "Wanted within %s: %s.\n", timeout, w)
	if r == nil {
		b.WriteString("\nThe API server was never asked: the time ran out before the first look.")
		return b.String()
	}
	if r.apiErr != nil {
		fmt.Fprintf(&b, "\nThe API server did not answer as ready at the last look: %v.\n\nIs the control-plane "+
			"node up, its API server started (kubeadm init done), and its address reachable from where Terraform "+
			"runs?", r.apiErr)
		return b.String()
	}
	b.WriteString("\nThe API server is ready.\n")
	for _, cp := range []bool{true, false} {
		role := "workers"
		if cp {
			role = "control-plane nodes"
		}
		names := r.ready(cp)
		if len(names) == 0 {
			names = []string{"none"}
		}
		fmt.Fprintf(&b, "Ready %s: %s.\n", role, strings.Join(names, ", "))
	}
	var notReady []string
	for _, n := range r.nodes {
		if !n.ready {
			notReady = append(notReady, fmt.Sprintf("- %s: %s", n.name, n.why))
		}
	}
	if len(notReady) > 0 {
		fmt.Fprintf(&b, "\nNot Ready (registered; see `kubectl describe node` and the kubelet's log on the node):\n%s\n",
			strings.Join(notReady, "\n"))
	}
	var missing []string
	for _, name := range w.names {
		if r.node(name) == nil {
			missing = append(missing, name)
		}
	}
	short := w.tooFew(r)
	if len(short) > 0 {
		fmt.Fprintf(&b, "\nToo few: %s.\n", strings.Join(short, "; "))
	}
	if len(missing) == 0 && len(short) == 0 {
		return strings.TrimRight(b.String(), "\n")
	}

	admitted, err := admittedMachines(ctx, kube)
	if len(missing) > 0 {
		b.WriteString("\nNever registered as nodes:\n")
		for _, name := range missing {
			switch at, ok := admitted[name]; {
			case err != nil:
				fmt.Fprintf(&b, "- %s\n", name)
			case ok:
				fmt.Fprintf(&b, "- %s: the join service admitted it (its disk record is from %s), but it did not register: "+
					"see berth-agent's and the kubelet's log on that machine (kubeadm join).\n", name, at.UTC().Format(time.RFC3339))
			default:
				fmt.Fprintf(&b, "- %s: the join service never admitted it (no disk record of that name): the machine "+
					"is not up, did not reach the join service, or was refused.\n", name)
			}
		}
	}
	if err == nil {
		var strays []string
		for name, at := range admitted {
			if r.node(name) == nil && !slices.Contains(missing, name) {
				strays = append(strays, fmt.Sprintf("%s (disk record from %s)", name, at.UTC().Format(time.RFC3339)))
			}
		}
		slices.Sort(strays)
		if len(strays) > 0 {
			fmt.Fprintf(&b, "\nAdmitted by the join service but not registered as nodes: %s.\n", strings.Join(strays, ", "))
		}
	} else {
		fmt.Fprintf(&b, "\nThe join service's records of the machines it admitted could not be read: %v.\n", err)
	}
	b.WriteString("\n" + joinLogHint)
	return b.String()
}

// admittedMachines maps the name of every machine the join service has admitted to when it first recorded
// that machine's state disk.
func admittedMachines(ctx context.Context, kube kubernetes.Interface) (map[string]time.Time, error) {
	// The wait's deadline has passed, not Terraform's: the diagnosis gets a look of its own.
	ctx, cancel := context.WithTimeout(ctx, healthLookTimeout)
	defer cancel()
	list, err := kube.CoreV1().ConfigMaps(metav1.NamespaceSystem).List(ctx, metav1.ListOptions{LabelSelector: diskrecord.Selector})
	if err != nil {
		return nil, err
	}
	admitted := map[string]time.Time{}
	for _, cm := range list.Items {
		name := cm.Annotations[diskrecord.InstanceNameAnnotation]
		if !strings.HasPrefix(cm.Name, diskrecord.Prefix) || name == "" {
			continue
		}
		if at, ok := admitted[name]; !ok || cm.CreationTimestamp.Time.Before(at) {
			admitted[name] = cm.CreationTimestamp.Time
		}
	}
	return admitted, nil
}
