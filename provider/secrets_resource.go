package provider

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/int64default"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/int64planmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/planmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/stringplanmodifier"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-log/tflog"

	"github.com/berthlabs/berth/internal/clustersecrets"
	"github.com/berthlabs/berth/internal/keys"
	"github.com/berthlabs/berth/internal/pki"
)

const (
	defaultCAValidityDays = 3650
	// maxCAValidityDays keeps the validity far below what a time.Duration can hold (292 years).
	maxCAValidityDays = 36500
)

var (
	_ resource.Resource                   = (*secretsResource)(nil)
	_ resource.ResourceWithValidateConfig = (*secretsResource)(nil)
	_ resource.ResourceWithImportState    = (*secretsResource)(nil)
	_ resource.ResourceWithConfigure      = (*secretsResource)(nil)
)

// secretsResource is berth_secrets: the public half of a cluster's secrets, made from a write-only root key.
type secretsResource struct {
	now  func() time.Time
	data *providerData
}

func newSecretsResource() resource.Resource {
	return &secretsResource{now: time.Now}
}

type secretsResourceModel struct {
	RootKeyWO               types.String `tfsdk:"root_key_wo"`
	RootKeyWOVersion        types.Int64  `tfsdk:"root_key_wo_version"`
	CAValidityDays          types.Int64  `tfsdk:"ca_validity_days"`
	ID                      types.String `tfsdk:"id"`
	ClusterID               types.String `tfsdk:"cluster_id"`
	KubernetesCACertificate types.String `tfsdk:"kubernetes_ca_certificate"`
	JoinCACertificate       types.String `tfsdk:"join_ca_certificate"`
	KubernetesCAPin         types.String `tfsdk:"kubernetes_ca_pin"`
	JoinCAPin               types.String `tfsdk:"join_ca_pin"`
	InitSecretHash          types.String `tfsdk:"init_secret_hash"`
}

func (r *secretsResource) Metadata(_ context.Context, req resource.MetadataRequest, resp *resource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_secrets"
}

func (r *secretsResource) Schema(_ context.Context, _ resource.SchemaRequest, resp *resource.SchemaResponse) {
	// Everything the resource computes follows from the root key, which Terraform cannot see change; only a
	// new version (or validity) makes new values, and then by replacement.
	keep := []planmodifier.String{stringplanmodifier.UseStateForUnknown()}
	computed := func(desc string) schema.StringAttribute {
		return schema.StringAttribute{Computed: true, MarkdownDescription: desc, PlanModifiers: keep}
	}
	resp.Schema = schema.Schema{
		MarkdownDescription: "The public half of a Berth cluster's secrets: its ID, the Kubernetes and join CA " +
			"certificates with their pins, and the hash of the init secret.\n\n" +
			"Every secret (master secret, salt, init secret, both CA private keys) is derived from one **root key** " +
			"that you keep outside Terraform and pass as a write-only argument, so none of them is ever stored in " +
			"state or plan. Get the secrets themselves, when another resource needs them, from the ephemeral " +
			"resource `berth_secrets` with the same root key.\n\n" +
			"The same root key always gives the same keys, pins, cluster ID and init secret hash; new CA " +
			"certificates are made each time the resource is created. Requires Terraform 1.11 or later " +
			"(write-only arguments).\n\n" +
			"Import (after Terraform state was lost) takes the API server's `host:port` as ID and the root key " +
			"from the provider's `root_key`: the provider reads the running cluster's CA certificates with " +
			"admin credentials it mints from the root key, and keeps them only if their keys are the root " +
			"key's.",
		Attributes: map[string]schema.Attribute{
			"root_key_wo": schema.StringAttribute{
				Required:  true,
				WriteOnly: true,
				Sensitive: true,
				MarkdownDescription: "The root key: base64 (standard or URL-safe alphabet, padded or not) of at least " +
					"32 random bytes, e.g. from `head -c 32 /dev/urandom | base64`. Write-only: Terraform never " +
					"stores it. Pass it from an `ephemeral` variable or an ephemeral resource. Changing it alone " +
					"changes nothing (see `root_key_wo_version`).",
			},
			"root_key_wo_version": schema.Int64Attribute{
				Required: true,
				MarkdownDescription: "Version of `root_key_wo`: Terraform cannot see a write-only value change, so " +
					"only a change of this number makes new secrets, by replacing the resource. Keep it for the " +
					"life of the cluster: **a root key cannot be rotated**. A new one is a new cluster (new CAs, " +
					"pins, ID and disk keys), which a running cluster refuses (`berth_cluster`: the CA certificates " +
					"are fixed once the cluster exists). An import sets it to 1; a configuration with another " +
					"number then changes only state.",
				PlanModifiers: []planmodifier.Int64{int64planmodifier.RequiresReplaceIf(replaceUnlessImported,
					"Changing the version replaces the resource, except right after an import.",
					"Changing the version replaces the resource, except right after an import.")},
			},
			"ca_validity_days": schema.Int64Attribute{
				Optional: true,
				Computed: true,
				Default:  int64default.StaticInt64(defaultCAValidityDays),
				MarkdownDescription: fmt.Sprintf("How long the CA certificates are valid, in days, from 1 to %d. "+
					"Default %d. Changing it replaces the resource (new certificates; same keys and pins).",
					maxCAValidityDays, defaultCAValidityDays),
				PlanModifiers: []planmodifier.Int64{int64planmodifier.RequiresReplace()},
			},
			"id":         computed("The cluster ID, the same as `cluster_id`."),
			"cluster_id": computed("The cluster ID: 32 hex digits derived from the master secret and salt."),
			"kubernetes_ca_certificate": computed("PEM certificate of the cluster's Kubernetes CA (a self-signed " +
				"P-256 CA, common name `kubernetes`)."),
			"join_ca_certificate": computed("PEM certificate of the join CA, which signs the join service" +
				"'s certificates (common name `berth-join-ca`)."),
			"kubernetes_ca_pin": computed("SPKI pin of the Kubernetes CA, `sha256:<64 hex>`, the form of kubeadm's " +
				"`--discovery-token-ca-cert-hash`."),
			"join_ca_pin": computed("SPKI pin of the join CA, `sha256:<64 hex>`; nodes get it in their user-data " +
				"(`berth_node_config`) and trust no join service without it."),
			"init_secret_hash": computed("argon2id hash (PHC string) of the init secret. Only the first " +
				"control-plane node's user-data carries it; the init secret itself comes from the ephemeral " +
				"resource `berth_secrets`."),
		},
	}
}

func (r *secretsResource) ValidateConfig(ctx context.Context, req resource.ValidateConfigRequest, resp *resource.ValidateConfigResponse) {
	var rootKey types.String
	resp.Diagnostics.Append(req.Config.GetAttribute(ctx, path.Root("root_key_wo"), &rootKey)...)
	if !rootKey.IsNull() && !rootKey.IsUnknown() {
		if _, err := clustersecrets.ParseRootKey(rootKey.ValueString()); err != nil {
			resp.Diagnostics.AddAttributeError(path.Root("root_key_wo"), "Invalid root key", err.Error())
		}
	}
	var days types.Int64
	resp.Diagnostics.Append(req.Config.GetAttribute(ctx, path.Root("ca_validity_days"), &days)...)
	if !days.IsNull() && !days.IsUnknown() {
		if d := days.ValueInt64(); d < 1 || d > maxCAValidityDays {
			resp.Diagnostics.AddAttributeError(path.Root("ca_validity_days"), "Invalid CA validity",
				fmt.Sprintf("ca_validity_days is %d, want 1 to %d.", d, maxCAValidityDays))
		}
	}
}

func (r *secretsResource) Create(ctx context.Context, req resource.CreateRequest, resp *resource.CreateResponse) {
	var plan secretsResourceModel
	resp.Diagnostics.Append(req.Plan.Get(ctx, &plan)...)
	// Write-only values are never in the plan, only in the configuration.
	var rootKey types.String
	resp.Diagnostics.Append(req.Config.GetAttribute(ctx, path.Root("root_key_wo"), &rootKey)...)
	if resp.Diagnostics.HasError() {
		return
	}
	if rootKey.IsNull() || rootKey.IsUnknown() {
		resp.Diagnostics.AddAttributeError(path.Root("root_key_wo"), "Missing root key",
			"root_key_wo has no known value at apply time; pass it from an ephemeral variable or resource.")
		return
	}
	root, err := clustersecrets.ParseRootKey(rootKey.ValueString())
	if err != nil {
		resp.Diagnostics.AddAttributeError(path.Root("root_key_wo"), "Invalid root key", err.Error())
		return
	}
	secrets, err := clustersecrets.Derive(root)
	if err != nil {
		resp.Diagnostics.AddError("Deriving cluster secrets", err.Error())
		return
	}
	validity := time.Duration(plan.CAValidityDays.ValueInt64()) * 24 * time.Hour
	pub, err := makePublic(secrets, r.now(), validity)
	if err != nil {
		resp.Diagnostics.AddError("Making cluster CAs", err.Error())
		return
	}
	plan.RootKeyWO = types.StringNull()
	plan.setPublic(pub)
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
}

// Read has nothing to refresh: everything lives in state, and the root key is not available to Read.
func (r *secretsResource) Read(context.Context, resource.ReadRequest, *resource.ReadResponse) {}

// Update is reached only when no attribute that matters changed (every one of them forces replacement), or
// the version of an imported resource did: the plan, made of prior state, becomes the state.
func (r *secretsResource) Update(ctx context.Context, req resource.UpdateRequest, resp *resource.UpdateResponse) {
	var plan secretsResourceModel
	resp.Diagnostics.Append(req.Plan.Get(ctx, &plan)...)
	if resp.Diagnostics.HasError() {
		return
	}
	plan.RootKeyWO = types.StringNull()
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
	resp.Diagnostics.Append(resp.Private.SetKey(ctx, importedKey, nil)...)
}

// replaceUnlessImported replaces the resource for a new root_key_wo_version, unless the resource was
// imported and not applied since: an import cannot know the configuration's version and sets 1.
func replaceUnlessImported(ctx context.Context, req planmodifier.Int64Request, resp *int64planmodifier.RequiresReplaceIfFuncResponse) {
	imported, diags := req.Private.GetKey(ctx, importedKey)
	resp.Diagnostics.Append(diags...)
	resp.RequiresReplace = imported == nil
}

func (r *secretsResource) Configure(_ context.Context, req resource.ConfigureRequest, _ *resource.ConfigureResponse) {
	if data, ok := req.ProviderData.(*providerData); ok {
		r.data = data
	}
}

// Delete only forgets: nothing exists outside the state.
func (r *secretsResource) Delete(context.Context, resource.DeleteRequest, *resource.DeleteResponse) {}

// ImportState reads the cluster whose API server the ID names; see readImportedCluster.
func (r *secretsResource) ImportState(ctx context.Context, req resource.ImportStateRequest, resp *resource.ImportStateResponse) {
	rootKey, ok := importRootKey(r.data, "berth_secrets", &resp.Diagnostics)
	if !ok {
		return
	}
	c, err := readImportedCluster(ctx, rootKey, req.ID)
	if err != nil {
		importError(&resp.Diagnostics, "berth_secrets", req.ID, err)
		return
	}
	pub, err := publicOf(c.secrets, c.kubeCA, c.joinCA)
	if err != nil {
		importError(&resp.Diagnostics, "berth_secrets", req.ID, err)
		return
	}
	// The certificates span their validity and the clock skew pki allows before their start.
	days := math.Round(c.kubeCA.Cert.NotAfter.Sub(c.kubeCA.Cert.NotBefore).Hours() / 24)
	m := secretsResourceModel{
		RootKeyWO:        types.StringNull(),
		RootKeyWOVersion: types.Int64Value(1),
		CAValidityDays:   types.Int64Value(int64(days)),
	}
	m.setPublic(pub)
	resp.Diagnostics.Append(resp.State.Set(ctx, &m)...)
	resp.Diagnostics.Append(resp.Private.SetKey(ctx, importedKey, []byte("true"))...)
	tflog.Info(ctx, "imported berth_secrets", map[string]any{"cluster_id": pub.clusterID, "api_server": req.ID})
}

func (m *secretsResourceModel) setPublic(pub public) {
	m.ID = types.StringValue(pub.clusterID)
	m.ClusterID = types.StringValue(pub.clusterID)
	m.KubernetesCACertificate = types.StringValue(pub.kubeCert)
	m.JoinCACertificate = types.StringValue(pub.joinCert)
	m.KubernetesCAPin = types.StringValue(pub.kubePin)
	m.JoinCAPin = types.StringValue(pub.joinPin)
	m.InitSecretHash = types.StringValue(pub.initSecretHash)
}

// public is what berth_secrets keeps of a root key's secrets: nothing that is secret.
type public struct {
	clusterID, kubeCert, joinCert, kubePin, joinPin, initSecretHash string
}

func makePublic(s *clustersecrets.Secrets, now time.Time, validity time.Duration) (public, error) {
	kube, join, err := s.NewCAs(now, validity)
	if err != nil {
		return public{}, err
	}
	return publicOf(s, kube, join)
}

// publicOf is what berth_secrets keeps of s with the CAs kube and join, made for s's keys.
func publicOf(s *clustersecrets.Secrets, kube, join *pki.CA) (public, error) {
	id, err := keys.ClusterIDOf(s.MasterSecret, s.Salt)
	if err != nil {
		return public{}, err
	}
	hash, err := s.InitSecretHash()
	if err != nil {
		return public{}, err
	}
	return public{
		clusterID:      id,
		kubeCert:       string(kube.CertPEM()),
		joinCert:       string(join.CertPEM()),
		kubePin:        pki.SPKIPin(kube.Cert),
		joinPin:        pki.SPKIPin(join.Cert),
		initSecretHash: hash,
	}, nil
}
