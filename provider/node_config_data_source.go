package provider

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/hashicorp/terraform-plugin-framework/datasource"
	"github.com/hashicorp/terraform-plugin-framework/datasource/schema"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"sigs.k8s.io/yaml"

	"github.com/berthlabs/berth/internal/metadata"
)

const (
	defaultJoinPort = 7450
	// maxUserData is AWS EC2's limit on user-data before base64 encoding, the smallest of the clouds'.
	maxUserData = 16 * 1024
	// userDataPath is where cloud-init writes the user-data for berth-agent.
	userDataPath = "/etc/berth/user-data.json"
)

var _ datasource.DataSource = (*nodeConfigDataSource)(nil)

// nodeConfigDataSource is berth_node_config: the user-data a launch template gives its nodes.
type nodeConfigDataSource struct{}

func newNodeConfigDataSource() datasource.DataSource {
	return &nodeConfigDataSource{}
}

type nodeConfigModel struct {
	ClusterName    types.String `tfsdk:"cluster_name"`
	JoinCAPin      types.String `tfsdk:"join_ca_pin"`
	JoinPort       types.Int64  `tfsdk:"join_port"`
	JoinEndpoints  []string     `tfsdk:"join_endpoints"`
	InitSecretHash types.String `tfsdk:"init_secret_hash"`
	JSON           types.String `tfsdk:"json"`
	CloudInit      types.String `tfsdk:"cloud_init"`
	SizeBytes      types.Int64  `tfsdk:"size_bytes"`
}

func (d *nodeConfigDataSource) Metadata(_ context.Context, req datasource.MetadataRequest, resp *datasource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_node_config"
}

func (d *nodeConfigDataSource) Schema(_ context.Context, _ datasource.SchemaRequest, resp *datasource.SchemaResponse) {
	resp.Schema = schema.Schema{
		MarkdownDescription: "Renders the user-data a launch template or autoscaling group gives its Berth nodes: " +
			"the cluster name, where the join service is, and the pin of the join CA. It holds nothing secret.\n\n" +
			fmt.Sprintf("Fails when the cloud-init document is larger than %d bytes (16 KiB, AWS EC2's limit).", maxUserData),
		Attributes: map[string]schema.Attribute{
			"cluster_name": schema.StringAttribute{
				Required:            true,
				MarkdownDescription: "Name of the cluster, a DNS-1123 label.",
			},
			"join_ca_pin": schema.StringAttribute{
				Required:            true,
				MarkdownDescription: "SPKI pin of the join CA, `berth_secrets.<name>.join_ca_pin`.",
			},
			"join_port": schema.Int64Attribute{
				Optional:            true,
				Computed:            true,
				MarkdownDescription: fmt.Sprintf("Port of the join service on control-plane nodes. Default %d.", defaultJoinPort),
			},
			"join_endpoints": schema.ListAttribute{
				Optional:    true,
				ElementType: types.StringType,
				MarkdownDescription: "`host:port` of load balancers in front of the join service, tried before the " +
					"control-plane nodes themselves.",
			},
			"init_secret_hash": schema.StringAttribute{
				Optional: true,
				MarkdownDescription: "`berth_secrets.<name>.init_secret_hash`. Set it only in the user-data of the " +
					"first control-plane node, the one that initializes the cluster.",
			},
			"json": schema.StringAttribute{
				Computed:            true,
				MarkdownDescription: "The user-data as JSON, the form berth-agent reads.",
			},
			"cloud_init": schema.StringAttribute{
				Computed: true,
				MarkdownDescription: "A `#cloud-config` document that writes `json` to `" + userDataPath + "` (mode " +
					"0644); give it to the instance as user-data.",
			},
			"size_bytes": schema.Int64Attribute{
				Computed:            true,
				MarkdownDescription: "Size of `cloud_init` in bytes.",
			},
		},
	}
}

func (d *nodeConfigDataSource) Read(ctx context.Context, req datasource.ReadRequest, resp *datasource.ReadResponse) {
	var m nodeConfigModel
	resp.Diagnostics.Append(req.Config.Get(ctx, &m)...)
	if resp.Diagnostics.HasError() {
		return
	}
	if m.JoinPort.IsNull() {
		m.JoinPort = types.Int64Value(defaultJoinPort)
	}
	if p := m.JoinPort.ValueInt64(); p < 1 || p > 65535 {
		resp.Diagnostics.AddAttributeError(path.Root("join_port"), "Invalid join port",
			fmt.Sprintf("join_port is %d, want 1 to 65535.", p))
		return
	}
	u := metadata.UserData{
		ClusterName:    m.ClusterName.ValueString(),
		JoinEndpoints:  m.JoinEndpoints,
		JoinPort:       uint16(m.JoinPort.ValueInt64()),
		JoinCAPin:      m.JoinCAPin.ValueString(),
		InitSecretHash: m.InitSecretHash.ValueString(),
	}
	doc, cloudInit, err := renderUserData(u)
	if err != nil {
		resp.Diagnostics.AddError("Invalid node configuration", err.Error())
		return
	}
	m.JSON = types.StringValue(doc)
	m.CloudInit = types.StringValue(cloudInit)
	m.SizeBytes = types.Int64Value(int64(len(cloudInit)))
	resp.Diagnostics.Append(resp.State.Set(ctx, &m)...)
}

// cloudConfig is the part of cloud-init's #cloud-config that Berth uses.
type cloudConfig struct {
	WriteFiles []writeFile `json:"write_files"`
}

type writeFile struct {
	Path        string `json:"path"`
	Content     string `json:"content"`
	Owner       string `json:"owner"`
	Permissions string `json:"permissions"`
}

// renderUserData returns the user-data as JSON and as a #cloud-config document that writes that JSON to
// userDataPath. The document is marshalled, not templated, so no value can break out of its YAML string.
func renderUserData(u metadata.UserData) (doc, cloudInit string, err error) {
	if err := u.Validate(); err != nil {
		return "", "", err
	}
	data, err := json.Marshal(u)
	if err != nil {
		return "", "", fmt.Errorf("encoding user-data: %w", err)
	}
	body, err := yaml.Marshal(cloudConfig{WriteFiles: []writeFile{{
		Path: userDataPath, Content: string(data), Owner: "root:root", Permissions: "0644",
	}}})
	if err != nil {
		return "", "", fmt.Errorf("encoding cloud-init document: %w", err)
	}
	cloudInit = "#cloud-config\n" + string(body)
	if len(cloudInit) > maxUserData {
		return "", "", fmt.Errorf("the cloud-init user-data is %d bytes, more than the %d bytes (16 KiB) AWS EC2 "+
			"accepts; list fewer join_endpoints", len(cloudInit), maxUserData)
	}
	return string(data), cloudInit, nil
}
