// Package provider is Berth's Terraform provider: it makes a cluster's public secrets material
// (berth_secrets), hands the secrets themselves to other resources only as ephemeral values, reads the
// Packer image manifest (berth_image) and renders node user-data (berth_node_config).
//
// Terraform state holds nothing secret: the operator keeps one root key and gives it through Terraform's
// ephemeral channel (write-only arguments, ephemeral variables and resources); every secret and both CA keys
// are derived from it again whenever they are needed (package clustersecrets).
package provider

import (
	"context"

	"github.com/hashicorp/terraform-plugin-framework/datasource"
	"github.com/hashicorp/terraform-plugin-framework/ephemeral"
	"github.com/hashicorp/terraform-plugin-framework/provider"
	"github.com/hashicorp/terraform-plugin-framework/provider/schema"
	"github.com/hashicorp/terraform-plugin-framework/resource"
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
			"from one root key, reads the Packer image manifest and renders node user-data.\n\n" +
			"The provider has no configuration. Terraform state never holds a secret: the root key reaches the " +
			"provider only through write-only arguments and ephemeral resources (Terraform 1.11 or later).",
	}
}

// Configure has nothing to do: no resource of this provider talks to an API that needs credentials.
func (p *berthProvider) Configure(context.Context, provider.ConfigureRequest, *provider.ConfigureResponse) {
}

func (p *berthProvider) Resources(context.Context) []func() resource.Resource {
	return []func() resource.Resource{newSecretsResource}
}

func (p *berthProvider) EphemeralResources(context.Context) []func() ephemeral.EphemeralResource {
	return []func() ephemeral.EphemeralResource{newSecretsEphemeralResource}
}

func (p *berthProvider) DataSources(context.Context) []func() datasource.DataSource {
	return []func() datasource.DataSource{newImageDataSource, newNodeConfigDataSource}
}
