package provider

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"strings"

	"github.com/hashicorp/terraform-plugin-framework/datasource"
	"github.com/hashicorp/terraform-plugin-framework/datasource/schema"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/types"

	"github.com/berthlabs/berth/internal/manifest"
)

var _ datasource.DataSource = (*imageDataSource)(nil)

// imageDataSource is berth_image: the images of a Packer build and their predicted PCR values.
type imageDataSource struct{}

func newImageDataSource() datasource.DataSource {
	return &imageDataSource{}
}

type imageDataSourceModel struct {
	Path   types.String `tfsdk:"path"`
	Name   types.String `tfsdk:"name"`
	Images []imageModel `tfsdk:"images"`
	PCRs   types.Map    `tfsdk:"pcrs"`
	// Components of the image called Name.
	Components types.Map `tfsdk:"components"`
}

type imageModel struct {
	Name       types.String `tfsdk:"name"`
	Builder    types.String `tfsdk:"builder"`
	ArtifactID types.String `tfsdk:"artifact_id"`
	Region     types.String `tfsdk:"region"`
	PCRs       types.Map    `tfsdk:"pcrs"`
	Components types.Map    `tfsdk:"components"`
}

func (d *imageDataSource) Metadata(_ context.Context, req datasource.MetadataRequest, resp *datasource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_image"
}

func (d *imageDataSource) Schema(_ context.Context, _ datasource.SchemaRequest, resp *datasource.SchemaResponse) {
	stringMap := func(desc string) schema.MapAttribute {
		return schema.MapAttribute{Computed: true, ElementType: types.StringType, MarkdownDescription: desc}
	}
	computed := func(desc string) schema.StringAttribute {
		return schema.StringAttribute{Computed: true, MarkdownDescription: desc}
	}
	resp.Schema = schema.Schema{
		MarkdownDescription: "Reads `berth-image.json`, the manifest the Berth Packer plugin writes: the images a " +
			"build made, the PCR values predicted for each, and the versions of their components. Use an image's " +
			"`artifact_id` to launch nodes and its `pcrs` to admit it in the join policy.",
		Attributes: map[string]schema.Attribute{
			"path": schema.StringAttribute{
				Required: true,
				MarkdownDescription: "Path of the manifest file, e.g. `\"${path.module}/berth-image.json\"`, as the " +
					"post-processor `berth-manifest` of `packer build` writes it. A relative path is relative to the " +
					"directory Terraform runs in.",
			},
			"name": schema.StringAttribute{
				Optional:            true,
				MarkdownDescription: "Name of one image in the manifest; its PCR values and components are then also in `pcrs` and `components`.",
			},
			"images": schema.ListNestedAttribute{
				Computed:            true,
				MarkdownDescription: "Every image in the manifest, in manifest order.",
				NestedObject: schema.NestedAttributeObject{
					Attributes: map[string]schema.Attribute{
						"name":        computed("Image name."),
						"builder":     computed("Packer builder that made it (`qemu`, `amazon-ebs`, ...)."),
						"artifact_id": computed("What the cloud knows the image by: AMI id, GCE image, disk file."),
						"region":      computed("Region of the artifact; empty where the builder has none."),
						"pcrs":        stringMap("Predicted PCR values: PCR index (`\"4\"`) to SHA-256 in lowercase hex."),
						"components":  stringMap("Versions of the components baked in (`kubernetes`, `berth-agent`, ...)."),
					},
				},
			},
			"pcrs":       stringMap("PCR values of the image called `name`; null when `name` is not set."),
			"components": stringMap("Component versions of the image called `name` (`kubernetes`: the version `berth_cluster` initializes); null when `name` is not set."),
		},
	}
}

func (d *imageDataSource) Read(ctx context.Context, req datasource.ReadRequest, resp *datasource.ReadResponse) {
	var m imageDataSourceModel
	resp.Diagnostics.Append(req.Config.Get(ctx, &m)...)
	if resp.Diagnostics.HasError() {
		return
	}
	man, err := readManifest(m.Path.ValueString())
	if err != nil {
		resp.Diagnostics.AddAttributeError(path.Root("path"), "Cannot read the image manifest", err.Error())
		return
	}
	m.Images = make([]imageModel, len(man.Images))
	for i, img := range man.Images {
		pcrs, diags := types.MapValueFrom(ctx, types.StringType, img.PCRs)
		resp.Diagnostics.Append(diags...)
		components, diags := types.MapValueFrom(ctx, types.StringType, nonNil(img.Components))
		resp.Diagnostics.Append(diags...)
		m.Images[i] = imageModel{
			Name:       types.StringValue(img.Name),
			Builder:    types.StringValue(img.Builder),
			ArtifactID: types.StringValue(img.ArtifactID),
			Region:     types.StringValue(img.Region),
			PCRs:       pcrs,
			Components: components,
		}
	}
	m.PCRs, m.Components = types.MapNull(types.StringType), types.MapNull(types.StringType)
	if !m.Name.IsNull() {
		img, ok := man.Image(m.Name.ValueString())
		if !ok {
			resp.Diagnostics.AddAttributeError(path.Root("name"), "Image not in manifest",
				fmt.Sprintf("The manifest %s has no image named %q; it lists: %s.",
					m.Path.ValueString(), m.Name.ValueString(), strings.Join(man.Names(), ", ")))
			return
		}
		var diags diag.Diagnostics
		m.PCRs, diags = types.MapValueFrom(ctx, types.StringType, img.PCRs)
		resp.Diagnostics.Append(diags...)
		m.Components, diags = types.MapValueFrom(ctx, types.StringType, nonNil(img.Components))
		resp.Diagnostics.Append(diags...)
	}
	if resp.Diagnostics.HasError() {
		return
	}
	resp.Diagnostics.Append(resp.State.Set(ctx, &m)...)
}

// readManifest reads at most one byte more than a manifest may have, so a huge file is refused unread.
func readManifest(name string) (*manifest.Manifest, error) {
	f, err := os.Open(name)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%s does not exist. `packer build` with the Berth plugin's post-processor "+
			"berth-manifest writes it (to its `output`, %s by default): run the build first, or set path to "+
			"where it wrote the manifest", name, manifest.DefaultFile)
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, manifest.MaxSize+1))
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", name, err)
	}
	m, err := manifest.Parse(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return m, nil
}

func nonNil(m map[string]string) map[string]string {
	if m == nil {
		return map[string]string{}
	}
	return m
}
