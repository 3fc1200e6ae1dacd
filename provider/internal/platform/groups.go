package platform

import (
	"context"
	"fmt"
	"maps"
	"slices"

	dschema "github.com/hashicorp/terraform-plugin-framework/datasource/schema"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/tfsdk"
	"github.com/hashicorp/terraform-plugin-framework/types"

	"github.com/berthlabs/berth/internal/metadata"
)

// groupKind is one cloud's kind of instance group.
type groupKind interface {
	// groupAttribute is its attribute's name in berth_node_config, and groupDescription its documentation.
	groupAttribute() string
	groupDescription() string
	// group names one group in errors ("autoscaling group").
	group() string
	// checkGroup checks one group's name.
	checkGroup(name string) error
	// setGroups puts the map into the user-data, under the cloud's own key.
	setGroups(u *metadata.UserData, roles map[string]metadata.Role)
}

// GroupAttributes are the schemas of Groups' attributes, by name.
func GroupAttributes() map[string]dschema.Attribute {
	attrs := map[string]dschema.Attribute{}
	for _, s := range (&Groups{}).settings() {
		attrs[s.kind.groupAttribute()] = dschema.MapAttribute{Optional: true, ElementType: types.StringType,
			MarkdownDescription: s.kind.groupDescription()}
	}
	return attrs
}

// ValidateGroups checks the known entries of every map of group to role in config. Every bad entry gets
// its own error, on its key.
func ValidateGroups(ctx context.Context, config tfsdk.Config, diags *diag.Diagnostics) {
	for _, s := range (&Groups{}).settings() {
		attr := s.kind.groupAttribute()
		var groups types.Map
		diags.Append(config.GetAttribute(ctx, path.Root(attr), &groups)...)
		if groups.IsNull() || groups.IsUnknown() {
			continue
		}
		roles := groups.Elements()
		for _, name := range slices.Sorted(maps.Keys(roles)) {
			at := path.Root(attr).AtMapKey(name)
			if err := s.kind.checkGroup(name); err != nil {
				diags.AddAttributeError(at, "Invalid "+s.kind.group(), err.Error()+".")
			}
			if r, ok := roles[name].(types.String); ok && !r.IsNull() && !r.IsUnknown() && !metadata.Role(r.ValueString()).Valid() {
				diags.AddAttributeError(at, "Invalid role", fmt.Sprintf("%s %q has role %q, want %q or %q.",
					s.kind.group(), name, r.ValueString(), metadata.RoleControlPlane, metadata.RoleWorker))
			}
		}
	}
}

// Apply puts g's maps into u.
func (g *Groups) Apply(u *metadata.UserData) {
	for _, s := range g.settings() {
		if len(s.roles) == 0 {
			continue
		}
		roles := make(map[string]metadata.Role, len(s.roles))
		for group, role := range s.roles {
			roles[group] = metadata.Role(role)
		}
		s.kind.setGroups(u, roles)
	}
}
