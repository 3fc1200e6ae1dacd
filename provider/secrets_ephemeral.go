package provider

import (
	"context"
	"encoding/base64"
	"errors"

	"github.com/hashicorp/terraform-plugin-framework/ephemeral"
	"github.com/hashicorp/terraform-plugin-framework/ephemeral/schema"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/types"

	"github.com/berthlabs/berth/internal/clustersecrets"
	"github.com/berthlabs/berth/internal/pki"
)

var (
	_ ephemeral.EphemeralResource                   = (*secretsEphemeralResource)(nil)
	_ ephemeral.EphemeralResourceWithValidateConfig = (*secretsEphemeralResource)(nil)
)

// secretsEphemeralResource is ephemeral berth_secrets: the secrets of a root key, checked against the CA
// certificates the managed berth_secrets made, for resources that need them during one Terraform run.
type secretsEphemeralResource struct{}

func newSecretsEphemeralResource() ephemeral.EphemeralResource {
	return &secretsEphemeralResource{}
}

type secretsEphemeralModel struct {
	RootKey                 types.String `tfsdk:"root_key"`
	KubernetesCACertificate types.String `tfsdk:"kubernetes_ca_certificate"`
	JoinCACertificate       types.String `tfsdk:"join_ca_certificate"`
	MasterSecret            types.String `tfsdk:"master_secret"`
	Salt                    types.String `tfsdk:"salt"`
	InitSecret              types.String `tfsdk:"init_secret"`
	KubernetesCAKey         types.String `tfsdk:"kubernetes_ca_key"`
	JoinCAKey               types.String `tfsdk:"join_ca_key"`
}

func (e *secretsEphemeralResource) Metadata(_ context.Context, req ephemeral.MetadataRequest, resp *ephemeral.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_secrets"
}

func (e *secretsEphemeralResource) Schema(_ context.Context, _ ephemeral.SchemaRequest, resp *ephemeral.SchemaResponse) {
	secret := func(desc string) schema.StringAttribute {
		return schema.StringAttribute{Computed: true, Sensitive: true, MarkdownDescription: desc}
	}
	resp.Schema = schema.Schema{
		MarkdownDescription: "The secrets of a Berth cluster, derived from its root key for the length of one " +
			"Terraform run and never stored in state or plan. The root key is checked against the CA " +
			"certificates of the managed resource `berth_secrets`: a root key that did not make them is refused, " +
			"so a wrong key never reaches a node. Pass these values only to write-only arguments, provider " +
			"configuration or other ephemeral resources. Requires Terraform 1.10 or later.",
		Attributes: map[string]schema.Attribute{
			"root_key": schema.StringAttribute{
				Required:            true,
				Sensitive:           true,
				MarkdownDescription: "The root key given to `berth_secrets.root_key_wo` (base64 of at least 32 random bytes).",
			},
			"kubernetes_ca_certificate": schema.StringAttribute{
				Required:            true,
				MarkdownDescription: "`berth_secrets.<name>.kubernetes_ca_certificate`.",
			},
			"join_ca_certificate": schema.StringAttribute{
				Required:            true,
				MarkdownDescription: "`berth_secrets.<name>.join_ca_certificate`.",
			},
			"master_secret":     secret("The master secret every node key is derived from, base64 (standard, padded)."),
			"salt":              secret("The salt of those derivations, base64 (standard, padded)."),
			"init_secret":       secret("The init secret the first control-plane node's init server asks for (base64url, unpadded)."),
			"kubernetes_ca_key": secret("Private key of the Kubernetes CA, PKCS#8 PEM."),
			"join_ca_key":       secret("Private key of the join CA, PKCS#8 PEM."),
		},
	}
}

func (e *secretsEphemeralResource) ValidateConfig(ctx context.Context, req ephemeral.ValidateConfigRequest, resp *ephemeral.ValidateConfigResponse) {
	var rootKey types.String
	resp.Diagnostics.Append(req.Config.GetAttribute(ctx, path.Root("root_key"), &rootKey)...)
	if rootKey.IsNull() || rootKey.IsUnknown() {
		return
	}
	if _, err := clustersecrets.ParseRootKey(rootKey.ValueString()); err != nil {
		resp.Diagnostics.AddAttributeError(path.Root("root_key"), "Invalid root key", err.Error())
	}
}

func (e *secretsEphemeralResource) Open(ctx context.Context, req ephemeral.OpenRequest, resp *ephemeral.OpenResponse) {
	var m secretsEphemeralModel
	resp.Diagnostics.Append(req.Config.Get(ctx, &m)...)
	if resp.Diagnostics.HasError() {
		return
	}
	root, err := clustersecrets.ParseRootKey(m.RootKey.ValueString())
	if err != nil {
		resp.Diagnostics.AddAttributeError(path.Root("root_key"), "Invalid root key", err.Error())
		return
	}
	secrets, err := clustersecrets.Derive(root)
	if err != nil {
		resp.Diagnostics.AddError("Deriving cluster secrets", err.Error())
		return
	}
	kube, join, err := secrets.CAs([]byte(m.KubernetesCACertificate.ValueString()), []byte(m.JoinCACertificate.ValueString()))
	switch {
	case errors.Is(err, clustersecrets.ErrWrongRootKey):
		resp.Diagnostics.AddAttributeError(path.Root("root_key"), "Root key does not match berth_secrets",
			"The root key given to ephemeral berth_secrets is not the one the CA certificates of resource "+
				"berth_secrets were made from ("+err.Error()+"). Pass the same root key as berth_secrets.root_key_wo: "+
				"a cluster's root key cannot be rotated, and another one is another cluster.")
		return
	case err != nil:
		resp.Diagnostics.AddError("Invalid CA certificate",
			"The CA certificates given to ephemeral berth_secrets must be those of resource berth_secrets: "+err.Error())
		return
	}
	kubeKey, err := pki.EncodeKeyPEM(kube.Key)
	if err != nil {
		resp.Diagnostics.AddError("Encoding the Kubernetes CA key", err.Error())
		return
	}
	joinKey, err := pki.EncodeKeyPEM(join.Key)
	if err != nil {
		resp.Diagnostics.AddError("Encoding the join CA key", err.Error())
		return
	}
	m.MasterSecret = types.StringValue(base64.StdEncoding.EncodeToString(secrets.MasterSecret))
	m.Salt = types.StringValue(base64.StdEncoding.EncodeToString(secrets.Salt))
	m.InitSecret = types.StringValue(secrets.InitSecret)
	m.KubernetesCAKey = types.StringValue(string(kubeKey))
	m.JoinCAKey = types.StringValue(string(joinKey))
	resp.Diagnostics.Append(resp.Result.Set(ctx, &m)...)
}
