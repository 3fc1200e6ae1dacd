// Package provider is Berth's Terraform provider: it makes a cluster's public secrets material
// (berth_secrets), hands the secrets themselves to other resources only as ephemeral values, reads the
// Packer image manifest (berth_image), renders node user-data (berth_node_config), initializes the cluster
// on an attested first node (berth_cluster) and writes the join policy into it (berth_join_policy).
//
// Terraform state holds nothing secret: the operator keeps one root key and gives it through Terraform's
// ephemeral channel (write-only arguments, ephemeral variables and resources); every secret and both CA keys
// are derived from it again whenever they are needed (package clustersecrets).
package provider

import (
	"context"
	"strings"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/datasource"
	"github.com/hashicorp/terraform-plugin-framework/ephemeral"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/provider"
	"github.com/hashicorp/terraform-plugin-framework/provider/schema"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/berthlabs/berth/internal/clustersecrets"
)

var (
	_ provider.Provider                       = (*berthProvider)(nil)
	_ provider.ProviderWithEphemeralResources = (*berthProvider)(nil)
)

type berthProvider struct {
	version string
}

// New returns the provider's factory; version is the release ("dev" for local builds, "test" in tests).
func New(version string) func() provider.Provider {
	return func() provider.Provider {
		return &berthProvider{version: version}
	}
}

func (p *berthProvider) Metadata(_ context.Context, _ provider.MetadataRequest, resp *provider.MetadataResponse) {
	resp.TypeName = "berth"
	resp.Version = p.version
}

func (p *berthProvider) Schema(_ context.Context, _ provider.SchemaRequest, resp *provider.SchemaResponse) {
	resp.Schema = schema.Schema{
		MarkdownDescription: "Berth turns a baked VM image into a Kubernetes node that proves, by TPM attestation, " +
			"what it runs before it gets any secret. This provider makes the cluster's CA certificates and pins " +
			"from one root key, reads the Packer image manifest, renders node user-data, initializes the cluster " +
			"on its first control-plane node once that node has proved its image, and writes the join policy.\n\n" +
			"Terraform state never holds a secret: the root key reaches the provider only through write-only " +
			"arguments and ephemeral resources (Terraform 1.11 or later).",
		Attributes: map[string]schema.Attribute{
			"kubeconfig": schema.StringAttribute{
				Optional:  true,
				Sensitive: true,
				MarkdownDescription: "Admin kubeconfig (its content, not a path) of the cluster, for the resources " +
					"that write into it (`berth_join_policy`). Provider configuration is not stored in state.",
			},
			"root_key": schema.StringAttribute{
				Optional:  true,
				Sensitive: true,
				MarkdownDescription: "The cluster's root key, for importing `berth_secrets` and `berth_cluster` " +
					"after Terraform state was lost, and for renewing the admin kubeconfig in `berth_cluster`'s state " +
					"before it ends; nothing else reads it. Pass it from an `ephemeral` variable or " +
					"an ephemeral read of the secret store that keeps it: provider configuration is never stored " +
					"in state or plan. An import ID cannot carry it, because Terraform prints import IDs.",
			},
		},
	}
}

// providerModel is the provider's configuration.
type providerModel struct {
	Kubeconfig types.String `tfsdk:"kubeconfig"`
	RootKey    types.String `tfsdk:"root_key"`
}

// providerData is what resources get from Configure.
type providerData struct {
	// kube is nil when no kubeconfig was configured; resources that need the cluster say so.
	kube kubernetes.Interface
	// kubeUnknown is a kubeconfig that is not known yet: one from a berth_cluster that this run creates.
	kubeUnknown bool
	// rootKey is the root key for imports, "" when none was configured.
	rootKey string
}

// Configure connects to the cluster when a kubeconfig is given. Provider configuration is never stored in
// state, so the admin credentials it holds stay out of it.
func (p *berthProvider) Configure(ctx context.Context, req provider.ConfigureRequest, resp *provider.ConfigureResponse) {
	var cfg providerModel
	resp.Diagnostics.Append(req.Config.Get(ctx, &cfg)...)
	if resp.Diagnostics.HasError() {
		return
	}
	data := &providerData{kubeUnknown: cfg.Kubeconfig.IsUnknown(), rootKey: cfg.RootKey.ValueString()}
	if data.rootKey != "" {
		if _, err := clustersecrets.ParseRootKey(data.rootKey); err != nil {
			resp.Diagnostics.AddAttributeError(path.Root("root_key"), "Invalid root key", err.Error())
			return
		}
	}
	if !cfg.Kubeconfig.IsNull() && !cfg.Kubeconfig.IsUnknown() {
		rc, err := clientcmd.RESTConfigFromKubeConfig([]byte(cfg.Kubeconfig.ValueString()))
		if err != nil {
			resp.Diagnostics.AddAttributeError(path.Root("kubeconfig"), "Invalid kubeconfig", kubeconfigError(cfg.Kubeconfig.ValueString(), err))
			return
		}
		rc.Timeout = 30 * time.Second
		if data.kube, err = kubernetes.NewForConfig(rc); err != nil {
			resp.Diagnostics.AddAttributeError(path.Root("kubeconfig"), "Invalid kubeconfig", err.Error())
			return
		}
	}
	resp.ResourceData = data
	// berth_cluster_health reads the cluster through the same kubeconfig.
	resp.DataSourceData = data
}

// kubeconfigError says why a kubeconfig gives the provider no cluster, and what it takes instead. The
// kubeconfig itself is never shown: it holds the admin's private key.
func kubeconfigError(given string, err error) string {
	why := "The kubeconfig does not parse: " + err.Error() + "."
	switch {
	case strings.TrimSpace(given) == "":
		// client-go's own word for it is to set KUBERNETES_MASTER, which the provider never reads.
		why = "kubeconfig is empty."
	case clientcmd.IsEmptyConfig(err):
		why = "The kubeconfig names no cluster."
	case !strings.Contains(strings.TrimSpace(given), "\n") && !strings.ContainsAny(given, "{[") && !strings.Contains(given, ": "):
		why = "kubeconfig is one line that is not YAML, such as a file's path: it takes the file's content, " +
			"`kubeconfig = file(\"<path>\")`."
	}
	return why + " Berth needs the admin kubeconfig's content, such as `kubeconfig = berth_cluster.<name>.kubeconfig`, " +
		"or `file(\"admin.conf\")` for a cluster made elsewhere. Leave kubeconfig unset where no berth_join_policy " +
		"writes into a cluster."
}

func (p *berthProvider) Resources(context.Context) []func() resource.Resource {
	return []func() resource.Resource{newSecretsResource, newClusterResource, newJoinPolicyResource}
}

func (p *berthProvider) EphemeralResources(context.Context) []func() ephemeral.EphemeralResource {
	return []func() ephemeral.EphemeralResource{newSecretsEphemeralResource, newAdminCredentialsEphemeralResource}
}

func (p *berthProvider) DataSources(context.Context) []func() datasource.DataSource {
	return []func() datasource.DataSource{newImageDataSource, newNodeConfigDataSource, newClusterHealthDataSource}
}
