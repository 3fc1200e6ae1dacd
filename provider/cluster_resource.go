package provider

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/planmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/stringdefault"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/stringplanmodifier"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-log/tflog"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/cloud/aws/ec2instances"
	"github.com/berthlabs/berth/internal/clusterinfo"
	"github.com/berthlabs/berth/internal/clustername"
	"github.com/berthlabs/berth/internal/initclient"
	"github.com/berthlabs/berth/internal/keys"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/rpc"
)

const (
	defaultInitTimeout = "15m"
	// progressTail is how many of kubeadm's last lines a failed init shows.
	progressTail = 30
	// probeTimeout bounds each look at a cluster during refresh.
	probeTimeout = 20 * time.Second
)

var (
	_ resource.Resource                   = (*clusterResource)(nil)
	_ resource.ResourceWithValidateConfig = (*clusterResource)(nil)
	_ resource.ResourceWithImportState    = (*clusterResource)(nil)
)

// clusterResource is berth_cluster: the attested init of a cluster's first control-plane node.
type clusterResource struct{}

func newClusterResource() resource.Resource { return &clusterResource{} }

type clusterModel struct {
	Endpoint                types.String     `tfsdk:"endpoint"`
	ClusterName             types.String     `tfsdk:"cluster_name"`
	KubernetesVersion       types.String     `tfsdk:"kubernetes_version"`
	ControlPlaneEndpoint    types.String     `tfsdk:"control_plane_endpoint"`
	PodSubnet               types.String     `tfsdk:"pod_subnet"`
	ServiceSubnet           types.String     `tfsdk:"service_subnet"`
	PCRs                    types.Map        `tfsdk:"pcrs"`
	EKCACertificates        types.String     `tfsdk:"ek_ca_certificates"`
	AWS                     *clusterAWSModel `tfsdk:"aws"`
	KubernetesCACertificate types.String     `tfsdk:"kubernetes_ca_certificate"`
	JoinCACertificate       types.String     `tfsdk:"join_ca_certificate"`
	InitSecretWO            types.String     `tfsdk:"init_secret_wo"`
	MasterSecretWO          types.String     `tfsdk:"master_secret_wo"`
	SaltWO                  types.String     `tfsdk:"salt_wo"`
	KubernetesCAKeyWO       types.String     `tfsdk:"kubernetes_ca_key_wo"`
	JoinCAKeyWO             types.String     `tfsdk:"join_ca_key_wo"`
	InitTimeout             types.String     `tfsdk:"init_timeout"`
	ID                      types.String     `tfsdk:"id"`
	ClusterID               types.String     `tfsdk:"cluster_id"`
	APIServerEndpoint       types.String     `tfsdk:"api_server_endpoint"`
	Kubeconfig              types.String     `tfsdk:"kubeconfig"`
	ClientCertificate       types.String     `tfsdk:"client_certificate"`
	ClientKey               types.String     `tfsdk:"client_key"`
}

// clusterAWSModel names the first control-plane node's EC2 instance, whose NitroTPM EC2 vouches for.
type clusterAWSModel struct {
	InstanceID types.String `tfsdk:"instance_id"`
	Region     types.String `tfsdk:"region"`
	Endpoint   types.String `tfsdk:"endpoint"`
}

func (r *clusterResource) Metadata(_ context.Context, req resource.MetadataRequest, resp *resource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_cluster"
}

func (r *clusterResource) Schema(_ context.Context, _ resource.SchemaRequest, resp *resource.SchemaResponse) {
	replace := []planmodifier.String{stringplanmodifier.RequiresReplace()}
	keep := []planmodifier.String{stringplanmodifier.UseStateForUnknown()}
	writeOnly := func(desc string) schema.StringAttribute {
		return schema.StringAttribute{Optional: true, WriteOnly: true, Sensitive: true, MarkdownDescription: desc +
			" Write-only: sent to the node at init and never stored. Needed only when the cluster is created."}
	}
	resp.Schema = schema.Schema{
		MarkdownDescription: "Initializes a Berth cluster on its first control-plane node, which must run " +
			"berth-agent from a Berth image and have booted with user-data from `berth_node_config` " +
			"(with `init_secret_hash`).\n\n" +
			"The provider first **attests** the node over the connection it will use: the node's TPM quotes the " +
			"PCRs of `pcrs` bound to this TLS session, its endorsement key certificate must chain to " +
			"`ek_ca_certificates` (or, on AWS, its endorsement key must be the one EC2 reports for the instance " +
			"named in `aws`), every PCR must hold the value the image predicts, and the attestation key " +
			"must prove it lives in that TPM. Only then does the provider send the init request with the " +
			"cluster's secrets; the node checks the init secret and runs `kubeadm init`. A node that shows other " +
			"measurements gets nothing, and the error names the PCR, the value expected and the value got.\n\n" +
			"kubeadm's output is logged as it arrives (`TF_LOG_PROVIDER=INFO`); a failed init shows its last " +
			"lines.\n\n" +
			"On refresh the provider asks the API server for the cluster's record (ConfigMap " +
			"`kube-system/berth-cluster`). A cluster that is gone (the API server answers without the record, or " +
			"a fresh node waits for init at `endpoint`) or that is another cluster (another ID, another CA) is " +
			"removed from state, so the next apply plans a new init. An API server that does not answer is kept, " +
			"with a warning: an outage must never plan a new cluster.\n\n" +
			"Destroying the resource only removes it from state: the machines belong to the infrastructure " +
			"that made them, and that is where they are destroyed.",
		Attributes: map[string]schema.Attribute{
			"endpoint": schema.StringAttribute{
				Required: true,
				MarkdownDescription: "`host:port` of the first control-plane node's init server (berth-agent listens " +
					"on port 7451). Changing it plans a new cluster.",
				PlanModifiers: replace,
			},
			"cluster_name": schema.StringAttribute{
				Required:            true,
				MarkdownDescription: "Name of the cluster, a DNS-1123 label; the same as in `berth_node_config`.",
				PlanModifiers:       replace,
			},
			"kubernetes_version": schema.StringAttribute{
				Required: true,
				MarkdownDescription: "Kubernetes version kubeadm initializes, such as `v1.36.3`: the one baked into " +
					"the image (`data.berth_image` `components.kubernetes`).",
				PlanModifiers: replace,
			},
			"control_plane_endpoint": schema.StringAttribute{
				Optional: true,
				MarkdownDescription: "`host:port` clients and nodes reach the API server at, such as a load " +
					"balancer. Default: the node's own address, port 6443.",
				PlanModifiers: replace,
			},
			"pod_subnet": schema.StringAttribute{
				Optional:            true,
				MarkdownDescription: "CIDR of the pod network (kubeadm `networking.podSubnet`).",
				PlanModifiers:       replace,
			},
			"service_subnet": schema.StringAttribute{
				Optional:            true,
				MarkdownDescription: "CIDR of the service network (kubeadm `networking.serviceSubnet`); kubeadm's default if unset.",
				PlanModifiers:       replace,
			},
			"pcrs": schema.MapAttribute{
				Required:    true,
				ElementType: types.StringType,
				MarkdownDescription: "The measurements the node must show: PCR index (`\"11\"`) to its SHA-256 value " +
					"in lowercase hex, as `data.berth_image` gives them. Checked only at init; later nodes are " +
					"checked by the join policy (`berth_join_policy`).",
			},
			"ek_ca_certificates": schema.StringAttribute{
				Optional: true,
				MarkdownDescription: "PEM certificates of the CAs that issue the endorsement key certificates of the " +
					"nodes' TPMs (the TPM vendor's or the cloud's vTPM CA; root and intermediate certificates). " +
					"Exactly one of `ek_ca_certificates` and `aws` is set.",
			},
			"aws": schema.SingleNestedAttribute{
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
			},
			"kubernetes_ca_certificate": schema.StringAttribute{
				Required: true,
				MarkdownDescription: "`berth_secrets.<name>.kubernetes_ca_certificate`: the cluster's CA, which the " +
					"API server's certificate and the kubeconfig's CA data are checked against.",
				PlanModifiers: replace,
			},
			"join_ca_certificate": schema.StringAttribute{
				Required:            true,
				MarkdownDescription: "`berth_secrets.<name>.join_ca_certificate`.",
				PlanModifiers:       replace,
			},
			"init_secret_wo":       writeOnly("`ephemeral.berth_secrets.<name>.init_secret`: proves to the node that the request comes from its operator."),
			"master_secret_wo":     writeOnly("`ephemeral.berth_secrets.<name>.master_secret`."),
			"salt_wo":              writeOnly("`ephemeral.berth_secrets.<name>.salt`."),
			"kubernetes_ca_key_wo": writeOnly("`ephemeral.berth_secrets.<name>.kubernetes_ca_key`."),
			"join_ca_key_wo":       writeOnly("`ephemeral.berth_secrets.<name>.join_ca_key`."),
			"init_timeout": schema.StringAttribute{
				Optional: true,
				Computed: true,
				Default:  stringdefault.StaticString(defaultInitTimeout),
				MarkdownDescription: "How long the init may take, waiting for the node's init server included (a " +
					"node created in the same run may still be booting), as a Go duration. Default `" +
					defaultInitTimeout + "`.",
			},
			"id": schema.StringAttribute{Computed: true, PlanModifiers: keep,
				MarkdownDescription: "The cluster ID, the same as `cluster_id`."},
			"cluster_id": schema.StringAttribute{Computed: true, PlanModifiers: keep,
				MarkdownDescription: "The cluster ID the node derived from the master secret and salt; equal to " +
					"`berth_secrets.<name>.cluster_id`."},
			"api_server_endpoint": schema.StringAttribute{Computed: true, PlanModifiers: keep,
				MarkdownDescription: "`host:port` of the API server."},
			"kubeconfig": schema.StringAttribute{Computed: true, Sensitive: true, PlanModifiers: keep,
				MarkdownDescription: "The admin kubeconfig kubeadm wrote (`system:masters`). Sensitive, and kept in " +
					"state: protect the state, or move to narrower credentials after bootstrap."},
			"client_certificate": schema.StringAttribute{Computed: true, PlanModifiers: keep,
				MarkdownDescription: "PEM client certificate of `kubeconfig`, for providers that take it apart " +
					"(`kubernetes`, `helm`) together with `kubernetes_ca_certificate` and `api_server_endpoint`."},
			"client_key": schema.StringAttribute{Computed: true, Sensitive: true, PlanModifiers: keep,
				MarkdownDescription: "PEM private key of `client_certificate`. Sensitive."},
		},
	}
}

func (r *clusterResource) ValidateConfig(ctx context.Context, req resource.ValidateConfigRequest, resp *resource.ValidateConfigResponse) {
	var m clusterModel
	resp.Diagnostics.Append(req.Config.Get(ctx, &m)...)
	if resp.Diagnostics.HasError() {
		return
	}
	if known(m.ClusterName) {
		if err := clustername.Validate(m.ClusterName.ValueString()); err != nil {
			resp.Diagnostics.AddAttributeError(path.Root("cluster_name"), "Invalid cluster name", err.Error()+".")
		}
	}
	for _, a := range []struct {
		name string
		v    types.String
	}{{"endpoint", m.Endpoint}, {"control_plane_endpoint", m.ControlPlaneEndpoint}} {
		if !known(a.v) {
			continue
		}
		if _, port, err := net.SplitHostPort(a.v.ValueString()); err != nil || port == "" {
			resp.Diagnostics.AddAttributeError(path.Root(a.name), "Invalid endpoint",
				fmt.Sprintf("%q is not host:port.", a.v.ValueString()))
		}
	}
	if !m.PCRs.IsUnknown() && !m.PCRs.IsNull() {
		pcrs := pcrValues(ctx, m.PCRs, path.Root("pcrs"), &resp.Diagnostics)
		if len(pcrs) == 0 && !resp.Diagnostics.HasError() {
			resp.Diagnostics.AddAttributeError(path.Root("pcrs"), "No measurements",
				"An unmeasured node must not receive the cluster's secrets: give the image's PCR values.")
		}
	}
	if known(m.EKCACertificates) {
		if _, _, err := attest.ParseCABundle([]byte(m.EKCACertificates.ValueString())); err != nil {
			resp.Diagnostics.AddAttributeError(path.Root("ek_ca_certificates"), "Invalid EK CA certificates", err.Error())
		}
	}
	switch {
	case m.EKCACertificates.IsNull() && m.AWS == nil:
		resp.Diagnostics.AddAttributeError(path.Root("ek_ca_certificates"), "No trust for the node's TPM",
			"Set ek_ca_certificates (TPMs with endorsement key certificates) or aws (EC2 instances with a NitroTPM): "+
				"without one of them no node can be attested.")
	case !m.EKCACertificates.IsNull() && m.AWS != nil:
		resp.Diagnostics.AddAttributeError(path.Root("aws"), "Two trusts for the node's TPM",
			"Set only one of ek_ca_certificates and aws: the node's TPM is trusted either by its certificate chain "+
				"or by what EC2 reports for its instance.")
	}
	if known(m.InitTimeout) {
		if d, err := time.ParseDuration(m.InitTimeout.ValueString()); err != nil || d <= 0 {
			resp.Diagnostics.AddAttributeError(path.Root("init_timeout"), "Invalid timeout",
				fmt.Sprintf("%q is not a positive Go duration such as 15m.", m.InitTimeout.ValueString()))
		}
	}
}

// ekTrust is how the node's TPM is trusted: by ek_ca_certificates, or by the EK that EC2 reports for the
// instance in aws, with the instance id to ask about.
func ekTrust(ctx context.Context, m *clusterModel, diags *diag.Diagnostics) (attest.EKTrust, string) {
	if m.AWS != nil {
		api, err := ec2instances.NewAPI(ctx, m.AWS.Region.ValueString(), m.AWS.Endpoint.ValueString(), nil)
		if err != nil {
			diags.AddAttributeError(path.Root("aws"), "Cannot reach EC2", err.Error())
			return nil, ""
		}
		return attest.CloudEK{Cloud: "EC2", Source: ec2instances.NewEKs(api, nil)}, m.AWS.InstanceID.ValueString()
	}
	roots, inters, err := attest.ParseCABundle([]byte(m.EKCACertificates.ValueString()))
	if err != nil {
		diags.AddAttributeError(path.Root("ek_ca_certificates"), "Invalid EK CA certificates", err.Error())
		return nil, ""
	}
	return attest.NewCertChain(roots, inters, nil), ""
}

func known(v types.String) bool { return !v.IsNull() && !v.IsUnknown() }

func (r *clusterResource) Create(ctx context.Context, req resource.CreateRequest, resp *resource.CreateResponse) {
	var plan, config clusterModel
	resp.Diagnostics.Append(req.Plan.Get(ctx, &plan)...)
	// Write-only values are only in the configuration.
	resp.Diagnostics.Append(req.Config.Get(ctx, &config)...)
	if resp.Diagnostics.HasError() {
		return
	}
	request := initRequest(&plan, &config, &resp.Diagnostics)
	pcrs := pcrValues(ctx, plan.PCRs, path.Root("pcrs"), &resp.Diagnostics)
	trust, instanceID := ekTrust(ctx, &plan, &resp.Diagnostics)
	timeout, err := time.ParseDuration(plan.InitTimeout.ValueString())
	if err != nil {
		resp.Diagnostics.AddAttributeError(path.Root("init_timeout"), "Invalid timeout", err.Error())
	}
	if resp.Diagnostics.HasError() {
		return
	}

	endpoint := plan.Endpoint.ValueString()
	tail := make([]string, 0, progressTail)
	tflog.Info(ctx, "attesting the node and initializing the cluster", map[string]any{"endpoint": endpoint, "timeout": timeout.String()})
	start := time.Now()
	result, err := initclient.Init(ctx, initclient.Config{
		Endpoint:     endpoint,
		Verifier:     attest.NewVerifier(trust),
		InstanceID:   instanceID,
		ExpectedPCRs: pcrs,
		Request:      request,
		Timeout:      timeout,
		Busy: func(attempt int, wait time.Duration) {
			tflog.Info(ctx, "the node is busy with another init exchange; asking again", map[string]any{
				"endpoint": endpoint, "attempt": attempt, "retry_in": wait.String()})
		},
		Progress: func(line string) {
			tflog.Info(ctx, "kubeadm: "+line, map[string]any{"endpoint": endpoint})
			if len(tail) == progressTail {
				tail = tail[1:]
			}
			tail = append(tail, line)
		},
	})
	if err != nil {
		addInitError(&resp.Diagnostics, endpoint, err, tail)
		return
	}
	tflog.Info(ctx, "cluster initialized", map[string]any{"cluster_id": result.ClusterId, "seconds": time.Since(start).Seconds()})

	// The node derives the ID from the secrets it was sent; another ID means it did not use them.
	if want, err := keys.ClusterIDOf(request.MasterSecret, request.Salt); err != nil || result.ClusterId != want {
		resp.Diagnostics.AddError("The node reports another cluster",
			fmt.Sprintf("The node at %s reports cluster %q, but the secrets sent make cluster %q (%v).", endpoint, result.ClusterId, want, err))
		return
	}
	creds, err := parseKubeconfig(result.Kubeconfig)
	if err != nil {
		resp.Diagnostics.AddError("The node returned an unusable kubeconfig",
			"The cluster "+result.ClusterId+" is initialized, but "+err.Error()+". The node keeps /etc/kubernetes/admin.conf.")
		return
	}
	if !bytes.Equal(bytes.TrimSpace(creds.caPEM), bytes.TrimSpace([]byte(plan.KubernetesCACertificate.ValueString()))) {
		resp.Diagnostics.AddError("The cluster's CA is not the one given",
			"The kubeconfig the node returned trusts another CA than kubernetes_ca_certificate; the node did not use the cluster CA it was sent.")
		return
	}
	plan.ID = types.StringValue(result.ClusterId)
	plan.ClusterID = types.StringValue(result.ClusterId)
	plan.APIServerEndpoint = types.StringValue(result.ApiServerEndpoint)
	plan.Kubeconfig = types.StringValue(string(result.Kubeconfig))
	plan.ClientCertificate = types.StringValue(string(creds.certPEM))
	plan.ClientKey = types.StringValue(string(creds.keyPEM))
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
}

// initRequest assembles the init request from the plan and the write-only secrets of the configuration.
func initRequest(plan, config *clusterModel, diags *diag.Diagnostics) *berthv1.InitRequest {
	var missing []string
	secret := func(name string, v types.String) string {
		if !known(v) || v.ValueString() == "" {
			missing = append(missing, name)
		}
		return v.ValueString()
	}
	initSecret := secret("init_secret_wo", config.InitSecretWO)
	master := secret("master_secret_wo", config.MasterSecretWO)
	salt := secret("salt_wo", config.SaltWO)
	kubeKey := secret("kubernetes_ca_key_wo", config.KubernetesCAKeyWO)
	joinKey := secret("join_ca_key_wo", config.JoinCAKeyWO)
	if len(missing) > 0 {
		diags.AddError("Cluster secrets missing",
			"Initializing a cluster needs "+strings.Join(missing, ", ")+": pass them from the ephemeral resource "+
				"berth_secrets (see the berth_cluster example).")
		return nil
	}
	decode := func(name, text string) []byte {
		b, err := base64.StdEncoding.DecodeString(text)
		if err != nil {
			diags.AddAttributeError(path.Root(name), "Invalid secret", name+" is not base64 (as ephemeral berth_secrets gives it).")
		}
		return b
	}
	req := &berthv1.InitRequest{
		InitSecret:              []byte(initSecret),
		MasterSecret:            decode("master_secret_wo", master),
		Salt:                    decode("salt_wo", salt),
		KubernetesCaCertificate: []byte(plan.KubernetesCACertificate.ValueString()),
		KubernetesCaKey:         []byte(kubeKey),
		JoinCaCertificate:       []byte(plan.JoinCACertificate.ValueString()),
		JoinCaKey:               []byte(joinKey),
		ClusterName:             plan.ClusterName.ValueString(),
		KubernetesVersion:       plan.KubernetesVersion.ValueString(),
		ControlPlaneEndpoint:    plan.ControlPlaneEndpoint.ValueString(),
		PodSubnet:               plan.PodSubnet.ValueString(),
		ServiceSubnet:           plan.ServiceSubnet.ValueString(),
	}
	// A key that does not belong to its certificate is caught here rather than by kubeadm on the node.
	for _, ca := range []struct{ name, cert, key string }{
		{"kubernetes_ca_key_wo", plan.KubernetesCACertificate.ValueString(), kubeKey},
		{"join_ca_key_wo", plan.JoinCACertificate.ValueString(), joinKey},
	} {
		if _, err := pki.ParseCA([]byte(ca.cert), []byte(ca.key)); err != nil {
			diags.AddAttributeError(path.Root(ca.name), "CA key does not fit its certificate",
				"The key and its certificate must both come from the same berth_secrets: "+err.Error())
		}
	}
	return req
}

// addInitError turns an init failure into a diagnostic that says what to do.
func addInitError(diags *diag.Diagnostics, endpoint string, err error, tail []string) {
	var mismatch *initclient.MeasurementError
	if errors.As(err, &mismatch) {
		diags.AddAttributeError(path.Root("pcrs"), "The node does not run the expected image",
			fmt.Sprintf("The node at %s was not sent any secret: %s. Check that the node booted from the image "+
				"whose measurements are in pcrs (data.berth_image), with the same firmware settings.", endpoint, mismatch))
		return
	}
	detail := err.Error()
	if rpc.IsBusy(err) {
		detail = "Another client kept the node's init server busy until init_timeout. Is a second apply (or " +
			"someone else) initializing this node?\n\n" + detail
	} else if code := status.Code(err); len(tail) == 0 && (code == codes.DeadlineExceeded || code == codes.Unavailable) {
		detail = "No init server answered in time. Is the node up, booted from a Berth image with user-data from " +
			"berth_node_config (with init_secret_hash), and is its port reachable from here?\n\n" + detail
	}
	if len(tail) > 0 {
		detail += "\n\nLast lines of kubeadm on the node:\n" + strings.Join(tail, "\n")
	}
	diags.AddError("Initializing the cluster at "+endpoint+" failed", detail)
}

type kubeCredentials struct {
	caPEM, certPEM, keyPEM []byte
}

// parseKubeconfig takes the credentials of the current context apart.
func parseKubeconfig(data []byte) (*kubeCredentials, error) {
	cfg, err := clientcmd.Load(data)
	if err != nil {
		return nil, fmt.Errorf("its kubeconfig does not parse: %w", err)
	}
	kctx, ok := cfg.Contexts[cfg.CurrentContext]
	if !ok {
		return nil, fmt.Errorf("its kubeconfig has no current context %q", cfg.CurrentContext)
	}
	cluster, auth := cfg.Clusters[kctx.Cluster], cfg.AuthInfos[kctx.AuthInfo]
	if cluster == nil || auth == nil || len(cluster.CertificateAuthorityData) == 0 || len(auth.ClientCertificateData) == 0 || len(auth.ClientKeyData) == 0 {
		return nil, errors.New("its kubeconfig lacks embedded CA data or client credentials")
	}
	return &kubeCredentials{caPEM: cluster.CertificateAuthorityData, certPEM: auth.ClientCertificateData, keyPEM: auth.ClientKeyData}, nil
}

// Read checks that the API server behind the kubeconfig is still this cluster. See the resource's
// description for what counts as gone.
func (r *clusterResource) Read(ctx context.Context, req resource.ReadRequest, resp *resource.ReadResponse) {
	var m clusterModel
	resp.Diagnostics.Append(req.State.Get(ctx, &m)...)
	if resp.Diagnostics.HasError() {
		return
	}
	switch verdict, why := checkCluster(ctx, m); verdict {
	case clusterGone:
		resp.Diagnostics.AddWarning("Cluster "+m.ClusterID.ValueString()+" is gone",
			why+" It is removed from state; the next apply initializes a new cluster at "+m.Endpoint.ValueString()+".")
		resp.State.RemoveResource(ctx)
	case clusterSilent:
		resp.Diagnostics.AddWarning("Cluster "+m.ClusterID.ValueString()+" did not answer",
			why+" The cluster stays in state as it was. If its machines are gone for good, initialize a new one "+
				"with: terraform apply -replace=<this resource's address>.")
	}
}

type clusterVerdict int

const (
	clusterHere   clusterVerdict = iota // the API server holds this cluster's record
	clusterGone                         // another cluster, no cluster, or a node waiting for init
	clusterSilent                       // nothing conclusive answered
)

// checkCluster tells what answers for the cluster of m, and why.
func checkCluster(ctx context.Context, m clusterModel) (clusterVerdict, string) {
	api := m.APIServerEndpoint.ValueString()
	info, err := readClusterInfo(ctx, m.Kubeconfig.ValueString())
	switch {
	case err == nil && info.ID == m.ClusterID.ValueString():
		return clusterHere, ""
	case err == nil:
		return clusterGone, fmt.Sprintf("The API server at %s belongs to cluster %s now.", api, info.ID)
	case errors.Is(err, clusterinfo.ErrNotFound):
		return clusterGone, fmt.Sprintf("The API server at %s answers, but holds no Berth cluster record.", api)
	case anotherCluster(err):
		return clusterGone, fmt.Sprintf("The API server at %s does not accept this cluster's credentials or CA (%v): another cluster runs there.", api, err)
	}
	if waiting, _ := initclient.AwaitsInit(ctx, m.Endpoint.ValueString(), probeTimeout); waiting {
		return clusterGone, fmt.Sprintf("The API server at %s does not answer (%v), and a node waiting for init answers at %s.",
			api, err, m.Endpoint.ValueString())
	}
	return clusterSilent, fmt.Sprintf("Reading the cluster record failed: %v.", err)
}

func readClusterInfo(ctx context.Context, kubeconfig string) (clusterinfo.Info, error) {
	rc, err := clientcmd.RESTConfigFromKubeConfig([]byte(kubeconfig))
	if err != nil {
		return clusterinfo.Info{}, fmt.Errorf("the kubeconfig in state does not parse: %w", err)
	}
	rc.Timeout = probeTimeout
	kube, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return clusterinfo.Info{}, err
	}
	return clusterinfo.Read(ctx, kube)
}

// anotherCluster tells a server that proves it is not this cluster (its certificate is not from this CA, or
// it refuses this cluster's admin credentials) from one that did not answer.
func anotherCluster(err error) bool {
	var unknownCA x509.UnknownAuthorityError
	var verify *tls.CertificateVerificationError
	return apierrors.IsUnauthorized(err) || errors.As(err, &unknownCA) || errors.As(err, &verify)
}

// Update changes only what needs no node: the measurements and EK CAs (used at init only) and the timeout.
func (r *clusterResource) Update(ctx context.Context, req resource.UpdateRequest, resp *resource.UpdateResponse) {
	var plan, state clusterModel
	resp.Diagnostics.Append(req.Plan.Get(ctx, &plan)...)
	resp.Diagnostics.Append(req.State.Get(ctx, &state)...)
	if resp.Diagnostics.HasError() {
		return
	}
	state.PCRs, state.EKCACertificates, state.InitTimeout = plan.PCRs, plan.EKCACertificates, plan.InitTimeout
	resp.Diagnostics.Append(resp.State.Set(ctx, &state)...)
}

func (r *clusterResource) Delete(ctx context.Context, req resource.DeleteRequest, resp *resource.DeleteResponse) {
	var m clusterModel
	resp.Diagnostics.Append(req.State.Get(ctx, &m)...)
	resp.Diagnostics.AddWarning("Cluster "+m.ClusterID.ValueString()+" removed from state only",
		"berth_cluster does not stop or wipe machines: the cluster's nodes keep running until the infrastructure "+
			"that made them (instances, autoscaling groups) destroys them. Their state disks are encrypted with "+
			"keys derived from the root key, so destroy or rotate the root key as your retention rules say.")
}

func (r *clusterResource) ImportState(_ context.Context, _ resource.ImportStateRequest, resp *resource.ImportStateResponse) {
	resp.Diagnostics.AddError("berth_cluster cannot be imported",
		"The node hands out the admin kubeconfig only once, as the result of its init, and nothing else can prove "+
			"which init secret made the cluster. Keep managing the running cluster's join policy with "+
			"berth_join_policy (which can be imported), or initialize a new cluster.")
}
