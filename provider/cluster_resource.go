package provider

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/planmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/stringdefault"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/stringplanmodifier"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-log/tflog"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/backoff"
	"github.com/berthlabs/berth/internal/clusterinfo"
	"github.com/berthlabs/berth/internal/clustername"
	"github.com/berthlabs/berth/internal/initclient"
	"github.com/berthlabs/berth/internal/keys"
	"github.com/berthlabs/berth/internal/kubeadm"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/podnetwork"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/internal/rpc"
	"github.com/berthlabs/berth/provider/internal/platform"
)

const (
	defaultInitTimeout = "15m"
	// defaultUpgradeTimeout covers a rolling replacement of three control-plane instances, each booting,
	// joining and upgrading (kubeadm upgrade apply takes minutes).
	defaultUpgradeTimeout = "1h"
	// progressTail is how many of kubeadm's last lines a failed init shows.
	progressTail = 30
	// probeTimeout bounds each look at a cluster during refresh.
	probeTimeout = 20 * time.Second
)

var (
	_ resource.Resource                   = (*clusterResource)(nil)
	_ resource.ResourceWithValidateConfig = (*clusterResource)(nil)
	_ resource.ResourceWithModifyPlan     = (*clusterResource)(nil)
	_ resource.ResourceWithImportState    = (*clusterResource)(nil)
	_ resource.ResourceWithConfigure      = (*clusterResource)(nil)
)

// clusterResource is berth_cluster: the attested init of a cluster's first control-plane node.
type clusterResource struct {
	data *providerData
}

func newClusterResource() resource.Resource { return &clusterResource{} }

type clusterModel struct {
	Endpoint             types.String `tfsdk:"endpoint"`
	ClusterName          types.String `tfsdk:"cluster_name"`
	KubernetesVersion    types.String `tfsdk:"kubernetes_version"`
	ControlPlaneEndpoint types.String `tfsdk:"control_plane_endpoint"`
	PodSubnet            types.String `tfsdk:"pod_subnet"`
	ServiceSubnet        types.String `tfsdk:"service_subnet"`
	PodNetwork           types.String `tfsdk:"pod_network"`
	CertificateValidity  types.String `tfsdk:"certificate_validity"`
	PCRs                 types.Map    `tfsdk:"pcrs"`
	platform.Trust
	KubernetesCACertificate types.String `tfsdk:"kubernetes_ca_certificate"`
	JoinCACertificate       types.String `tfsdk:"join_ca_certificate"`
	InitSecretWO            types.String `tfsdk:"init_secret_wo"`
	MasterSecretWO          types.String `tfsdk:"master_secret_wo"`
	SaltWO                  types.String `tfsdk:"salt_wo"`
	KubernetesCAKeyWO       types.String `tfsdk:"kubernetes_ca_key_wo"`
	JoinCAKeyWO             types.String `tfsdk:"join_ca_key_wo"`
	InitTimeout             types.String `tfsdk:"init_timeout"`
	UpgradeTimeout          types.String `tfsdk:"upgrade_timeout"`
	ID                      types.String `tfsdk:"id"`
	ClusterID               types.String `tfsdk:"cluster_id"`
	APIServerEndpoint       types.String `tfsdk:"api_server_endpoint"`
	Kubeconfig              types.String `tfsdk:"kubeconfig"`
	ClientCertificate       types.String `tfsdk:"client_certificate"`
	ClientKey               types.String `tfsdk:"client_key"`
}

func (r *clusterResource) Metadata(_ context.Context, req resource.MetadataRequest, resp *resource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_cluster"
}

func (r *clusterResource) Schema(_ context.Context, _ resource.SchemaRequest, resp *resource.SchemaResponse) {
	keep := []planmodifier.String{stringplanmodifier.UseStateForUnknown()}
	writeOnly := func(desc string) schema.StringAttribute {
		return schema.StringAttribute{Optional: true, WriteOnly: true, Sensitive: true, MarkdownDescription: desc +
			" Write-only: sent to the node at init and never stored. Needed only when the cluster is created."}
	}
	resp.Schema = schema.Schema{
		MarkdownDescription: "Initializes a Berth cluster on its first control-plane node, which must run " +
			"berth-agent from a Berth image and have booted with user-data from `berth_node_config` " +
			"(with `init_secret_hash`).\n\n" +
			"The provider first **attests** the node over the connection it will use: the node's TPM quotes the " +
			"PCRs of `pcrs` bound to this TLS session, its endorsement key certificate must chain to " +
			"`ek_ca_certificates` (on AWS, instead, its endorsement key must be the one EC2 reports for the " +
			"instance named in `aws`; on Google Compute Engine, its certificate must chain to Google's vTPM CAs " +
			"and name the instance given in `gcp`), every PCR must hold the value the image predicts, and the " +
			"attestation key must prove it lives in that TPM. Only then does the provider send the init request with the " +
			"cluster's secrets; the node checks the init secret and runs `kubeadm init`. A node that shows other " +
			"measurements gets nothing, and the error names the PCR, the value expected and the value got.\n\n" +
			"While the node's init server does not answer yet, each attempt and what it got is logged " +
			"(`TF_LOG_PROVIDER=INFO`); so is kubeadm's output, as it arrives. A failed init shows kubeadm's last " +
			"lines.\n\n" +
			"What the node acted on when it ran `kubeadm init` (`endpoint`, `cluster_name`, " +
			"`control_plane_endpoint`, `pod_subnet`, `service_subnet`, `pod_network`, `certificate_validity` and the two CA " +
			"certificates) is fixed once " +
			"the cluster exists: a plan that changes one of them fails, naming it, rather than planning a " +
			"replacement, which would drop the running cluster and its admin kubeconfig from state before a new " +
			"init. For a new cluster with other settings, " +
			"`terraform state rm` this resource (the old cluster keeps running, unmanaged) and apply against a " +
			"fresh node. `pcrs`, the TPM's trust (`ek_ca_certificates`, `aws`, `gcp`) and `init_timeout` matter " +
			"only at init too, but changing them changes only state.\n\n" +
			"`kubernetes_version`, which kubeadm initialized too, may change by one minor or a patch: that " +
			"**upgrades** the cluster. " +
			"The apply writes the new release into the cluster record (ConfigMap `kube-system/berth-cluster`) as " +
			"the target, and waits up to `upgrade_timeout` until kubeadm's configuration and every API server " +
			"run it, logging each step of the upgrade as it goes (`TF_LOG_PROVIDER=INFO`). The agents of " +
			"control-plane nodes booted from an image of the target run `kubeadm upgrade`; nodes of older images " +
			"are replaced by the roll of their groups. State keeps the old release until the control plane runs " +
			"the new one. See docs/guides/upgrades.md.\n\n" +
			"On refresh the provider asks the API server for the cluster's record (ConfigMap " +
			"`kube-system/berth-cluster`). A cluster that is gone (the API server answers without the record, or " +
			"a fresh node waits for init at `endpoint`) or that is another cluster (another ID, another CA) is " +
			"removed from state, so the next apply plans a new init. An API server that does not answer is kept, " +
			"with a warning: an outage must never plan a new cluster.\n\n" +
			"The admin kubeconfig in state ends when kubeadm's `admin.conf` does (a year, or `certificate_validity`). " +
			"Within 30 days of its end, a refresh with the provider's `root_key` set mints a new one (user `" +
			defaultAdminUser + "`), and without it warns. A kubeconfig that has ended is refused by the API server " +
			"as another cluster's credentials are; the refresh then keeps the cluster in state as it was, with a " +
			"warning, rather than take it for gone.\n\n" +
			"Import (after Terraform state was lost) takes `<endpoint>` as ID, or `<endpoint>,<API server " +
			"host:port>` for a cluster with a `control_plane_endpoint`, and the root key from the provider's " +
			"`root_key`. The provider reaches the API server with admin credentials it mints from the root key, " +
			"checks that the cluster is the root key's, and reads the init settings from the cluster record and " +
			"the release the cluster runs from kubeadm's configuration; " +
			"what only the init used (`pcrs`, the TPM's trust) is written into state by the first apply after " +
			"the import, which reaches no node. See the import guide.\n\n" +
			"Destroying the resource only removes it from state: the machines belong to the infrastructure " +
			"that made them, and that is where they are destroyed.",
		Attributes: map[string]schema.Attribute{
			"endpoint": schema.StringAttribute{
				Required: true,
				MarkdownDescription: "`host:port` of the first control-plane node's init server (berth-agent listens " +
					"on port 7451). Fixed once the cluster exists; refresh asks it whether a node waits for init.",
			},
			"cluster_name": schema.StringAttribute{
				Required:            true,
				MarkdownDescription: "Name of the cluster, a DNS-1123 label; the same as in `berth_node_config`. Fixed once the cluster exists.",
			},
			"kubernetes_version": schema.StringAttribute{
				Required: true,
				MarkdownDescription: "Kubernetes release the cluster runs, with its `v`, such as `v1.36.3`: the one " +
					"baked into the image (`data.berth_image` `components.kubernetes`), which kubeadm initializes. " +
					"Changing it on a cluster that exists upgrades the cluster (see the resource's description): the " +
					"plan refuses a step the version skew policy forbids (a downgrade, a skipped minor), naming the " +
					"rule, and a release the cluster's join policy allows no image of for either role.",
			},
			"control_plane_endpoint": schema.StringAttribute{
				Optional: true,
				MarkdownDescription: "`host:port` clients and nodes reach the API server at, such as a load " +
					"balancer. Default: the node's own address, port 6443. Fixed once the cluster exists.",
			},
			"pod_subnet": schema.StringAttribute{
				Optional: true,
				MarkdownDescription: "CIDR of the pod network (kubeadm `networking.podSubnet`), such as `" + defaultPodSubnet +
					"` (the default), or an IPv4 and an IPv6 CIDR, comma-separated, for dual-stack. Must not overlap " +
					"`service_subnet`. Fixed once the cluster exists.",
			},
			"service_subnet": schema.StringAttribute{
				Optional: true,
				MarkdownDescription: "CIDR of the service network (kubeadm `networking.serviceSubnet`), or an IPv4,IPv6 " +
					"pair; kubeadm's `" + defaultServiceSubnet + "` if unset. Fixed once the cluster exists.",
			},
			"pod_network": schema.StringAttribute{
				Optional: true,
				Computed: true,
				Default:  stringdefault.StaticString(podnetwork.Flannel),
				MarkdownDescription: "The pod network the node installs right after `kubeadm init`, as kubeadm installs " +
					"kube-proxy and CoreDNS: `flannel` (the default) or `none`. Until a pod network runs, no node is " +
					"`Ready`.\n\n" +
					"`flannel` is Flannel v0.27.4 with its VXLAN backend, from upstream's images unless the image's " +
					"agent configuration names others (`podNetwork` in docs/agent.md): it needs nothing from the " +
					"network below but UDP port " + strconv.Itoa(podnetwork.VXLANPort) + " between all nodes, so it " +
					"works the same on bare metal, AWS and GCP. Pods' traffic between nodes is encapsulated, not " +
					"encrypted, and NetworkPolicy is not enforced. `none` is for a plugin you bring (Cilium, Calico, " +
					"a cloud's own), installed once the API server answers. docs/networking.md weighs the two. " +
					"Fixed once the cluster exists; clusters made before this setting have `none`.",
			},
			"certificate_validity": schema.StringAttribute{
				Optional: true,
				MarkdownDescription: "How long kubeadm's control-plane certificates last (ClusterConfiguration " +
					"`certificateValidityPeriod`), as a Go duration of at least `" + minCertificateValidity.String() +
					"`, such as `2160h` for 90 days. Default: kubeadm's year. Each control-plane node's agent renews its " +
					"certificates `certificateRenewBefore` (30 days, docs/agent.md) before they end, for the same " +
					"validity, so a validity shorter than that needs the image's agent configured to renew earlier. " +
					"The cluster's CAs last `berth_secrets`' `ca_validity_days`. Fixed once the cluster exists.",
			},
			"pcrs": schema.MapAttribute{
				Required:    true,
				ElementType: types.StringType,
				MarkdownDescription: "The measurements the node must show: PCR index (`\"11\"`) to its SHA-256 value " +
					"in lowercase hex, as `data.berth_image` gives them. Checked only at init; later nodes are " +
					"checked by the join policy (`berth_join_policy`).",
			},
			"kubernetes_ca_certificate": schema.StringAttribute{
				Required: true,
				MarkdownDescription: "`berth_secrets.<name>.kubernetes_ca_certificate`: the cluster's CA, which the " +
					"API server's certificate and the kubeconfig's CA data are checked against. Fixed once the cluster exists.",
			},
			"join_ca_certificate": schema.StringAttribute{
				Required:            true,
				MarkdownDescription: "`berth_secrets.<name>.join_ca_certificate`. Fixed once the cluster exists.",
			},
			"init_secret_wo":       writeOnly("`ephemeral.berth_secrets.<name>.init_secret`: proves to the node that the request comes from its operator."),
			"master_secret_wo":     writeOnly("`ephemeral.berth_secrets.<name>.master_secret`."),
			"salt_wo":              writeOnly("`ephemeral.berth_secrets.<name>.salt`."),
			"kubernetes_ca_key_wo": writeOnly("`ephemeral.berth_secrets.<name>.kubernetes_ca_key`."),
			"join_ca_key_wo":       writeOnly("`ephemeral.berth_secrets.<name>.join_ca_key`."),
			"init_timeout": schema.StringAttribute{
				Optional: true,
				Computed: true,
				Default:  stringdefault.StaticString(defaultInitTimeout),
				MarkdownDescription: "How long the init may take, waiting for the node's init server included (a " +
					"node created in the same run may still be booting), as a Go duration. Default `" +
					defaultInitTimeout + "`.",
			},
			"upgrade_timeout": schema.StringAttribute{
				Optional: true,
				MarkdownDescription: "How long an apply that changes `kubernetes_version` waits for the control plane to " +
					"run the new release, as a Go duration. Default `" + defaultUpgradeTimeout + "`. The upgrade goes on " +
					"when the wait ends: apply again to wait again.",
			},
			"id": schema.StringAttribute{Computed: true, PlanModifiers: keep,
				MarkdownDescription: "The cluster ID, the same as `cluster_id`."},
			"cluster_id": schema.StringAttribute{Computed: true, PlanModifiers: keep,
				MarkdownDescription: "The cluster ID the node derived from the master secret and salt; equal to " +
					"`berth_secrets.<name>.cluster_id`."},
			"api_server_endpoint": schema.StringAttribute{Computed: true, PlanModifiers: keep,
				MarkdownDescription: "`host:port` of the API server."},
			"kubeconfig": schema.StringAttribute{Computed: true, Sensitive: true, PlanModifiers: keep,
				MarkdownDescription: "The admin kubeconfig kubeadm wrote (group `kubeadm:cluster-admins`, bound to " +
					"`cluster-admin`), or after an import one the provider minted from the root key for a year " +
					"(user `" + defaultAdminUser + "`, the same group; no longer than the CA), renewed the same way by a " +
					"refresh within 30 days of its end when the provider has `root_key`. Sensitive, and kept in state: " +
					"protect the state, or use " +
					"`ephemeral.berth_admin_credentials`, which mints short-lived admin credentials at each run and " +
					"stores none."},
			"client_certificate": schema.StringAttribute{Computed: true, PlanModifiers: keep,
				MarkdownDescription: "PEM client certificate of `kubeconfig`, for providers that take it apart " +
					"(`kubernetes`, `helm`) together with `kubernetes_ca_certificate` and `api_server_endpoint`."},
			"client_key": schema.StringAttribute{Computed: true, Sensitive: true, PlanModifiers: keep,
				MarkdownDescription: "PEM private key of `client_certificate`. Sensitive."},
		},
	}
	maps.Copy(resp.Schema.Attributes, platform.TrustAttributes())
}

func (r *clusterResource) ValidateConfig(ctx context.Context, req resource.ValidateConfigRequest, resp *resource.ValidateConfigResponse) {
	var m clusterModel
	resp.Diagnostics.Append(req.Config.Get(ctx, &m)...)
	if resp.Diagnostics.HasError() {
		return
	}
	if known(m.ClusterName) {
		if err := clustername.Validate(m.ClusterName.ValueString()); err != nil {
			resp.Diagnostics.AddAttributeError(path.Root("cluster_name"), "Invalid cluster name", err.Error()+".")
		}
	}
	for _, a := range []struct {
		name    string
		v       types.String
		example string
	}{{"endpoint", m.Endpoint, "10.0.0.10:7451"}, {"control_plane_endpoint", m.ControlPlaneEndpoint, "api.example.com:6443"}} {
		if !known(a.v) {
			continue
		}
		if err := hostPortError(a.v.ValueString()); err != "" {
			resp.Diagnostics.AddAttributeError(path.Root(a.name), "Invalid endpoint",
				fmt.Sprintf("%s is %q, which is not host:port such as %q: %s.", a.name, a.v.ValueString(), a.example, err))
		}
	}
	if known(m.KubernetesVersion) {
		if detail := kubernetesVersionError(m.KubernetesVersion.ValueString()); detail != "" {
			resp.Diagnostics.AddAttributeError(path.Root("kubernetes_version"), "Invalid Kubernetes version", detail)
		}
	}
	checkSubnets(&m, &resp.Diagnostics)
	if known(m.PodNetwork) && !slices.Contains(podnetwork.Plugins, m.PodNetwork.ValueString()) {
		resp.Diagnostics.AddAttributeError(path.Root("pod_network"), "Unknown pod network",
			fmt.Sprintf("pod_network is %q; it takes one of %s (%s: you install a pod network yourself).",
				m.PodNetwork.ValueString(), strings.Join(podnetwork.Plugins, ", "), podnetwork.None))
	}
	if known(m.PCRs) && len(m.PCRs.Elements()) == 0 {
		resp.Diagnostics.AddAttributeError(path.Root("pcrs"), "No measurements",
			"An unmeasured node must not receive the cluster's secrets: give the image's PCR values.")
	} else if known(m.PCRs) {
		pcrValues(ctx, m.PCRs, path.Root("pcrs"), "", &resp.Diagnostics)
	}
	m.Trust.Validate(ctx, &resp.Diagnostics)
	if known(m.CertificateValidity) {
		if d, err := time.ParseDuration(m.CertificateValidity.ValueString()); err != nil || d < minCertificateValidity || d > maxCertificateValidity {
			resp.Diagnostics.AddAttributeError(path.Root("certificate_validity"), "Invalid certificate validity",
				fmt.Sprintf("%q is not a Go duration from %s to %s, such as 2160h for 90 days.", m.CertificateValidity.ValueString(),
					minCertificateValidity, maxCertificateValidity))
		}
	}
	for _, a := range []struct {
		name, example string
		v             types.String
	}{{"init_timeout", "15m", m.InitTimeout}, {"upgrade_timeout", "1h", m.UpgradeTimeout}} {
		if !known(a.v) {
			continue
		}
		if d, err := time.ParseDuration(a.v.ValueString()); err != nil || d <= 0 {
			resp.Diagnostics.AddAttributeError(path.Root(a.name), "Invalid timeout",
				fmt.Sprintf("%q is not a positive Go duration such as %s.", a.v.ValueString(), a.example))
		}
	}
}

// ModifyPlan refuses, at plan, a change of what the node acted on at init to a cluster that exists. Such
// a change cannot reach the running cluster, and replacing the resource for it would drop the cluster and
// its admin kubeconfig from state (Delete only forgets) before a new init at endpoint, which an
// initialized node refuses. Values not known until apply are checked again by Update.
func (r *clusterResource) ModifyPlan(ctx context.Context, req resource.ModifyPlanRequest, resp *resource.ModifyPlanResponse) {
	// A create has no cluster yet, and a destroy changes nothing on it.
	if req.State.Raw.IsNull() || req.Plan.Raw.IsNull() {
		return
	}
	var plan, state clusterModel
	resp.Diagnostics.Append(req.Plan.Get(ctx, &plan)...)
	resp.Diagnostics.Append(req.State.Get(ctx, &state)...)
	if resp.Diagnostics.HasError() {
		return
	}
	if state.PodNetwork.IsNull() {
		state.PodNetwork = types.StringValue(podnetwork.None)
		// Unset, the setting would plan the default, which the running cluster never got.
		var configured types.String
		resp.Diagnostics.Append(req.Config.GetAttribute(ctx, path.Root("pod_network"), &configured)...)
		if configured.IsNull() {
			plan.PodNetwork = state.PodNetwork
			resp.Diagnostics.Append(resp.Plan.SetAttribute(ctx, path.Root("pod_network"), plan.PodNetwork)...)
		}
	}
	refuseInitChanges(&state, &plan, &resp.Diagnostics, missingImagesIn(ctx, &state), false)
	if from, to := state.KubernetesVersion, plan.KubernetesVersion; known(to) && !to.Equal(from) && !resp.Diagnostics.HasError() {
		resp.Diagnostics.AddAttributeWarning(path.Root("kubernetes_version"), "Kubernetes upgrade planned",
			fmt.Sprintf("Applying writes %s as cluster %s's target (ConfigMap kube-system/%s) and waits up to "+
				"upgrade_timeout (%s) until kubeadm's configuration and every API server run it. Control-plane nodes "+
				"booted from an image of %s carry the upgrade out: roll the control-plane nodes to such an image in "+
				"this apply or beside it. Workers of that image join once the control plane runs %s, and kube-proxy and "+
				"CoreDNS follow once every node does. See docs/guides/upgrades.md.",
				to.ValueString(), state.ClusterID.ValueString(), clusterinfo.Name, plan.upgradeTimeout(),
				to.ValueString(), to.ValueString()))
	}
}

// initSetting is an argument the node acted on when it ran kubeadm init.
type initSetting struct {
	name string
	v    types.String
}

// initSettings are m's arguments that are fixed once its cluster exists.
func initSettings(m *clusterModel) []initSetting {
	return []initSetting{
		{"endpoint", m.Endpoint}, {"cluster_name", m.ClusterName}, {"kubernetes_version", m.KubernetesVersion},
		{"control_plane_endpoint", m.ControlPlaneEndpoint}, {"pod_subnet", m.PodSubnet}, {"service_subnet", m.ServiceSubnet},
		{"pod_network", m.PodNetwork}, {"certificate_validity", m.CertificateValidity},
		{"kubernetes_ca_certificate", m.KubernetesCACertificate}, {"join_ca_certificate", m.JoinCACertificate},
	}
}

// sameDuration says whether name is certificate_validity and a and b spell the same duration: an import
// reads it from the cluster's record, which may spell it another way than the configuration ("2160h0m0s").
func sameDuration(name string, a, b types.String) bool {
	if name != "certificate_validity" || a.IsNull() || b.IsNull() {
		return false
	}
	da, errA := time.ParseDuration(a.ValueString())
	db, errB := time.ParseDuration(b.ValueString())
	return errA == nil && errB == nil && da == db
}

// refuseInitChanges adds an error on each init setting whose known value in plan differs from the
// cluster's in state, saying why and what to do instead; kubernetes_version may change by a step the
// version skew policy allows to a release the join policy has images of. missing tells the roles the
// cluster's join policy has no image of a Kubernetes release for; a policy that cannot be read is a warning
// at plan and an error atApply, where the upgrade would be instructed, and one that is not there under its
// default name a warning.
func refuseInitChanges(state, plan *clusterModel, diags *diag.Diagnostics, missing func(release string) ([]metadata.Role, error), atApply bool) {
	was := initSettings(state)
	for i, now := range initSettings(plan) {
		old := was[i].v
		if now.v.IsUnknown() || now.v.Equal(old) || sameDuration(now.name, now.v, old) {
			continue
		}
		cluster := "Cluster " + state.ClusterID.ValueString()
		newCluster := "For a new cluster with the new value, remove this one from state (terraform state rm <this " +
			"resource's address>; the old cluster keeps running, unmanaged) and apply against a fresh node waiting " +
			"for init at endpoint."
		switch now.name {
		case "kubernetes_version":
			from, to := old.ValueString(), now.v.ValueString()
			if _, err := kubeadm.UpgradeStep(from, to); err != nil {
				diags.AddAttributeError(path.Root(now.name), "Kubernetes version change not allowed",
					fmt.Sprintf("%s runs Kubernetes %s; kubernetes_version is now %s: %v. Keep kubernetes_version = %s.",
						cluster, settingValue(old), settingValue(now.v), err, settingValue(old)))
				continue
			}
			roles, err := missing(to)
			switch {
			case errors.Is(err, errNoPolicy):
				diags.AddAttributeWarning(path.Root(now.name), "Cannot check the join policy",
					fmt.Sprintf("%v, where berth_join_policy keeps the policy unless its name is set: if the "+
						"cluster's policy has another name, make sure it lists images of %s for both roles, with "+
						"kubernetes_version; without one, no node of %s can join, and the upgrade cannot start.", err, to, to))
			case err != nil && atApply:
				diags.AddAttributeError(path.Root(now.name), "Cannot check the join policy",
					fmt.Sprintf("%s runs Kubernetes %s; kubernetes_version is now %s, but the cluster's join policy "+
						"could not be read to check that nodes of %s may join: %v. Nothing was changed; apply again "+
						"once the API server at %s answers.", cluster, settingValue(old), settingValue(now.v), to, err,
						state.APIServerEndpoint.ValueString()))
			case err != nil:
				diags.AddAttributeWarning(path.Root(now.name), "Cannot check the join policy",
					fmt.Sprintf("The cluster's join policy could not be read to check that nodes of %s may join: %v. "+
						"The apply checks it again before it instructs the upgrade.", to, err))
			case len(roles) > 0:
				diags.AddAttributeError(path.Root(now.name), "No image of the new Kubernetes release may join",
					fmt.Sprintf("%s runs Kubernetes %s; kubernetes_version is now %s, but the cluster's join policy "+
						"(ConfigMap kube-system/%s) allows no image of %s for %s: the nodes that would run it "+
						"could not join. Add images of %s for both roles to berth_join_policy, with kubernetes_version "+
						"from their manifest (data.berth_image.<name>.components[\"kubernetes\"]), and apply that first.",
						cluster, settingValue(old), settingValue(now.v), policy.DefaultConfigMap, to, joinRoles(roles), to))
			}
		case "kubernetes_ca_certificate", "join_ca_certificate":
			diags.AddAttributeError(path.Root(now.name), "The cluster's CA cannot change",
				fmt.Sprintf("%s was initialized with another %s: was berth_secrets made again from another root key? "+
					"A running cluster keeps its CAs, and replacing it would drop it, and its admin kubeconfig, from "+
					"state before a new init failed. Keep the berth_secrets (and root key) that made this cluster. %s",
					cluster, now.name, newCluster))
		default:
			keep := fmt.Sprintf("Keep %s = %s", now.name, settingValue(old))
			if old.IsNull() {
				keep = fmt.Sprintf("Leave %s unset", now.name)
			}
			diags.AddAttributeError(path.Root(now.name), "Fixed once the cluster exists",
				fmt.Sprintf("%s was initialized with %s = %s; the configuration now says %s. The node used %s only "+
					"when it ran kubeadm init, so a change cannot reach the running cluster, and replacing the cluster "+
					"for it would drop it, and its admin kubeconfig, from state before a new init failed. %s, or "+
					"list %s in lifecycle { ignore_changes }. %s",
					cluster, now.name, settingValue(old), settingValue(now.v), now.name, keep, now.name, newCluster))
		}
	}
}

// errNoPolicy is a cluster without a join policy of the default name: it may have none (and admit no node),
// or one berth_join_policy named otherwise, which the agents' configuration names (policyConfigMap).
var errNoPolicy = fmt.Errorf("the cluster has no ConfigMap kube-system/%s", policy.DefaultConfigMap)

// missingImagesIn is missingImages for the cluster of state, now.
func missingImagesIn(ctx context.Context, state *clusterModel) func(release string) ([]metadata.Role, error) {
	kubeconfig := state.Kubeconfig.ValueString()
	return func(release string) ([]metadata.Role, error) {
		return missingImages(ctx, kubeconfig, release, time.Now())
	}
}

// missingImages reads the cluster's join policy with kubeconfig and returns the roles for which it allows no
// image of release at now.
func missingImages(ctx context.Context, kubeconfig, release string, now time.Time) ([]metadata.Role, error) {
	kube, err := stateClient(kubeconfig)
	if err != nil {
		return nil, err
	}
	cm, err := kube.CoreV1().ConfigMaps(metav1.NamespaceSystem).Get(ctx, policy.DefaultConfigMap, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, errNoPolicy
	}
	if err != nil {
		return nil, fmt.Errorf("reading the join policy: %w", err)
	}
	p, err := policy.Parse([]byte(cm.Data[policy.ConfigMapKey]))
	if err != nil {
		return nil, err
	}
	var missing []metadata.Role
	for _, role := range []metadata.Role{metadata.RoleControlPlane, metadata.RoleWorker} {
		if !slices.ContainsFunc(p.ForRole(role, now).Images, func(img policy.Image) bool { return img.KubernetesVersion == release }) {
			missing = append(missing, role)
		}
	}
	return missing, nil
}

// joinRoles names roles after "no image for": "the role control-plane", or "either role" for both.
func joinRoles(roles []metadata.Role) string {
	if len(roles) == 1 {
		return "the role " + string(roles[0])
	}
	return "either role"
}

// settingValue shows an init setting's value in an error: quoted, or "unset".
func settingValue(v types.String) string {
	if v.IsNull() {
		return "unset"
	}
	return fmt.Sprintf("%q", v.ValueString())
}

// hostPortError is why endpoint is not an address kubeadm and a kubeconfig take (the checks of
// internal/kubeadm.ValidateEndpoint): host:port with a port of 1 to 65535 and a host that is an IP address
// or a DNS name. Empty when it is one.
func hostPortError(endpoint string) string {
	host, port, err := net.SplitHostPort(endpoint)
	if err != nil {
		return strings.TrimPrefix(err.Error(), "address "+endpoint+": ")
	}
	if n, err := strconv.ParseUint(port, 10, 16); err != nil || n == 0 {
		return fmt.Sprintf("the port %q is not a number from 1 to 65535", port)
	}
	if _, err := netip.ParseAddr(host); err == nil {
		return ""
	}
	if errs := validation.IsDNS1123Subdomain(host); len(errs) > 0 {
		return fmt.Sprintf("the host %q is neither an IP address nor a DNS name (%s)", host, strings.Join(errs, "; "))
	}
	return ""
}

// kubernetesMinor is a version without its patch release, such as 1.36.
var kubernetesMinor = regexp.MustCompile(`\Av?(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\z`)

// kubernetesVersionError says what is wrong with a kubernetes_version and what it should be; empty when the
// node takes it.
func kubernetesVersionError(v string) string {
	const image = "the release baked into the image, data.berth_image.<name>.components.kubernetes"
	switch {
	case kubeadm.IsRelease(v):
		return ""
	case kubeadm.IsRelease("v" + v):
		return fmt.Sprintf("kubernetes_version is %q: write the release with its \"v\", %q, as kubeadm names releases "+
			"and the image manifest records them (%s).", v, "v"+v, image)
	case kubernetesMinor.MatchString(v):
		return fmt.Sprintf("kubernetes_version is %q, a minor version: an image carries one exact release, "+
			"\"v%s.<patch>\" such as \"v1.36.3\" (%s).", v, strings.TrimPrefix(v, "v"), image)
	}
	return fmt.Sprintf("kubernetes_version is %q, which is not a Kubernetes release such as \"v1.36.3\" (%s).", v, image)
}

// The range of certificate_validity: a day at least, since a renewal 30 days ahead would otherwise run at
// every hourly check of a default agent (the node's kubeadm takes 3 minutes, for tests); ten years at most,
// as long as kubeadm's own CAs.
const (
	minCertificateValidity = 24 * time.Hour
	maxCertificateValidity = 10 * 365 * 24 * time.Hour
)

// The subnets the node's kubeadm configuration takes when pod_subnet or service_subnet is unset: Berth's
// (internal/kubeadm.DefaultPodSubnet) and kubeadm's own (DefaultServiceSubnet). They are repeated here
// because importing internal/kubeadm would bring all of kubeadm's API types into the provider; a test checks
// that they agree.
const (
	defaultPodSubnet     = "10.244.0.0/16"
	defaultServiceSubnet = "10.96.0.0/12"
)

// checkSubnets checks pod_subnet and service_subnet as the node's kubeadm configuration will
// (internal/kubeadm), each on its attribute, and that the two, unset ones at their defaults, do not
// overlap: pods and services in one range break both.
func checkSubnets(m *clusterModel, diags *diag.Diagnostics) {
	type subnet struct {
		name, value string
		set         bool
		// prefixes is nil while the value is unknown or wrong.
		prefixes []netip.Prefix
	}
	nets := []*subnet{{name: "pod_subnet", value: defaultPodSubnet}, {name: "service_subnet", value: defaultServiceSubnet}}
	for i, v := range []types.String{m.PodSubnet, m.ServiceSubnet} {
		n := nets[i]
		if v.IsUnknown() {
			continue
		}
		if !v.IsNull() {
			n.value, n.set = v.ValueString(), true
		}
		var err string
		if n.prefixes, err = parseSubnet(n.value, n.name); err != "" {
			diags.AddAttributeError(path.Root(n.name), "Invalid subnet", fmt.Sprintf("%s is %q: %s.", n.name, n.value, err))
		}
	}
	pod, svc := nets[0], nets[1]
	if pod.prefixes == nil || svc.prefixes == nil {
		return
	}
	for _, p := range pod.prefixes {
		for _, s := range svc.prefixes {
			if !p.Overlaps(s) {
				continue
			}
			at, describe := svc, func(n *subnet) string {
				if n.set {
					return fmt.Sprintf("%s %q", n.name, n.value)
				}
				return fmt.Sprintf("%s's default %q (it is unset)", n.name, n.value)
			}
			if !svc.set {
				at = pod
			}
			diags.AddAttributeError(path.Root(at.name), "Overlapping subnets",
				fmt.Sprintf("%s and %s overlap (%s and %s): pods and services need address ranges of their own.",
					describe(pod), describe(svc), p, s))
			return
		}
	}
}

// parseSubnet reads the value of attribute name as the node's kubeadm configuration does: one CIDR, or an
// IPv4 and an IPv6 CIDR for dual-stack, comma-separated, each without host bits. The error says what is
// wrong and how to write it.
func parseSubnet(value, name string) ([]netip.Prefix, string) {
	example := defaultPodSubnet
	if name == "service_subnet" {
		example = defaultServiceSubnet
	}
	parts := strings.Split(value, ",")
	if len(parts) > 2 {
		return nil, "at most two CIDRs, an IPv4 and an IPv6 one for dual-stack"
	}
	var prefixes []netip.Prefix
	for _, part := range parts {
		if addr, err := netip.ParseAddr(part); err == nil {
			return nil, fmt.Sprintf("%s is an address, not a CIDR: add the network's prefix length, \"%s/<length>\" such as %q",
				part, addr, example)
		}
		prefix, err := netip.ParsePrefix(part)
		if err != nil {
			return nil, fmt.Sprintf("%q is not a CIDR such as %q", part, example)
		}
		if prefix.Masked() != prefix {
			return nil, fmt.Sprintf("%s has host bits set: the network is %q", prefix, prefix.Masked())
		}
		prefixes = append(prefixes, prefix)
	}
	if len(prefixes) == 2 && prefixes[0].Addr().Is4() == prefixes[1].Addr().Is4() {
		return nil, "a dual-stack pair needs one IPv4 and one IPv6 CIDR"
	}
	return prefixes, ""
}

// known tells a value the configuration sets from one that is null or not known yet.
func known(v attr.Value) bool { return !v.IsNull() && !v.IsUnknown() }

func (r *clusterResource) Create(ctx context.Context, req resource.CreateRequest, resp *resource.CreateResponse) {
	var plan, config clusterModel
	resp.Diagnostics.Append(req.Plan.Get(ctx, &plan)...)
	// Write-only values are only in the configuration.
	resp.Diagnostics.Append(req.Config.Get(ctx, &config)...)
	if resp.Diagnostics.HasError() {
		return
	}
	request := initRequest(&plan, &config, &resp.Diagnostics)
	pcrs := pcrValues(ctx, plan.PCRs, path.Root("pcrs"), "", &resp.Diagnostics)
	trust, instanceID, diags := plan.EKTrust(ctx)
	resp.Diagnostics.Append(diags...)
	timeout, err := time.ParseDuration(plan.InitTimeout.ValueString())
	if err != nil {
		resp.Diagnostics.AddAttributeError(path.Root("init_timeout"), "Invalid timeout", err.Error())
	}
	if resp.Diagnostics.HasError() {
		return
	}

	endpoint := plan.Endpoint.ValueString()
	tail := make([]string, 0, progressTail)
	start := time.Now()
	deadline := start.Add(timeout)
	waitCtx, cancel := context.WithDeadline(ctx, deadline)
	err = awaitInitServer(waitCtx, endpoint)
	cancel()
	if err != nil {
		addInitError(&resp.Diagnostics, endpoint, err, nil)
		return
	}
	tflog.Info(ctx, "attesting the node and initializing the cluster", map[string]any{"endpoint": endpoint, "timeout": timeout.String()})
	result, err := initclient.Init(ctx, initclient.Config{
		Endpoint:     endpoint,
		Verifier:     attest.NewVerifier(trust),
		InstanceID:   instanceID,
		ExpectedPCRs: pcrs,
		Request:      request,
		Timeout:      time.Until(deadline),
		Busy: func(attempt int, wait time.Duration) {
			tflog.Info(ctx, "the node is busy with another init exchange; asking again", map[string]any{
				"endpoint": endpoint, "attempt": attempt, "retry_in": wait.String()})
		},
		Progress: func(line string) {
			tflog.Info(ctx, "kubeadm: "+line, map[string]any{"endpoint": endpoint})
			if len(tail) == progressTail {
				tail = tail[1:]
			}
			tail = append(tail, line)
		},
	})
	if err != nil {
		tflog.Info(ctx, "the init failed: "+err.Error(), map[string]any{"endpoint": endpoint})
		addInitError(&resp.Diagnostics, endpoint, err, tail)
		return
	}
	tflog.Info(ctx, "cluster initialized", map[string]any{"cluster_id": result.ClusterId, "seconds": time.Since(start).Seconds()})

	// The node derives the ID from the secrets it was sent; another ID means it did not use them.
	if want, err := keys.ClusterIDOf(request.MasterSecret, request.Salt); err != nil || result.ClusterId != want {
		resp.Diagnostics.AddError("The node reports another cluster",
			fmt.Sprintf("The node at %s reports cluster %q, but the secrets sent make cluster %q (%v).", endpoint, result.ClusterId, want, err))
		return
	}
	creds, err := parseKubeconfig(result.Kubeconfig)
	if err != nil {
		resp.Diagnostics.AddError("The node returned an unusable kubeconfig",
			"The cluster "+result.ClusterId+" is initialized, but "+err.Error()+". The node keeps /etc/kubernetes/admin.conf.")
		return
	}
	if !bytes.Equal(bytes.TrimSpace(creds.caPEM), bytes.TrimSpace([]byte(plan.KubernetesCACertificate.ValueString()))) {
		resp.Diagnostics.AddError("The cluster's CA is not the one given",
			"The kubeconfig the node returned trusts another CA than kubernetes_ca_certificate; the node did not use the cluster CA it was sent.")
		return
	}
	plan.ID = types.StringValue(result.ClusterId)
	plan.ClusterID = types.StringValue(result.ClusterId)
	plan.APIServerEndpoint = types.StringValue(result.ApiServerEndpoint)
	plan.Kubeconfig = types.StringValue(string(result.Kubeconfig))
	plan.ClientCertificate = types.StringValue(string(creds.certPEM))
	plan.ClientKey = types.StringValue(string(creds.keyPEM))
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
}

// initPoll paces the attempts to reach a node's init server: a node created in the same run may take
// minutes to boot, and the init starts within seconds of its server listening.
var initPoll = backoff.Policy{Initial: time.Second, Max: 5 * time.Second}

// initProbeTimeout bounds one attempt: a connection, a TLS handshake and the node's quote of one PCR.
const initProbeTimeout = 10 * time.Second

// awaitInitServer waits until the node's init server answers at endpoint, and logs every attempt and what it
// got (connection refused, a TLS handshake that failed, no answer in time), so that a wait of minutes shows
// why. The probe is the one refresh uses: the node quotes PCR 0 and nothing is sent to it. A server that
// answers otherwise than with a quote (busy with another client, a node already initialized) is left for the
// init itself, which says what that means.
func awaitInitServer(ctx context.Context, endpoint string) error {
	start := time.Now()
	attempt := 0
	return backoff.Retry(ctx, initPoll, nil, nil, func(ctx context.Context) error {
		attempt++
		waiting, err := initclient.AwaitsInit(ctx, endpoint, initProbeTimeout)
		fields := map[string]any{"endpoint": endpoint, "attempt": attempt, "waited": time.Since(start).Round(time.Second).String()}
		switch code := status.Code(err); {
		case waiting:
			tflog.Info(ctx, fmt.Sprintf("attempt %d: the node's init server at %s answers with a TPM quote", attempt, endpoint), fields)
			return nil
		case err == nil:
			tflog.Info(ctx, fmt.Sprintf("attempt %d: %s answers without a TPM quote", attempt, endpoint), fields)
			return nil
		case code != codes.Unavailable && code != codes.DeadlineExceeded:
			tflog.Info(ctx, fmt.Sprintf("attempt %d: %s answers: %v", attempt, endpoint, err), fields)
			return nil
		}
		return err
	}, func(attempt int, err error, next time.Duration) {
		tflog.Info(ctx, fmt.Sprintf("attempt %d: no init server at %s yet: %v", attempt, endpoint, err), map[string]any{
			"endpoint": endpoint, "attempt": attempt, "waited": time.Since(start).Round(time.Second).String(),
			"retry_in": next.Round(time.Millisecond).String()})
	})
}

// initRequest assembles the init request from the plan and the write-only secrets of the configuration.
func initRequest(plan, config *clusterModel, diags *diag.Diagnostics) *berthv1.InitRequest {
	var missing []string
	secret := func(name string, v types.String) string {
		if !known(v) || v.ValueString() == "" {
			missing = append(missing, name)
		}
		return v.ValueString()
	}
	initSecret := secret("init_secret_wo", config.InitSecretWO)
	master := secret("master_secret_wo", config.MasterSecretWO)
	salt := secret("salt_wo", config.SaltWO)
	kubeKey := secret("kubernetes_ca_key_wo", config.KubernetesCAKeyWO)
	joinKey := secret("join_ca_key_wo", config.JoinCAKeyWO)
	if len(missing) > 0 {
		diags.AddError("Cluster secrets missing",
			"Initializing a cluster needs "+strings.Join(missing, ", ")+": pass them from the ephemeral resource "+
				"berth_secrets (see the berth_cluster example).")
		return nil
	}
	decode := func(name, text string) []byte {
		b, err := base64.StdEncoding.DecodeString(text)
		if err != nil {
			diags.AddAttributeError(path.Root(name), "Invalid secret", name+" is not base64 (as ephemeral berth_secrets gives it).")
		}
		return b
	}
	req := &berthv1.InitRequest{
		InitSecret:              []byte(initSecret),
		MasterSecret:            decode("master_secret_wo", master),
		Salt:                    decode("salt_wo", salt),
		KubernetesCaCertificate: []byte(plan.KubernetesCACertificate.ValueString()),
		KubernetesCaKey:         []byte(kubeKey),
		JoinCaCertificate:       []byte(plan.JoinCACertificate.ValueString()),
		JoinCaKey:               []byte(joinKey),
		ClusterName:             plan.ClusterName.ValueString(),
		KubernetesVersion:       plan.KubernetesVersion.ValueString(),
		ControlPlaneEndpoint:    plan.ControlPlaneEndpoint.ValueString(),
		PodSubnet:               plan.PodSubnet.ValueString(),
		ServiceSubnet:           plan.ServiceSubnet.ValueString(),
		PodNetwork:              plan.PodNetwork.ValueString(),
	}
	if v := plan.CertificateValidity; known(v) {
		// ValidateConfig checked it.
		d, _ := time.ParseDuration(v.ValueString())
		req.CertificateValiditySeconds = int64(d / time.Second)
	}
	// A key that does not belong to its certificate is caught here rather than by kubeadm on the node.
	for _, ca := range []struct{ name, cert, key string }{
		{"kubernetes_ca_key_wo", plan.KubernetesCACertificate.ValueString(), kubeKey},
		{"join_ca_key_wo", plan.JoinCACertificate.ValueString(), joinKey},
	} {
		if _, err := pki.ParseCA([]byte(ca.cert), []byte(ca.key)); err != nil {
			diags.AddAttributeError(path.Root(ca.name), "CA key does not fit its certificate",
				"The key and its certificate must both come from the same berth_secrets: "+err.Error())
		}
	}
	return req
}

// addInitError turns an init failure into a diagnostic that says what to do.
func addInitError(diags *diag.Diagnostics, endpoint string, err error, tail []string) {
	var mismatch *initclient.MeasurementError
	if errors.As(err, &mismatch) {
		diags.AddAttributeError(path.Root("pcrs"), "The node does not run the expected image",
			fmt.Sprintf("The node at %s was not sent any secret: %s. Check that the node booted from the image "+
				"whose measurements are in pcrs (data.berth_image), with the same firmware settings.", endpoint, mismatch))
		return
	}
	detail := err.Error()
	if rpc.IsBusy(err) {
		detail = "Another client kept the node's init server busy until init_timeout. Is a second apply (or " +
			"someone else) initializing this node?\n\n" + detail
	} else if code := status.Code(err); len(tail) == 0 && (code == codes.DeadlineExceeded || code == codes.Unavailable) {
		detail = "No init server answered in time. Is the node up, booted from a Berth image with user-data from " +
			"berth_node_config (with init_secret_hash), and is its port reachable from here?\n\n" + detail
	}
	if len(tail) > 0 {
		detail += "\n\nLast lines of kubeadm on the node:\n" + strings.Join(tail, "\n")
	}
	diags.AddError("Initializing the cluster at "+endpoint+" failed", detail)
}

type kubeCredentials struct {
	server                 string
	caPEM, certPEM, keyPEM []byte
}

// parseKubeconfig takes the credentials of the current context apart.
func parseKubeconfig(data []byte) (*kubeCredentials, error) {
	cfg, err := clientcmd.Load(data)
	if err != nil {
		return nil, fmt.Errorf("its kubeconfig does not parse: %w", err)
	}
	kctx, ok := cfg.Contexts[cfg.CurrentContext]
	if !ok {
		return nil, fmt.Errorf("its kubeconfig has no current context %q", cfg.CurrentContext)
	}
	cluster, auth := cfg.Clusters[kctx.Cluster], cfg.AuthInfos[kctx.AuthInfo]
	if cluster == nil || auth == nil || len(cluster.CertificateAuthorityData) == 0 || len(auth.ClientCertificateData) == 0 || len(auth.ClientKeyData) == 0 {
		return nil, errors.New("its kubeconfig lacks embedded CA data or client credentials")
	}
	return &kubeCredentials{server: cluster.Server, caPEM: cluster.CertificateAuthorityData, certPEM: auth.ClientCertificateData,
		keyPEM: auth.ClientKeyData}, nil
}

// Read checks that the API server behind the kubeconfig is still this cluster. See the resource's
// description for what counts as gone.
func (r *clusterResource) Read(ctx context.Context, req resource.ReadRequest, resp *resource.ReadResponse) {
	var m clusterModel
	resp.Diagnostics.Append(req.State.Get(ctx, &m)...)
	if resp.Diagnostics.HasError() {
		return
	}
	var rootKey string
	if r.data != nil {
		rootKey = r.data.rootKey
	}
	renewed, expired, warning := renewAdmin(ctx, &m, rootKey, time.Now())
	if warning != "" {
		resp.Diagnostics.AddWarning("Admin kubeconfig of cluster "+m.ClusterID.ValueString()+" not renewed", warning)
	}
	if expired {
		// The API server refuses an ended certificate as it refuses another cluster's: that says nothing.
		return
	}
	switch verdict, why := checkCluster(ctx, m); verdict {
	case clusterGone:
		resp.Diagnostics.AddWarning("Cluster "+m.ClusterID.ValueString()+" is gone",
			why+" It is removed from state; the next apply initializes a new cluster at "+m.Endpoint.ValueString()+".")
		resp.State.RemoveResource(ctx)
		return
	case clusterSilent:
		resp.Diagnostics.AddWarning("Cluster "+m.ClusterID.ValueString()+" did not answer",
			why+" The cluster stays in state as it was. If its machines are gone for good, initialize a new one "+
				"with: terraform apply -replace=<this resource's address>.")
	}
	if renewed {
		resp.Diagnostics.Append(resp.State.Set(ctx, &m)...)
	}
}

type clusterVerdict int

const (
	clusterHere   clusterVerdict = iota // the API server holds this cluster's record
	clusterGone                         // another cluster, no cluster, or a node waiting for init
	clusterSilent                       // nothing conclusive answered
)

// checkCluster tells what answers for the cluster of m, and why.
func checkCluster(ctx context.Context, m clusterModel) (clusterVerdict, string) {
	api := m.APIServerEndpoint.ValueString()
	info, err := readClusterInfo(ctx, m.Kubeconfig.ValueString())
	switch {
	case err == nil && info.ID == m.ClusterID.ValueString():
		return clusterHere, ""
	case err == nil:
		return clusterGone, fmt.Sprintf("The API server at %s belongs to cluster %s now.", api, info.ID)
	case errors.Is(err, clusterinfo.ErrNotFound):
		return clusterGone, fmt.Sprintf("The API server at %s answers, but holds no Berth cluster record.", api)
	case anotherCluster(err):
		return clusterGone, fmt.Sprintf("The API server at %s does not accept this cluster's credentials or CA (%v): another cluster runs there.", api, err)
	}
	if waiting, _ := initclient.AwaitsInit(ctx, m.Endpoint.ValueString(), probeTimeout); waiting {
		return clusterGone, fmt.Sprintf("The API server at %s does not answer (%v), and a node waiting for init answers at %s.",
			api, err, m.Endpoint.ValueString())
	}
	return clusterSilent, fmt.Sprintf("Reading the cluster record failed: %v.", err)
}

func readClusterInfo(ctx context.Context, kubeconfig string) (clusterinfo.Info, error) {
	kube, err := stateClient(kubeconfig)
	if err != nil {
		return clusterinfo.Info{}, err
	}
	return clusterinfo.Read(ctx, kube)
}

// stateClient is a client of the cluster with the admin kubeconfig in state, whose requests give up after
// probeTimeout: a plan or refresh must not hang on a cluster that does not answer.
func stateClient(kubeconfig string) (kubernetes.Interface, error) {
	rc, err := clientcmd.RESTConfigFromKubeConfig([]byte(kubeconfig))
	if err != nil {
		return nil, fmt.Errorf("the kubeconfig in state does not parse: %w", err)
	}
	rc.Timeout = probeTimeout
	return kubernetes.NewForConfig(rc)
}

// anotherCluster tells a server that proves it is not this cluster (its certificate is not from this CA, or
// it refuses this cluster's admin credentials) from one that did not answer.
func anotherCluster(err error) bool {
	var unknownCA x509.UnknownAuthorityError
	var verify *tls.CertificateVerificationError
	return apierrors.IsUnauthorized(err) || errors.As(err, &unknownCA) || errors.As(err, &verify)
}

// Update changes what needs no node (the measurements and the TPM's trust, used at init only, and the
// timeouts) and upgrades Kubernetes: a new kubernetes_version is written into the cluster record as the
// target, and the update waits for the control plane to reach it. An init setting that was not known at
// plan and turned out to differ is refused here, with the cluster kept in state as it was.
func (r *clusterResource) Update(ctx context.Context, req resource.UpdateRequest, resp *resource.UpdateResponse) {
	var plan, state clusterModel
	resp.Diagnostics.Append(req.Plan.Get(ctx, &plan)...)
	resp.Diagnostics.Append(req.State.Get(ctx, &state)...)
	if resp.Diagnostics.HasError() {
		return
	}
	if state.PodNetwork.IsNull() {
		state.PodNetwork = types.StringValue(podnetwork.None)
	}
	if refuseInitChanges(&state, &plan, &resp.Diagnostics, missingImagesIn(ctx, &state), true); resp.Diagnostics.HasError() {
		return
	}
	if !plan.KubernetesVersion.Equal(state.KubernetesVersion) {
		// State keeps the old release until the control plane runs the new one: an apply that gave up
		// waiting plans the same upgrade again, and instructing it again leaves it where it stands.
		if upgradeKubernetes(ctx, &state, plan.KubernetesVersion.ValueString(), plan.upgradeTimeout(), &resp.Diagnostics); resp.Diagnostics.HasError() {
			return
		}
		state.KubernetesVersion = plan.KubernetesVersion
	}
	state.PCRs, state.Trust = plan.PCRs, plan.Trust
	state.InitTimeout, state.UpgradeTimeout = plan.InitTimeout, plan.UpgradeTimeout
	// The same duration, perhaps spelt otherwise (after an import): the configuration's spelling.
	state.CertificateValidity = plan.CertificateValidity
	resp.Diagnostics.Append(resp.State.Set(ctx, &state)...)
}

func (r *clusterResource) Delete(ctx context.Context, req resource.DeleteRequest, resp *resource.DeleteResponse) {
	var m clusterModel
	resp.Diagnostics.Append(req.State.Get(ctx, &m)...)
	resp.Diagnostics.AddWarning("Cluster "+m.ClusterID.ValueString()+" removed from state only",
		"berth_cluster does not stop or wipe machines: the cluster's nodes keep running until the infrastructure "+
			"that made them (instances, autoscaling groups, managed instance groups) destroys them. Their state "+
			"disks are encrypted with keys derived from the root key: destroying every copy of the root key makes "+
			"them unreadable, once your retention rules allow it.")
}

func (r *clusterResource) Configure(_ context.Context, req resource.ConfigureRequest, _ *resource.ConfigureResponse) {
	if data, ok := req.ProviderData.(*providerData); ok {
		r.data = data
	}
}

// ImportState rebuilds the resource from the cluster's record (see readImportedCluster), with an admin
// kubeconfig minted from the root key in place of the one kubeadm wrote, which never left the node but in
// the init's result. What only the init used and the cluster does not keep (pcrs, the TPM's trust) stays
// unset: the first apply after the import writes it into state, and reaches no node.
func (r *clusterResource) ImportState(ctx context.Context, req resource.ImportStateRequest, resp *resource.ImportStateResponse) {
	endpoint, apiServer, err := clusterImportID(req.ID)
	if err != nil {
		resp.Diagnostics.AddError("Invalid import ID", err.Error()+". The ID is \"<endpoint>\", or "+
			"\"<endpoint>,<API server host:port>\" for a cluster with a control_plane_endpoint.")
		return
	}
	rootKey, ok := importRootKey(r.data, "berth_cluster", &resp.Diagnostics)
	if !ok {
		return
	}
	c, err := readImportedCluster(ctx, rootKey, apiServer)
	if err != nil {
		importError(&resp.Diagnostics, "berth_cluster", req.ID, err)
		return
	}
	settings := c.record.Init
	now := time.Now()
	// A certificate cannot outlive its CA.
	validity := min(importedKubeconfigValidity, c.kubeCA.Cert.NotAfter.Sub(now).Truncate(time.Hour))
	admin := adminRequest{host: "https://" + settings.APIServerEndpoint, user: defaultAdminUser, validity: validity}
	creds, err := mintAdmin(c.kubeCA, admin, now)
	if err != nil {
		importError(&resp.Diagnostics, "berth_cluster", req.ID, err)
		return
	}
	optional := func(v string) types.String {
		if v == "" {
			return types.StringNull()
		}
		return types.StringValue(v)
	}
	for name, v := range map[string]types.String{
		"endpoint":                  types.StringValue(endpoint),
		"cluster_name":              types.StringValue(c.record.Name),
		"kubernetes_version":        types.StringValue(c.release),
		"control_plane_endpoint":    optional(settings.ControlPlaneEndpoint),
		"pod_subnet":                optional(settings.PodSubnet),
		"service_subnet":            optional(settings.ServiceSubnet),
		"pod_network":               types.StringValue(settings.PodNetwork),
		"certificate_validity":      optional(settings.CertificateValidity),
		"kubernetes_ca_certificate": types.StringValue(string(c.kubeCA.CertPEM())),
		"join_ca_certificate":       types.StringValue(string(c.joinCA.CertPEM())),
		"init_timeout":              types.StringValue(defaultInitTimeout),
		"id":                        types.StringValue(c.record.ID),
		"cluster_id":                types.StringValue(c.record.ID),
		"api_server_endpoint":       types.StringValue(settings.APIServerEndpoint),
		"kubeconfig":                types.StringValue(string(creds.kubeconfig)),
		"client_certificate":        types.StringValue(string(creds.certPEM)),
		"client_key":                types.StringValue(string(creds.keyPEM)),
	} {
		resp.Diagnostics.Append(resp.State.SetAttribute(ctx, path.Root(name), v)...)
	}
	tflog.Info(ctx, "imported berth_cluster", map[string]any{"cluster_id": c.record.ID, "api_server": apiServer,
		"admin_certificate_expires_at": creds.notAfter.UTC().Format(time.RFC3339)})
}
