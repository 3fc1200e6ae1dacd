package platform

import (
	"context"
	"testing"

	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/types"
)

// The errors list every platform in prose, built from the kinds: these are their exact words with the
// three platforms there are.
func TestCheckOneWords(t *testing.T) {
	nullObj := types.ObjectNull(map[string]attr.Type{})
	someObj := types.ObjectValueMust(map[string]attr.Type{}, map[string]attr.Value{})
	for _, tc := range []struct {
		name    string
		trust   Trust
		summary string
		detail  string
	}{
		{"none", Trust{EKCACertificates: types.StringNull(), AWS: nullObj, GCP: nullObj}, "No trust for the node's TPM",
			"Set ek_ca_certificates (TPMs with endorsement key certificates), aws (EC2 instances with a NitroTPM) " +
				"or gcp (Compute Engine Shielded VMs): without one of them no node can be attested."},
		{"three", Trust{EKCACertificates: types.StringValue("pem"), AWS: someObj, GCP: someObj},
			"More than one trust for the node's TPM",
			"ek_ca_certificates, aws and gcp are set; set only one of ek_ca_certificates, aws and gcp: the node's " +
				"TPM is trusted one way, by its certificate chain, by what EC2 reports for its instance, or by " +
				"Google's certificate naming its instance."},
		{"unknown", Trust{EKCACertificates: types.StringNull(), AWS: types.ObjectUnknown(map[string]attr.Type{}), GCP: nullObj}, "", ""},
		{"one", Trust{EKCACertificates: types.StringNull(), AWS: someObj, GCP: nullObj}, "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var diags diag.Diagnostics
			tc.trust.checkOne(&diags)
			if tc.summary == "" {
				if diags.HasError() {
					t.Fatalf("checkOne = %v, want no error", diags)
				}
				return
			}
			if len(diags) != 1 || diags[0].Summary() != tc.summary || diags[0].Detail() != tc.detail {
				t.Fatalf("checkOne = %v,\nwant %q: %q", diags, tc.summary, tc.detail)
			}
		})
	}
}

func TestTrustAttributesNameEveryKind(t *testing.T) {
	attrs := TrustAttributes()
	if len(attrs) != len((&Trust{}).settings()) {
		t.Fatalf("%d attributes for %d kinds", len(attrs), len((&Trust{}).settings()))
	}
	got := attrs["ek_ca_certificates"].GetMarkdownDescription()
	const want = "Exactly one of `ek_ca_certificates`, `aws` and `gcp` is set."
	if len(got) < len(want) || got[len(got)-len(want):] != want {
		t.Errorf("ek_ca_certificates' description ends %q, want %q", got, want)
	}
	var diags diag.Diagnostics
	trust := Trust{EKCACertificates: types.StringValue("not PEM"), AWS: types.ObjectNull(nil), GCP: types.ObjectNull(nil)}
	if trust.Validate(context.Background(), &diags); !diags.HasError() {
		t.Error("Validate accepted ek_ca_certificates that are not PEM")
	}
}
