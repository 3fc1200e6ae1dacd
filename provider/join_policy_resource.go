package provider

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/planmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/stringdefault"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/stringplanmodifier"
	"github.com/hashicorp/terraform-plugin-framework/tfsdk"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-framework/types/basetypes"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"

	"github.com/berthlabs/berth/internal/clusterinfo"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/policy"
)

// policyNamespace is where the join service reads its policy.
const policyNamespace = metav1.NamespaceSystem

var (
	_ resource.Resource                   = (*joinPolicyResource)(nil)
	_ resource.ResourceWithConfigure      = (*joinPolicyResource)(nil)
	_ resource.ResourceWithValidateConfig = (*joinPolicyResource)(nil)
	_ resource.ResourceWithModifyPlan     = (*joinPolicyResource)(nil)
	_ resource.ResourceWithImportState    = (*joinPolicyResource)(nil)
)

// joinPolicyResource is berth_join_policy: the ConfigMap the join services read their policy from.
type joinPolicyResource struct {
	kube        kubernetes.Interface
	kubeUnknown bool
}

func newJoinPolicyResource() resource.Resource { return &joinPolicyResource{} }

type joinPolicyModel struct {
	ID     types.String `tfsdk:"id"`
	Name   types.String `tfsdk:"name"`
	Images types.List   `tfsdk:"images"`
	YAML   types.String `tfsdk:"policy_yaml"`
	// ClusterID is the cluster the policy belongs in, from its berth-cluster record.
	ClusterID types.String `tfsdk:"cluster_id"`
}

type joinPolicyImage struct {
	Name    types.String `tfsdk:"name"`
	Roles   types.Set    `tfsdk:"roles"`
	PCRs    types.Map    `tfsdk:"pcrs"`
	Expires types.String `tfsdk:"expires"`
	// KubernetesVersion is the Kubernetes release the image carries.
	KubernetesVersion types.String `tfsdk:"kubernetes_version"`
}

var imageAttrTypes = map[string]attr.Type{
	"name":               types.StringType,
	"roles":              types.SetType{ElemType: types.StringType},
	"pcrs":               types.MapType{ElemType: types.StringType},
	"expires":            types.StringType,
	"kubernetes_version": types.StringType,
}

var lowerHex64 = regexp.MustCompile(`^[0-9a-f]{64}$`)

// maxPCR is the highest PCR index of a TPM 2.0 PC client.
const maxPCR = 23

// pcrValues decodes a map of PCR index ("11") to SHA-256 value in lowercase hex, adding an error at at for
// every entry that is not one; who, when not empty, names whose PCRs they are (an image of a policy).
func pcrValues(ctx context.Context, m types.Map, at path.Path, who string, diags *diag.Diagnostics) map[int][]byte {
	prefix := ""
	if who != "" {
		prefix = who + ": "
	}
	var pcrs map[string]string
	diags.Append(m.ElementsAs(ctx, &pcrs, false)...)
	out := make(map[int][]byte, len(pcrs))
	for _, k := range slices.Sorted(maps.Keys(pcrs)) {
		idx, err := strconv.Atoi(k)
		if err != nil || strconv.Itoa(idx) != k || idx < 0 || idx > maxPCR {
			diags.AddAttributeError(at, "Invalid PCR index", fmt.Sprintf("%sPCR index %q is not a plain decimal number 0-%d.", prefix, k, maxPCR))
			continue
		}
		if !lowerHex64.MatchString(pcrs[k]) {
			diags.AddAttributeError(at.AtMapKey(k), "Invalid PCR value",
				fmt.Sprintf("%sPCR %s must be 64 lowercase hex digits (a SHA-256 value), got %q.", prefix, k, pcrs[k]))
			continue
		}
		out[idx], _ = hex.DecodeString(pcrs[k])
	}
	return out
}

func (r *joinPolicyResource) Metadata(_ context.Context, req resource.MetadataRequest, resp *resource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_join_policy"
}

func (r *joinPolicyResource) Schema(_ context.Context, _ resource.SchemaRequest, resp *resource.SchemaResponse) {
	resp.Schema = schema.Schema{
		MarkdownDescription: "Which images may join the cluster, per role: the join policy that every join service " +
			"reads from a ConfigMap in `kube-system` and reloads on change. A node joins only when every PCR of " +
			"one image allowed for its role (from its instance record) equals its quoted value and the image has " +
			"not expired. Removing an image stops new nodes of it from joining; it does not touch running nodes.\n\n" +
			"Needs the provider's `kubeconfig`. Import with the ConfigMap's name (`berth-join-policy`).",
		Attributes: map[string]schema.Attribute{
			"id": schema.StringAttribute{Computed: true, MarkdownDescription: "`kube-system/<name>`.",
				PlanModifiers: []planmodifier.String{stringplanmodifier.UseStateForUnknown()}},
			"name": schema.StringAttribute{Optional: true, Computed: true, Default: stringdefault.StaticString(policy.DefaultConfigMap),
				MarkdownDescription: "Name of the ConfigMap; the agents' `policyConfigMap` (default `berth-join-policy`).",
				PlanModifiers:       []planmodifier.String{stringplanmodifier.RequiresReplace()}},
			"images": schema.ListNestedAttribute{
				Required:            true,
				MarkdownDescription: "The images allowed to join. An empty list lets no node join.",
				NestedObject: schema.NestedAttributeObject{Attributes: map[string]schema.Attribute{
					"name": schema.StringAttribute{Required: true, MarkdownDescription: "Unique name of the image (lowercase letters, digits, `.` and `-`)."},
					"roles": schema.SetAttribute{Required: true, ElementType: types.StringType,
						MarkdownDescription: "Roles nodes of this image may have: `control-plane`, `worker`."},
					"pcrs": schema.MapAttribute{Required: true, ElementType: types.StringType,
						MarkdownDescription: "SHA-256 PCR values by index (`\"0\"`–`\"23\"`), 64 lowercase hex digits each; for example `data.berth_image.this.pcrs`."},
					"expires": schema.StringAttribute{Optional: true,
						MarkdownDescription: "RFC 3339 time in UTC (`2026-12-31T00:00:00Z`) after which the image no longer joins."},
					"kubernetes_version": schema.StringAttribute{Optional: true,
						MarkdownDescription: "Kubernetes release the image carries, such as `v1.36.3`: " +
							"`data.berth_image.<name>.components[\"kubernetes\"]`. Bound to the image's PCRs, it tells the " +
							"join services a joining node's release, which they hold to the version skew policy: a node " +
							"newer than an API server waits until the control plane runs its minor; a control-plane node " +
							"older than the control plane, or a worker more than three minors older, is refused. Unset, " +
							"nodes of the image are not checked."},
				}},
			},
			"policy_yaml": schema.StringAttribute{Computed: true, MarkdownDescription: "The policy as the join services read it."},
			"cluster_id": schema.StringAttribute{Optional: true, Computed: true,
				MarkdownDescription: "The cluster the policy belongs in: `berth_cluster.<name>.cluster_id`. When set, the " +
					"policy is written only into the cluster whose record (ConfigMap `kube-system/berth-cluster`) " +
					"holds this ID, and a new cluster (a new ID) gets the policy written again. Read from the " +
					"cluster's record when not set.",
				PlanModifiers: []planmodifier.String{stringplanmodifier.UseStateForUnknown(), stringplanmodifier.RequiresReplace()}},
		},
	}
}

func (r *joinPolicyResource) Configure(_ context.Context, req resource.ConfigureRequest, resp *resource.ConfigureResponse) {
	if data, ok := req.ProviderData.(*providerData); ok {
		r.kube, r.kubeUnknown = data.kube, data.kubeUnknown
	}
}

func (r *joinPolicyResource) ValidateConfig(ctx context.Context, req resource.ValidateConfigRequest, resp *resource.ValidateConfigResponse) {
	var m joinPolicyModel
	resp.Diagnostics.Append(req.Config.Get(ctx, &m)...)
	if resp.Diagnostics.HasError() || m.Images.IsUnknown() {
		return
	}
	_, diags := m.policy(ctx, time.Now())
	resp.Diagnostics.Append(diags...)
}

// ModifyPlan refuses at plan a policy that the apply could not write: without the provider's kubeconfig
// there is no cluster to write it into. A kubeconfig not known yet (from a berth_cluster this run creates)
// is looked at when it is.
func (r *joinPolicyResource) ModifyPlan(_ context.Context, _ resource.ModifyPlanRequest, resp *resource.ModifyPlanResponse) {
	if r.kube == nil && !r.kubeUnknown {
		addNoKubeconfig(&resp.Diagnostics)
	}
}

// addNoKubeconfig says what berth_join_policy needs when the provider has no kubeconfig.
func addNoKubeconfig(diags *diag.Diagnostics) {
	diags.AddError("No cluster to write the join policy into",
		"berth_join_policy writes into the cluster through the provider's kubeconfig, and the provider has none. "+
			"Set it to the admin kubeconfig's content, for example `provider \"berth\" { kubeconfig = "+
			"berth_cluster.<name>.kubeconfig }`, or `file(\"admin.conf\")` for a cluster made elsewhere.")
}

// policy builds the join policy of the model. Every known field of every image is checked in one pass, each
// error on its attribute and naming the image and the value, so that one plan lists every mistake. Values
// not known yet (an image's PCRs from a data source of this run) are checked at apply; the policy is nil
// unless every value is known and valid. An image that expired before now is a warning: the join services
// refuse it, so keeping it is harmless, but it is most likely a policy that was meant to admit it.
func (m joinPolicyModel) policy(ctx context.Context, now time.Time) (*policy.Policy, diag.Diagnostics) {
	var diags diag.Diagnostics
	var objs []types.Object
	diags.Append(m.Images.ElementsAs(ctx, &objs, false)...)
	if diags.HasError() {
		return nil, diags
	}
	if len(objs) > policy.MaxImages {
		diags.AddAttributeError(path.Root("images"), "Too many images",
			fmt.Sprintf("images lists %d images, more than the join policy's limit of %d.", len(objs), policy.MaxImages))
	}
	p := &policy.Policy{Images: make([]policy.Image, 0, len(objs))}
	complete := true
	names := map[string]int{}
	for i, obj := range objs {
		if !known(obj) {
			complete = false
			continue
		}
		var im joinPolicyImage
		// Only this conversion's failure ends the pass: earlier images' errors must not hide later ones'.
		d := obj.As(ctx, &im, basetypes.ObjectAsOptions{})
		if diags.Append(d...); d.HasError() {
			return nil, diags
		}
		img, ok := im.check(ctx, i, names, now, &diags)
		complete = complete && ok
		p.Images = append(p.Images, img)
	}
	if diags.HasError() || !complete {
		return nil, diags
	}
	// The checks above are the policy's rules field by field; Validate, which the join services apply to
	// what they read, has the last word.
	if err := p.Validate(); err != nil {
		diags.AddAttributeError(path.Root("images"), "Invalid join policy", err.Error())
		return nil, diags
	}
	return p, diags
}

// check checks each known field of images[i] on its own attribute, and returns the image with whatever it
// could take in; ok is false when a field is not known yet. names holds the index of each name seen so far,
// to name both images of a duplicate.
func (im joinPolicyImage) check(ctx context.Context, i int, names map[string]int, now time.Time, diags *diag.Diagnostics) (img policy.Image, ok bool) {
	at := path.Root("images").AtListIndex(i)
	// who names the image in messages: by its name where that is known, and always by its place.
	who := fmt.Sprintf("images[%d]", i)
	if known(im.Name) {
		name := im.Name.ValueString()
		who = fmt.Sprintf("Image %q (images[%d])", name, i)
		img.Name = name
		if err := imageNameError(name); err != nil {
			diags.AddAttributeError(at.AtName("name"), "Invalid image name",
				fmt.Sprintf("images[%d].name is %q: %s.", i, name, err))
		} else if prev, dup := names[name]; dup {
			diags.AddAttributeError(at.AtName("name"), "Duplicate image name",
				fmt.Sprintf("images[%d] and images[%d] are both named %q: each image of a join policy needs its own name.", prev, i, name))
		} else {
			names[name] = i
		}
	}
	if known(im.Roles) {
		var roles []string
		diags.Append(im.Roles.ElementsAs(ctx, &roles, false)...)
		if len(roles) == 0 {
			diags.AddAttributeError(at.AtName("roles"), "No roles",
				fmt.Sprintf("%s has no roles: list %q, %q or both.", who, metadata.RoleControlPlane, metadata.RoleWorker))
		}
		for _, r := range roles {
			if role := metadata.Role(r); role.Valid() {
				img.Roles = append(img.Roles, role)
				continue
			}
			diags.AddAttributeError(at.AtName("roles"), "Invalid role",
				fmt.Sprintf("%s: role %q is not %q or %q.", who, r, metadata.RoleControlPlane, metadata.RoleWorker))
		}
		slices.Sort(img.Roles)
	}
	if known(im.PCRs) {
		img.PCRs = pcrValues(ctx, im.PCRs, at.AtName("pcrs"), who, diags)
		if len(im.PCRs.Elements()) == 0 {
			diags.AddAttributeError(at.AtName("pcrs"), "No measurements",
				who+" has no pcrs: an image without measurements would let any machine join.")
		}
	}
	if known(im.Expires) {
		img.Expires = checkExpires(im.Expires.ValueString(), at.AtName("expires"), who, now, diags)
	}
	if known(im.KubernetesVersion) {
		img.KubernetesVersion = im.KubernetesVersion.ValueString()
		if detail := kubernetesVersionError(img.KubernetesVersion); detail != "" {
			diags.AddAttributeError(at.AtName("kubernetes_version"), "Invalid Kubernetes version", who+": "+detail)
		}
	}
	return img, !im.Name.IsUnknown() && !im.Roles.IsUnknown() && !im.PCRs.IsUnknown() && !im.Expires.IsUnknown() &&
		!im.KubernetesVersion.IsUnknown()
}

// checkExpires parses an image's expiry, an RFC 3339 time in UTC; one already past is a warning.
func checkExpires(text string, at path.Path, who string, now time.Time, diags *diag.Diagnostics) *time.Time {
	t, err := time.Parse(time.RFC3339, text)
	if err != nil || !strings.HasSuffix(text, "Z") {
		diags.AddAttributeError(at, "Invalid expiry",
			fmt.Sprintf("%s: expires is %q, which is not an RFC 3339 time in UTC such as 2026-12-31T00:00:00Z.", who, text))
		return nil
	}
	if !t.After(now) {
		diags.AddAttributeWarning(at, "Image already expired",
			fmt.Sprintf("%s expired at %s: the join services refuse every node of it. Remove the image from "+
				"images, or give it a later expires if its nodes should still join.", who, text))
	}
	return &t
}

// imageNameError is the join policy's verdict on an image name alone: the name's in a policy whose only
// image has valid placeholders for its other fields, without the "join policy image 0" it is wrapped in.
func imageNameError(name string) error {
	probe := policy.Policy{Images: []policy.Image{{Name: name, Roles: []metadata.Role{metadata.RoleWorker},
		PCRs: map[int][]byte{0: make([]byte, sha256.Size)}}}}
	if err := probe.Validate(); err != nil {
		return cmp.Or(errors.Unwrap(err), err)
	}
	return nil
}

func (r *joinPolicyResource) client(diags *diag.Diagnostics) kubernetes.Interface {
	if r.kube == nil {
		addNoKubeconfig(diags)
	}
	return r.kube
}

func (r *joinPolicyResource) Create(ctx context.Context, req resource.CreateRequest, resp *resource.CreateResponse) {
	r.write(ctx, req.Plan, &resp.State, &resp.Diagnostics, func(cms corev1client.ConfigMapInterface, name, data string) error {
		cm := &corev1.ConfigMap{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: policyNamespace,
				Labels: map[string]string{"app.kubernetes.io/managed-by": "terraform-provider-berth"}},
			Data: map[string]string{policy.ConfigMapKey: data},
		}
		_, err := cms.Create(ctx, cm, metav1.CreateOptions{})
		if apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("ConfigMap %s/%s exists (the init request may have published one). Import it: terraform import berth_join_policy.<name> %s",
				policyNamespace, name, name)
		}
		return err
	})
}

// write renders the planned policy, stores it in the cluster with store and records it in state.
func (r *joinPolicyResource) write(ctx context.Context, plan tfsdk.Plan, state *tfsdk.State, diags *diag.Diagnostics,
	store func(cms corev1client.ConfigMapInterface, name, data string) error) {
	var m joinPolicyModel
	diags.Append(plan.Get(ctx, &m)...)
	kube := r.client(diags)
	if diags.HasError() {
		return
	}
	data, d := m.render(ctx)
	diags.Append(d...)
	if diags.HasError() {
		return
	}
	id, err := clusterID(ctx, kube)
	if err != nil {
		diags.AddError("Reading the cluster's record", err.Error())
		return
	}
	if want := m.ClusterID.ValueString(); known(m.ClusterID) && want != id.ValueString() {
		diags.AddAttributeError(path.Root("cluster_id"), "The kubeconfig reaches another cluster",
			fmt.Sprintf("The policy belongs in cluster %s, but the provider's kubeconfig reaches %s; nothing was written.",
				want, cmp.Or(id.ValueString(), "a cluster without a Berth record")))
		return
	}
	m.ClusterID = id
	if err := store(kube.CoreV1().ConfigMaps(policyNamespace), m.Name.ValueString(), data); err != nil {
		diags.AddError("Writing the join policy", err.Error())
		return
	}
	m.ID = types.StringValue(policyNamespace + "/" + m.Name.ValueString())
	m.YAML = types.StringValue(data)
	diags.Append(state.Set(ctx, &m)...)
}

// render is the policy's YAML, as the join services parse it. Its diagnostics are only errors: the plan
// showed the warnings.
func (m joinPolicyModel) render(ctx context.Context) (string, diag.Diagnostics) {
	p, all := m.policy(ctx, time.Now())
	diags := all.Errors()
	if diags.HasError() {
		return "", diags
	}
	data, err := p.Marshal()
	if err != nil {
		diags.AddError("Rendering the join policy", err.Error())
	}
	return string(data), diags
}

func (r *joinPolicyResource) Read(ctx context.Context, req resource.ReadRequest, resp *resource.ReadResponse) {
	var m joinPolicyModel
	resp.Diagnostics.Append(req.State.Get(ctx, &m)...)
	// The cluster is being created (or made again) in this run: there is nothing to read yet, and the
	// policy is written into the new cluster when its berth_cluster replacement triggers this one's.
	if r.kubeUnknown {
		return
	}
	kube := r.client(&resp.Diagnostics)
	if resp.Diagnostics.HasError() {
		return
	}
	cm, err := kube.CoreV1().ConfigMaps(policyNamespace).Get(ctx, m.Name.ValueString(), metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		resp.State.RemoveResource(ctx)
		return
	}
	if err != nil {
		resp.Diagnostics.AddError("Reading the join policy", err.Error())
		return
	}
	p, err := policy.Parse([]byte(cm.Data[policy.ConfigMapKey]))
	if err != nil {
		resp.Diagnostics.AddError("The join policy in the cluster does not parse",
			fmt.Sprintf("ConfigMap %s/%s: %v. Apply to replace it.", policyNamespace, cm.Name, err))
		return
	}
	images, diags := imagesValue(p)
	resp.Diagnostics.Append(diags...)
	m.Images = images
	if m.ClusterID, err = clusterID(ctx, kube); err != nil {
		resp.Diagnostics.AddError("Reading the cluster's record", err.Error())
		return
	}
	m.ID = types.StringValue(policyNamespace + "/" + cm.Name)
	m.YAML = types.StringValue(cm.Data[policy.ConfigMapKey])
	resp.Diagnostics.Append(resp.State.Set(ctx, &m)...)
}

// clusterID is the ID in the cluster's Berth record; null for a cluster without one.
func clusterID(ctx context.Context, kube kubernetes.Interface) (types.String, error) {
	info, err := clusterinfo.Read(ctx, kube)
	if errors.Is(err, clusterinfo.ErrNotFound) {
		return types.StringNull(), nil
	}
	if err != nil {
		return types.StringNull(), err
	}
	return types.StringValue(info.ID), nil
}

// imagesValue is the Terraform value of a policy read from the cluster, for drift detection.
func imagesValue(p *policy.Policy) (types.List, diag.Diagnostics) {
	var diags diag.Diagnostics
	objType := types.ObjectType{AttrTypes: imageAttrTypes}
	elems := make([]attr.Value, 0, len(p.Images))
	for _, img := range p.Images {
		roles := make([]attr.Value, len(img.Roles))
		for i, r := range img.Roles {
			roles[i] = types.StringValue(string(r))
		}
		pcrs := map[string]attr.Value{}
		for idx, v := range img.PCRs {
			pcrs[strconv.Itoa(idx)] = types.StringValue(hex.EncodeToString(v))
		}
		expires := types.StringNull()
		if img.Expires != nil {
			expires = types.StringValue(img.Expires.UTC().Format(time.RFC3339))
		}
		rolesSet, d := types.SetValue(types.StringType, roles)
		diags.Append(d...)
		pcrMap, d := types.MapValue(types.StringType, pcrs)
		diags.Append(d...)
		version := types.StringNull()
		if img.KubernetesVersion != "" {
			version = types.StringValue(img.KubernetesVersion)
		}
		obj, d := types.ObjectValue(imageAttrTypes, map[string]attr.Value{
			"name": types.StringValue(img.Name), "roles": rolesSet, "pcrs": pcrMap, "expires": expires,
			"kubernetes_version": version,
		})
		diags.Append(d...)
		elems = append(elems, obj)
	}
	list, d := types.ListValue(objType, elems)
	diags.Append(d...)
	return list, diags
}

func (r *joinPolicyResource) Update(ctx context.Context, req resource.UpdateRequest, resp *resource.UpdateResponse) {
	r.write(ctx, req.Plan, &resp.State, &resp.Diagnostics, func(cms corev1client.ConfigMapInterface, name, data string) error {
		cm, err := cms.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		cm.Data = map[string]string{policy.ConfigMapKey: data}
		_, err = cms.Update(ctx, cm, metav1.UpdateOptions{})
		return err
	})
}

func (r *joinPolicyResource) Delete(ctx context.Context, req resource.DeleteRequest, resp *resource.DeleteResponse) {
	var m joinPolicyModel
	resp.Diagnostics.Append(req.State.Get(ctx, &m)...)
	kube := r.client(&resp.Diagnostics)
	if resp.Diagnostics.HasError() {
		return
	}
	err := kube.CoreV1().ConfigMaps(policyNamespace).Delete(ctx, m.Name.ValueString(), metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		resp.Diagnostics.AddError("Deleting the join policy", err.Error())
		return
	}
	resp.Diagnostics.AddWarning("No node can join now",
		"The join policy is gone: the join services keep an empty policy until a new one is written.")
}

// ImportState takes the ConfigMap's name, or kube-system/<name>.
func (r *joinPolicyResource) ImportState(ctx context.Context, req resource.ImportStateRequest, resp *resource.ImportStateResponse) {
	name := strings.TrimPrefix(req.ID, policyNamespace+"/")
	if name == "" || strings.Contains(name, "/") {
		resp.Diagnostics.AddError("Invalid import ID", fmt.Sprintf("Want the ConfigMap's name (berth-join-policy) or %s/<name>, got %q.", policyNamespace, req.ID))
		return
	}
	resp.Diagnostics.Append(resp.State.SetAttribute(ctx, path.Root("name"), name)...)
	resp.Diagnostics.Append(resp.State.SetAttribute(ctx, path.Root("id"), policyNamespace+"/"+name)...)
}
