// Package platform holds the provider's per-platform blocks, as nodeagent/internal/platform holds the agent's:
// how berth_cluster trusts the first node's TPM (an endorsement-key certificate chain, EC2's record of a
// NitroTPM, Google's certificate of a Shielded VM's vTPM) and which map of cloud instance groups to roles
// berth_node_config writes into the user-data. Each platform is one file here; Trust and Groups, the model
// parts the resources embed, and their settings methods below are the one list of them: a new platform is
// a new file and a line in each.
package platform

import (
	"context"
	"fmt"
	"strings"

	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/types"

	"github.com/berthlabs/berth/internal/attest"
)

// Trust is the part of berth_cluster's model that says how the first control-plane node's TPM is trusted:
// exactly one of its attributes is set. The cloud blocks are objects rather than pointers to their models:
// a pointer takes null but not unknown, and at plan time a whole block can be unknown (computed from another
// resource, or a conditional on one), which a pointer would refuse with a conversion error.
type Trust struct {
	EKCACertificates types.String `tfsdk:"ek_ca_certificates"`
	AWS              types.Object `tfsdk:"aws"`
	GCP              types.Object `tfsdk:"gcp"`
}

// Groups is the part of berth_node_config's model that maps a cloud's groups of instances to the role
// their instances join with, one attribute per cloud. Only the cloud itself records group membership, so
// no node picks its own role.
type Groups struct {
	AutoscalingGroups map[string]string `tfsdk:"autoscaling_groups"`
	InstanceGroups    map[string]string `tfsdk:"instance_groups"`
}

// trustKind is one platform's way to trust a node's TPM.
type trustKind interface {
	// attribute is its attribute's name in berth_cluster.
	attribute() string
	// schema is its attribute's schema; oneOf lists every kind's attribute for the description.
	schema(oneOf string) schema.Attribute
	// nodes names the nodes it is for, and way how it trusts them, in the errors that ask for exactly one.
	nodes() string
	way() string
	// validate checks v's known parts.
	validate(ctx context.Context, v attr.Value, diags *diag.Diagnostics)
	// trust is the trust that v (every part known) configures, and the instance it is asked about ("" when
	// the trust names none).
	trust(ctx context.Context, v attr.Value) (attest.EKTrust, string, diag.Diagnostics)
}

type setting struct {
	kind  trustKind
	value attr.Value
}

// settings pairs each platform's kind with its value in t: the one list of trust kinds.
func (t *Trust) settings() []setting {
	return []setting{{certChain{}, t.EKCACertificates}, {ec2{}, t.AWS}, {gce{}, t.GCP}}
}

type groupSetting struct {
	kind  groupKind
	roles map[string]string
}

// settings pairs each cloud's kind of group with its map in g: the one list of group kinds.
func (g *Groups) settings() []groupSetting {
	return []groupSetting{{ec2{}, g.AutoscalingGroups}, {gce{}, g.InstanceGroups}}
}

// TrustAttributes are the schemas of Trust's attributes, by name.
func TrustAttributes() map[string]schema.Attribute {
	settings := (&Trust{}).settings()
	names := make([]string, len(settings))
	for i, s := range settings {
		names[i] = "`" + s.kind.attribute() + "`"
	}
	oneOf := series(names, "and")
	attrs := make(map[string]schema.Attribute, len(settings))
	for _, s := range settings {
		attrs[s.kind.attribute()] = s.kind.schema(oneOf)
	}
	return attrs
}

// Validate checks the known values of t. While some of them are unknown (at plan time) it refuses only
// what no value can make right; EKTrust checks again with every value known.
func (t *Trust) Validate(ctx context.Context, diags *diag.Diagnostics) {
	for _, s := range t.settings() {
		if !s.value.IsNull() && !s.value.IsUnknown() {
			s.kind.validate(ctx, s.value, diags)
		}
	}
	t.checkOne(diags)
}

// EKTrust is the trust t configures, with the instance id the trust is asked about. Every value of t is
// known (Create's plan).
func (t *Trust) EKTrust(ctx context.Context) (attest.EKTrust, string, diag.Diagnostics) {
	var diags diag.Diagnostics
	if t.checkOne(&diags); diags.HasError() {
		return nil, "", diags
	}
	for _, s := range t.settings() {
		if !s.value.IsNull() {
			return s.kind.trust(ctx, s.value)
		}
	}
	return nil, "", diags
}

// checkOne refuses a configuration that does not set exactly one way to trust the node's TPM.
func (t *Trust) checkOne(diags *diag.Diagnostics) {
	settings := t.settings()
	var set, all, choices, ways []string
	unknown := false
	for _, s := range settings {
		name := s.kind.attribute()
		all = append(all, name)
		choices = append(choices, fmt.Sprintf("%s (%s)", name, s.kind.nodes()))
		ways = append(ways, s.kind.way())
		switch {
		case s.value.IsUnknown():
			unknown = true
		case !s.value.IsNull():
			set = append(set, name)
		}
	}
	switch {
	case len(set) == 0 && !unknown:
		diags.AddAttributeError(path.Root(all[0]), "No trust for the node's TPM",
			"Set "+series(choices, "or")+": without one of them no node can be attested.")
	case len(set) > 1:
		last := len(set) - 1
		diags.AddAttributeError(path.Root(set[last]), "More than one trust for the node's TPM",
			fmt.Sprintf("%s and %s are set; set only one of %s: the node's TPM is trusted one way, %s.",
				strings.Join(set[:last], ", "), set[last], series(all, "and"),
				strings.Join(ways[:len(ways)-1], ", ")+", or "+ways[len(ways)-1]))
	}
}

// series joins items as prose: "a, b and c".
func series(items []string, conj string) string {
	if len(items) < 2 {
		return strings.Join(items, "")
	}
	return strings.Join(items[:len(items)-1], ", ") + " " + conj + " " + items[len(items)-1]
}
