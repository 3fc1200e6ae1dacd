package platform

import (
	"context"

	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/types"

	"github.com/berthlabs/berth/internal/attest"
)

// certChain trusts a TPM whose endorsement key certificate chains to given CAs: TPMs of vendors that
// certify their keys (the lab's and bare metal's), and clouds' vTPMs that carry a certificate.
type certChain struct{}

func (certChain) attribute() string { return "ek_ca_certificates" }
func (certChain) nodes() string     { return "TPMs with endorsement key certificates" }
func (certChain) way() string       { return "by its certificate chain" }

func (certChain) schema(oneOf string) schema.Attribute {
	return schema.StringAttribute{
		Optional: true,
		MarkdownDescription: "PEM certificates of the CAs that issue the endorsement key certificates of the " +
			"nodes' TPMs (the TPM vendor's or the cloud's vTPM CA; root and intermediate certificates). " +
			"Exactly one of " + oneOf + " is set.",
	}
}

func (c certChain) validate(ctx context.Context, v attr.Value, diags *diag.Diagnostics) {
	_, _, d := c.trust(ctx, v)
	diags.Append(d...)
}

func (certChain) trust(_ context.Context, v attr.Value) (attest.EKTrust, string, diag.Diagnostics) {
	var diags diag.Diagnostics
	roots, inters, err := attest.ParseCABundle([]byte(v.(types.String).ValueString()))
	if err != nil {
		diags.AddAttributeError(path.Root("ek_ca_certificates"), "Invalid EK CA certificates", err.Error())
		return nil, "", diags
	}
	return attest.NewCertChain(roots, inters, nil), "", diags
}
