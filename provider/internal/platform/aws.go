package platform

import (
	"context"

	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-framework/types/basetypes"

	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/cloud/aws/ec2instances"
	"github.com/berthlabs/berth/internal/metadata"
)

// ec2 is Amazon EC2. It trusts an instance's NitroTPM, which has no endorsement key certificate, by the key EC2 reports
// for the instance.
type ec2 struct{}

// awsModel names the first control-plane node's EC2 instance.
type awsModel struct {
	InstanceID types.String `tfsdk:"instance_id"`
	Region     types.String `tfsdk:"region"`
	Endpoint   types.String `tfsdk:"endpoint"`
}

func (ec2) attribute() string { return "aws" }
func (ec2) nodes() string     { return "EC2 instances with a NitroTPM" }
func (ec2) way() string       { return "by what EC2 reports for its instance" }

func (ec2) schema(string) schema.Attribute {
	return schema.SingleNestedAttribute{
		Optional: true,
		MarkdownDescription: "The node is an EC2 instance with a NitroTPM, which has no endorsement key " +
			"certificate: its endorsement key must be the one EC2 reports for `instance_id` " +
			"(`ec2:GetInstanceTpmEkPub`, called with the provider's AWS credentials from the usual chain: " +
			"environment, shared config, SSO, instance profile). This binds the TPM to that instance, so " +
			"the secrets go to no other machine, even one that took over the instance's address.",
		Attributes: map[string]schema.Attribute{
			"instance_id": schema.StringAttribute{
				Required:            true,
				MarkdownDescription: "The EC2 instance id of the first control-plane node (`i-...`).",
			},
			"region": schema.StringAttribute{
				Required:            true,
				MarkdownDescription: "The instance's region.",
			},
			"endpoint": schema.StringAttribute{
				Optional: true,
				MarkdownDescription: "An EC2 endpoint instead of AWS's own for the region, such as a VPC " +
					"endpoint's URL; `https://`, or `http://` on a loopback address (emulators).",
			},
		},
	}
}

// validate has nothing to check before apply: EC2 is the judge of instance ids and regions.
func (ec2) validate(context.Context, attr.Value, *diag.Diagnostics) {}

func (ec2) trust(ctx context.Context, v attr.Value) (attest.EKTrust, string, diag.Diagnostics) {
	var a awsModel
	diags := v.(types.Object).As(ctx, &a, basetypes.ObjectAsOptions{})
	if diags.HasError() {
		return nil, "", diags
	}
	api, err := ec2instances.NewAPI(ctx, a.Region.ValueString(), a.Endpoint.ValueString(), nil)
	if err != nil {
		diags.AddAttributeError(path.Root("aws"), "Cannot reach EC2", err.Error())
		return nil, "", diags
	}
	return attest.CloudEK{Cloud: "EC2", Source: ec2instances.NewEKs(api, nil)}, a.InstanceID.ValueString(), diags
}

func (ec2) groupAttribute() string { return "autoscaling_groups" }
func (ec2) group() string          { return "autoscaling group" }

func (ec2) groupDescription() string {
	return "For the control-plane nodes on AWS EC2: autoscaling group name to role " +
		"(`control-plane` or `worker`). Their join services admit the instances of these groups only, each " +
		"with its group's role: the group is the instance's `aws:autoscaling:groupName` tag, which only AWS " +
		"sets, so no node picks its own role. Leave it out of workers' user-data."
}

// checkGroup accepts any name: autoscaling group names have no form to check here.
func (ec2) checkGroup(string) error { return nil }

func (ec2) setGroups(u *metadata.UserData, roles map[string]metadata.Role) {
	u.AutoscalingGroups = roles
}
