package platform

import (
	"context"
	"crypto/x509"
	"fmt"

	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-framework/types/basetypes"

	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/cloud/gcp/shieldedvm"
	"github.com/berthlabs/berth/internal/metadata"
)

// gce is Google Compute Engine. It trusts a Shielded VM's vTPM by Google's certificate of its endorsement key, which
// names the instance.
type gce struct{}

// gcpModel names the first control-plane node's Compute Engine instance.
type gcpModel struct {
	Project          types.String `tfsdk:"project"`
	Zone             types.String `tfsdk:"zone"`
	Instance         types.String `tfsdk:"instance"`
	EKCACertificates types.String `tfsdk:"ek_ca_certificates"`
}

func (gce) attribute() string { return "gcp" }
func (gce) nodes() string     { return "Compute Engine Shielded VMs" }
func (gce) way() string       { return "by Google's certificate naming its instance" }

func (gce) schema(string) schema.Attribute {
	return schema.SingleNestedAttribute{
		Optional: true,
		MarkdownDescription: "The node is a Google Compute Engine Shielded VM. Google certifies the " +
			"endorsement key of every Shielded VM's vTPM, and names the instance (project, zone, id and " +
			"name) in an extension of that certificate. The certificate must chain to Google's vTPM EK CAs " +
			"(built into the provider) and name the instance given here. This binds the TPM to that " +
			"instance, so the secrets go to no other machine, even one that took over the instance's " +
			"address. The provider calls no Google API for it and needs no Google credentials. A vTPM " +
			"whose certificate names no instance (older vTPMs) is refused: without the Compute API, which " +
			"the provider does not ask, nothing binds its key to the instance.",
		Attributes: map[string]schema.Attribute{
			"project": schema.StringAttribute{
				Required:            true,
				MarkdownDescription: "The instance's project id (such as `berth-prod`; not the project number).",
			},
			"zone": schema.StringAttribute{
				Required:            true,
				MarkdownDescription: "The instance's zone, such as `europe-west1-b`.",
			},
			"instance": schema.StringAttribute{
				Required: true,
				MarkdownDescription: "The instance's name or its numeric id " +
					"(`google_compute_instance.<name>.name` or `.instance_id`).",
			},
			"ek_ca_certificates": schema.StringAttribute{
				Optional: true,
				MarkdownDescription: "PEM certificates of CAs (roots and intermediates) that replace Google's " +
					"vTPM EK CAs, for private clouds and labs whose vTPMs carry certificates of Google's " +
					"shape from a CA of their own. Unset: Google's.",
			},
		},
	}
}

// gcpProbe is an instance path that shieldedvm.ParseInstance accepts, whose parts validate replaces one at
// a time.
var gcpProbe = shieldedvm.Instance{Project: "berth-example", Zone: "europe-west1-b", Instance: "node-0"}

// validate checks the known parts of v. Each part of the instance's path is checked by
// shieldedvm.ParseInstance, the trust's own parser, with the other parts valid placeholders: the error then
// lands on the attribute that is wrong, even while the others are still unknown.
func (gce) validate(ctx context.Context, v attr.Value, diags *diag.Diagnostics) {
	var g gcpModel
	if diags.Append(v.(types.Object).As(ctx, &g, basetypes.ObjectAsOptions{})...); diags.HasError() {
		return
	}
	checkGCP(g, diags)
}

func checkGCP(g gcpModel, diags *diag.Diagnostics) {
	var probe shieldedvm.Instance
	for _, p := range []struct {
		attr string
		v    types.String
		part *string
		want string
	}{
		{"project", g.Project, &probe.Project, "a project id: 6 to 30 lowercase letters, digits and hyphens, " +
			`starting with a letter ("example.com:" before it for a domain-scoped project), not a project number`},
		{"zone", g.Zone, &probe.Zone, `a zone such as "europe-west1-b" (a region's name and a letter)`},
		{"instance", g.Instance, &probe.Instance, "an instance name (a lowercase letter, then up to 62 lowercase " +
			"letters, digits and hyphens, not ending in a hyphen) or a numeric instance id"},
	} {
		if p.v.IsNull() || p.v.IsUnknown() {
			continue
		}
		probe = gcpProbe
		*p.part = p.v.ValueString()
		if _, err := shieldedvm.ParseInstance(probe.String()); err != nil {
			diags.AddAttributeError(path.Root("gcp").AtName(p.attr), "Invalid Compute Engine instance",
				fmt.Sprintf("gcp.%s is %q, which is not %s.", p.attr, p.v.ValueString(), p.want))
		}
	}
	if !g.EKCACertificates.IsNull() && !g.EKCACertificates.IsUnknown() {
		if _, _, err := attest.ParseCABundle([]byte(g.EKCACertificates.ValueString())); err != nil {
			diags.AddAttributeError(path.Root("gcp").AtName("ek_ca_certificates"), "Invalid EK CA certificates", err.Error())
		}
	}
}

// trust trusts a vTPM whose EK certificate chains to Google's CAs (or gcp's own) and names gcp's instance.
// Without a Compute API to ask (a nil identity source), shieldedvm.Trust requires that name: that is what
// lets the provider do without Google credentials.
func (gce) trust(ctx context.Context, v attr.Value) (attest.EKTrust, string, diag.Diagnostics) {
	var g gcpModel
	diags := v.(types.Object).As(ctx, &g, basetypes.ObjectAsOptions{})
	if diags.HasError() {
		return nil, "", diags
	}
	if checkGCP(g, &diags); diags.HasError() {
		return nil, "", diags
	}
	var roots, inters *x509.CertPool
	var err error
	if g.EKCACertificates.IsNull() {
		if roots, inters, err = shieldedvm.GoogleCAs(); err != nil {
			diags.AddError("Google's vTPM CAs do not load", err.Error())
			return nil, "", diags
		}
	} else if roots, inters, err = attest.ParseCABundle([]byte(g.EKCACertificates.ValueString())); err != nil {
		diags.AddAttributeError(path.Root("gcp").AtName("ek_ca_certificates"), "Invalid EK CA certificates", err.Error())
		return nil, "", diags
	}
	inst := shieldedvm.Instance{Project: g.Project.ValueString(), Zone: g.Zone.ValueString(), Instance: g.Instance.ValueString()}
	return shieldedvm.NewTrust(roots, inters, nil, nil), inst.String(), diags
}

func (gce) groupAttribute() string { return "instance_groups" }
func (gce) group() string          { return "instance group" }

func (gce) groupDescription() string {
	return "For the control-plane nodes on Google Compute Engine: managed instance group, as " +
		"`<region or zone>/<name>` (a regional group `europe-west1/berth-workers`, a zonal one " +
		"`europe-west1-b/berth-workers`), to role (`control-plane` or `worker`). Their join services admit " +
		"the instances of these groups only, each with its group's role: membership of a managed instance " +
		"group is Compute Engine's own record, which no node can write, so no node picks its own role. " +
		"Leave it out of workers' user-data."
}

// checkGroup checks a group's key in the form the join service parses.
func (gce) checkGroup(name string) error { return metadata.ValidateInstanceGroup(name) }

func (gce) setGroups(u *metadata.UserData, roles map[string]metadata.Role) { u.InstanceGroups = roles }
