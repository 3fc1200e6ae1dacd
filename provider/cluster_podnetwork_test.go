package provider

import (
	"cmp"
	"context"
	"maps"
	"slices"
	"strings"
	"testing"

	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/tfsdk"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-go/tftypes"

	"github.com/berthlabs/berth/internal/podnetwork"
)

// TestClusterFromBeforePodNetworks plans a cluster that a provider before pod_network initialized (null in
// state): it got no pod network, so an unset pod_network must plan none, not the default a running cluster
// cannot get, and asking for flannel is refused like any other init setting.
func TestClusterFromBeforePodNetworks(t *testing.T) {
	ctx := context.Background()
	r := &clusterResource{}
	var s resource.SchemaResponse
	r.Schema(ctx, resource.SchemaRequest{}, &s)
	typ := s.Schema.Type().TerraformType(ctx).(tftypes.Object)
	value := func(set map[string]string) tftypes.Value {
		vals := map[string]tftypes.Value{}
		for name, at := range typ.AttributeTypes {
			vals[name] = tftypes.NewValue(at, nil)
		}
		for name, v := range set {
			vals[name] = tftypes.NewValue(tftypes.String, v)
		}
		return tftypes.NewValue(typ, vals)
	}
	old := map[string]string{"endpoint": "10.0.0.10:7451", "cluster_name": "lab", "kubernetes_version": "v1.36.3", "cluster_id": "c1"}
	for _, tc := range []struct {
		configured, want string
		refused          bool
	}{{"", podnetwork.None, false}, {podnetwork.None, podnetwork.None, false}, {podnetwork.Flannel, podnetwork.Flannel, true}} {
		config, plan := maps.Clone(old), maps.Clone(old)
		// What the framework plans before ModifyPlan: the configured value, else the default.
		plan["pod_network"] = cmp.Or(tc.configured, podnetwork.Flannel)
		if tc.configured != "" {
			config["pod_network"] = tc.configured
		}
		req := resource.ModifyPlanRequest{
			State:  tfsdk.State{Schema: s.Schema, Raw: value(old)},
			Plan:   tfsdk.Plan{Schema: s.Schema, Raw: value(plan)},
			Config: tfsdk.Config{Schema: s.Schema, Raw: value(config)},
		}
		resp := resource.ModifyPlanResponse{Plan: req.Plan}
		r.ModifyPlan(ctx, req, &resp)
		var got types.String
		resp.Diagnostics.Append(resp.Plan.GetAttribute(ctx, path.Root("pod_network"), &got)...)
		refused := slices.ContainsFunc(resp.Diagnostics.Errors(), func(d diag.Diagnostic) bool {
			return d.Summary() == "Fixed once the cluster exists" && strings.Contains(d.Detail(), `pod_network = "none"`)
		})
		if got.ValueString() != tc.want || refused != tc.refused || len(resp.Diagnostics.Errors()) != map[bool]int{false: 0, true: 1}[tc.refused] {
			t.Errorf("pod_network configured %q: planned %s, diagnostics %v; want %q, refused %v", tc.configured, got, resp.Diagnostics, tc.want, tc.refused)
		}
	}
}
