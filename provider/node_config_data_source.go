package provider

import (
	"context"
	"fmt"
	"maps"

	"github.com/hashicorp/terraform-plugin-framework/datasource"
	"github.com/hashicorp/terraform-plugin-framework/datasource/schema"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/types"

	"github.com/berthlabs/berth/internal/cloudinit"
	"github.com/berthlabs/berth/internal/clustername"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/provider/internal/platform"
)

const defaultJoinPort = 7450

var (
	_ datasource.DataSource                   = (*nodeConfigDataSource)(nil)
	_ datasource.DataSourceWithValidateConfig = (*nodeConfigDataSource)(nil)
)

// nodeConfigDataSource is berth_node_config: the user-data a launch template or PXE profile gives its nodes.
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
	Hostname       types.String `tfsdk:"hostname"`
	Role           types.String `tfsdk:"role"`
	platform.Groups
	BareMetal types.Bool   `tfsdk:"bare_metal"`
	JSON      types.String `tfsdk:"json"`
	CloudInit types.String `tfsdk:"cloud_init"`
	SizeBytes types.Int64  `tfsdk:"size_bytes"`
}

func (d *nodeConfigDataSource) Metadata(_ context.Context, req datasource.MetadataRequest, resp *datasource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_node_config"
}

func (d *nodeConfigDataSource) Schema(_ context.Context, _ datasource.SchemaRequest, resp *datasource.SchemaResponse) {
	resp.Schema = schema.Schema{
		MarkdownDescription: "Renders the user-data a launch template, autoscaling group or instance template " +
			"gives its Berth nodes: the cluster name, where the join service is, and the pin of the join CA. It " +
			"holds nothing secret.\n\n" +
			"**Google Compute Engine.** The instance template sets the metadata key `berth-node-config` to " +
			"`json`; berth-agent reads it from the metadata server, so `cloud_init` is not used there.\n\n" +
			"**Bare-metal nodes.** Machines without an instance-metadata service, bare-metal or PXE-booted, can " +
			"join as workers a cluster whose control plane runs elsewhere, through a standalone Berth join " +
			"service: set `bare_metal = true` for them. Such a node reads its user-data from the file " +
			"`cloud_init` writes, so its image must set `userDataFile: " + cloudinit.UserDataPath + "` in berth-agent's " +
			"`agent.yaml` and have cloud-init apply `cloud_init` (for example NoCloud with a seed URL on the PXE " +
			"kernel command line). It finds the join service only through `join_endpoints`. It takes its " +
			"Kubernetes node name from its hostname and its address from its network interface; the join " +
			"service finds the node's record in its own inventory by that address and refuses the node when its " +
			"hostname differs from the recorded name. So give each machine its inventory name: one data source " +
			"per machine with `hostname` set (for example `for_each` over the inventory, one PXE profile each), " +
			"unless the machines get their names another way.\n\n" +
			fmt.Sprintf("Fails when the cloud-init document is larger than %d bytes (16 KiB, AWS EC2's limit).", cloudinit.MaxSize),
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
				Optional: true,
				Computed: true,
				MarkdownDescription: fmt.Sprintf("Port of the join service on control-plane nodes. Default %d. ", defaultJoinPort) +
					"Bare-metal nodes do not use it: each `join_endpoints` entry names its own port.",
			},
			"join_endpoints": schema.ListAttribute{
				Optional:    true,
				ElementType: types.StringType,
				MarkdownDescription: "`host:port` of load balancers in front of the join service, tried before the " +
					"control-plane nodes themselves. Required when `bare_metal` is true: then they are the only way " +
					"to the join service. A load balancer here must pass the nodes' own source addresses on (a " +
					"network load balancer, not a proxy): the join service finds a node's instance record by the " +
					"address it connects from, and refuses a node whose record has another name.",
			},
			"init_secret_hash": schema.StringAttribute{
				Optional: true,
				MarkdownDescription: "`berth_secrets.<name>.init_secret_hash`. Set it only in the user-data of the " +
					"first control-plane node, the one that initializes the cluster. Must be unset when `bare_metal` " +
					"is true.",
			},
			"bare_metal": schema.BoolAttribute{
				Optional: true,
				Computed: true,
				MarkdownDescription: "`true` for nodes without an instance-metadata service (see above); their image " +
					"must set `userDataFile: " + cloudinit.UserDataPath + "` in `agent.yaml`. Requires `join_endpoints` and " +
					"refuses `init_secret_hash`: such nodes are workers of an external control plane and never " +
					"initialize a cluster. It does not change `json`: `agent.yaml`, not the user-data, tells the agent " +
					"there is no metadata service. Default `false`.",
			},
			"hostname": schema.StringAttribute{
				Optional: true,
				MarkdownDescription: "Hostname to give the machine. `cloud_init` then also sets cloud-init's " +
					"`hostname` and `fqdn` both to this value, and `preserve_hostname: false`: the hostname is exactly " +
					"this value on every distribution (given `hostname` alone, cloud-init sets the datasource's FQDN " +
					"on the Red Hat family and only the first label of a dotted name on Debian and Ubuntu), and a " +
					"`preserve_hostname: true` in the image's `cloud.cfg` cannot keep the old name. Meant for " +
					"`bare_metal` nodes, set to the machine's name in the join service's inventory; cloud nodes take " +
					"their name from the instance metadata. " +
					fmt.Sprintf("A Kubernetes node name (a lowercase DNS-1123 subdomain) of at most %d characters, the "+
						"longest hostname Linux takes. It does not change `json`.", cloudinit.MaxHostname),
			},
			"role": schema.StringAttribute{
				Optional: true,
				MarkdownDescription: "`control-plane` or `worker`: the role of the nodes this user-data launches, for " +
					"clouds whose instance metadata has no Berth role (AWS EC2: one launch template per role; Google " +
					"Compute Engine: one instance template per role). The node states it; the join service grants it " +
					"only when its own record of the instance says the same (on AWS, the role configured for the " +
					"instance's autoscaling group in `autoscaling_groups`; on Compute Engine, for its managed instance " +
					"group in `instance_groups`). Unset means worker, and it is left out of `json`. `control-plane` " +
					"is refused when `bare_metal` is true.",
			},
			"json": schema.StringAttribute{
				Computed: true,
				MarkdownDescription: "The user-data as JSON, the form berth-agent reads; on Compute Engine, the value " +
					"of the instance template's metadata key `berth-node-config`.",
			},
			"cloud_init": schema.StringAttribute{
				Computed: true,
				MarkdownDescription: "A `#cloud-config` document that writes `json` to `" + cloudinit.UserDataPath + "` (mode " +
					"0644), and sets the hostname when `hostname` is set; give it to the instance as user-data.",
			},
			"size_bytes": schema.Int64Attribute{
				Computed:            true,
				MarkdownDescription: "Size of `cloud_init` in bytes.",
			},
		},
	}
	maps.Copy(resp.Schema.Attributes, platform.GroupAttributes())
}

// ValidateConfig refuses what cannot work before anything is read. Terraform validates again with every value
// known before it reads the data source, so values unknown here are checked then.
func (d *nodeConfigDataSource) ValidateConfig(ctx context.Context, req datasource.ValidateConfigRequest, resp *datasource.ValidateConfigResponse) {
	var hostname, initSecretHash, role, clusterName, pin types.String
	var bareMetal types.Bool
	var joinPort types.Int64
	var endpoints types.List
	resp.Diagnostics.Append(req.Config.GetAttribute(ctx, path.Root("hostname"), &hostname)...)
	resp.Diagnostics.Append(req.Config.GetAttribute(ctx, path.Root("role"), &role)...)
	resp.Diagnostics.Append(req.Config.GetAttribute(ctx, path.Root("init_secret_hash"), &initSecretHash)...)
	resp.Diagnostics.Append(req.Config.GetAttribute(ctx, path.Root("bare_metal"), &bareMetal)...)
	resp.Diagnostics.Append(req.Config.GetAttribute(ctx, path.Root("join_endpoints"), &endpoints)...)
	resp.Diagnostics.Append(req.Config.GetAttribute(ctx, path.Root("cluster_name"), &clusterName)...)
	resp.Diagnostics.Append(req.Config.GetAttribute(ctx, path.Root("join_ca_pin"), &pin)...)
	resp.Diagnostics.Append(req.Config.GetAttribute(ctx, path.Root("join_port"), &joinPort)...)
	if resp.Diagnostics.HasError() {
		return
	}
	// Each value that Read's rendering would refuse, on its own attribute and all at once.
	if known(clusterName) {
		if err := clustername.Validate(clusterName.ValueString()); err != nil {
			resp.Diagnostics.AddAttributeError(path.Root("cluster_name"), "Invalid cluster name", err.Error())
		}
	}
	if known(pin) {
		if err := metadata.ValidatePin(pin.ValueString()); err != nil {
			resp.Diagnostics.AddAttributeError(path.Root("join_ca_pin"), "Invalid join CA pin",
				err.Error()+": use berth_secrets' join_ca_pin.")
		}
	}
	if known(joinPort) {
		if p := joinPort.ValueInt64(); p < 1 || p > 65535 {
			resp.Diagnostics.AddAttributeError(path.Root("join_port"), "Invalid join port",
				fmt.Sprintf("join_port is %d, want 1 to 65535.", p))
		}
	}
	if known(initSecretHash) {
		if err := metadata.ValidateArgon2idPHC(initSecretHash.ValueString()); err != nil {
			resp.Diagnostics.AddAttributeError(path.Root("init_secret_hash"), "Invalid init secret hash",
				err.Error()+": use berth_secrets' init_secret_hash.")
		}
	}
	if known(endpoints) {
		seen := map[string]bool{}
		for i, e := range endpoints.Elements() {
			ep, ok := e.(types.String)
			if !ok || !known(ep) {
				continue
			}
			at := path.Root("join_endpoints").AtListIndex(i)
			if err := metadata.ValidateEndpoint(ep.ValueString()); err != nil {
				resp.Diagnostics.AddAttributeError(at, "Invalid join endpoint", err.Error())
			} else if seen[ep.ValueString()] {
				resp.Diagnostics.AddAttributeError(at, "Join endpoint listed twice",
					fmt.Sprintf("join endpoint %q is listed twice.", ep.ValueString()))
			}
			seen[ep.ValueString()] = true
		}
	}
	if known(hostname) {
		if err := cloudinit.ValidateHostname(hostname.ValueString()); err != nil {
			resp.Diagnostics.AddAttributeError(path.Root("hostname"), "Invalid hostname", err.Error())
		}
	}
	if known(role) && !metadata.Role(role.ValueString()).Valid() {
		resp.Diagnostics.AddAttributeError(path.Root("role"), "Invalid role",
			fmt.Sprintf("role is %q, want %q or %q.", role.ValueString(), metadata.RoleControlPlane, metadata.RoleWorker))
	}
	platform.ValidateGroups(ctx, req.Config, &resp.Diagnostics)
	if !bareMetal.ValueBool() {
		return
	}
	if known(role) && metadata.Role(role.ValueString()) == metadata.RoleControlPlane {
		resp.Diagnostics.AddAttributeError(path.Root("role"), "Control-plane role on bare-metal nodes",
			"role must not be control-plane when bare_metal is true: bare-metal nodes join as workers of a "+
				"control plane that runs elsewhere.")
	}
	if !endpoints.IsUnknown() && len(endpoints.Elements()) == 0 {
		resp.Diagnostics.AddAttributeError(path.Root("join_endpoints"), "Missing join endpoints",
			"bare-metal nodes find the join service only through join_endpoints: no instance metadata lists "+
				"control-plane nodes for them. List host:port of the standalone join service, or of a load "+
				"balancer in front of it.")
	}
	if known(initSecretHash) {
		resp.Diagnostics.AddAttributeError(path.Root("init_secret_hash"), "Init secret hash on bare-metal nodes",
			"init_secret_hash must be unset when bare_metal is true: bare-metal nodes join as workers of a "+
				"control plane that runs elsewhere and never initialize a cluster.")
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
	if m.BareMetal.IsNull() {
		m.BareMetal = types.BoolValue(false)
	}
	// ValidateConfig refused it already; the conversion below must never wrap.
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
		Role:           metadata.Role(m.Role.ValueString()),
	}
	m.Groups.Apply(&u)
	doc, cloudInit, err := cloudinit.Render(u, m.Hostname.ValueString())
	if err != nil {
		resp.Diagnostics.AddError("Invalid node configuration", err.Error())
		return
	}
	m.JSON = types.StringValue(doc)
	m.CloudInit = types.StringValue(cloudInit)
	m.SizeBytes = types.Int64Value(int64(len(cloudInit)))
	resp.Diagnostics.Append(resp.State.Set(ctx, &m)...)
}
