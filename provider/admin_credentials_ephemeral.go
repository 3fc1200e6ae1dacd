package provider

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/ephemeral"
	"github.com/hashicorp/terraform-plugin-framework/ephemeral/schema"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-log/tflog"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/berthlabs/berth/internal/clustersecrets"
	"github.com/berthlabs/berth/internal/pki"
)

const (
	// adminGroup is the group of the admin kubeconfig kubeadm writes (and berth_cluster returns), which
	// kubeadm init binds to cluster-admin (ClusterRoleBinding kubeadm:cluster-admins). Minted certificates
	// take the same group, so they have the same rights, and deleting that binding takes them away, which
	// system:masters, a group RBAC cannot restrict, would not allow.
	adminGroup = "kubeadm:cluster-admins"
	// defaultAdminUser tells minted credentials from kubeadm's kubernetes-admin in the API server's audit log.
	defaultAdminUser     = "berth-admin"
	defaultAdminValidity = "1h"
	minAdminValidity     = time.Minute
	// maxAdminValidity caps what a certificate that cannot be revoked can be worth to whoever copies it: a
	// run needs minutes, and a credential for longer is what berth_cluster's stored kubeconfig is for.
	maxAdminValidity = 24 * time.Hour
)

var (
	_ ephemeral.EphemeralResource                   = (*adminCredentialsEphemeralResource)(nil)
	_ ephemeral.EphemeralResourceWithValidateConfig = (*adminCredentialsEphemeralResource)(nil)
)

// adminCredentialsEphemeralResource is berth_admin_credentials: an admin client certificate minted for one
// Terraform run from the root key, by the Kubernetes CA whose key the root key derives.
type adminCredentialsEphemeralResource struct{}

func newAdminCredentialsEphemeralResource() ephemeral.EphemeralResource {
	return &adminCredentialsEphemeralResource{}
}

type adminCredentialsModel struct {
	RootKey                 types.String `tfsdk:"root_key"`
	KubernetesCACertificate types.String `tfsdk:"kubernetes_ca_certificate"`
	APIServerEndpoint       types.String `tfsdk:"api_server_endpoint"`
	Validity                types.String `tfsdk:"validity"`
	UserName                types.String `tfsdk:"user_name"`
	Host                    types.String `tfsdk:"host"`
	ClusterCACertificate    types.String `tfsdk:"cluster_ca_certificate"`
	ClientCertificate       types.String `tfsdk:"client_certificate"`
	ClientKey               types.String `tfsdk:"client_key"`
	Kubeconfig              types.String `tfsdk:"kubeconfig"`
	ExpiresAt               types.String `tfsdk:"expires_at"`
}

func (e *adminCredentialsEphemeralResource) Metadata(_ context.Context, req ephemeral.MetadataRequest, resp *ephemeral.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_admin_credentials"
}

func (e *adminCredentialsEphemeralResource) Schema(_ context.Context, _ ephemeral.SchemaRequest, resp *ephemeral.SchemaResponse) {
	computed := func(desc string, sensitive bool) schema.StringAttribute {
		return schema.StringAttribute{Computed: true, Sensitive: sensitive, MarkdownDescription: desc}
	}
	resp.Schema = schema.Schema{
		MarkdownDescription: "Admin credentials of a Berth cluster, minted for one Terraform run and never stored: a " +
			"new key and a client certificate, valid for `validity` (default " + defaultAdminValidity + "), signed " +
			"by the cluster's Kubernetes CA with the CA key that the root key derives. Nothing is asked of the " +
			"cluster to mint them, so they can be had before it answers.\n\n" +
			"The certificate has the identity of the admin kubeconfig kubeadm writes: the group `" + adminGroup +
			"`, which `kubeadm init` binds to `cluster-admin`, and the user `user_name`, so that the API server's " +
			"audit log tells these credentials from the stored ones. Pass the results to provider configurations " +
			"(`kubernetes`, `helm`, or an aliased `berth` provider for `berth_join_policy` and " +
			"`berth_cluster_health`), which Terraform never stores, or to other ephemeral resources.\n\n" +
			"Terraform opens an ephemeral resource anew in every plan and every apply, so each gets its own " +
			"certificate. A certificate cannot be revoked before it expires (deleting the ClusterRoleBinding `" +
			adminGroup + "` takes the rights of every admin certificate at once): keep `validity` as short as " +
			"the longest run. The root key is checked against the Kubernetes CA certificate of `berth_secrets`; " +
			"a root key that did not make it is refused. Requires Terraform 1.10 or later.",
		Attributes: map[string]schema.Attribute{
			"root_key": schema.StringAttribute{
				Required:            true,
				Sensitive:           true,
				MarkdownDescription: "The root key given to `berth_secrets.root_key_wo` (base64 of at least 32 random bytes), from an ephemeral variable.",
			},
			"kubernetes_ca_certificate": schema.StringAttribute{
				Required:            true,
				MarkdownDescription: "`berth_secrets.<name>.kubernetes_ca_certificate`: the CA that signs the certificate, and that the API server's certificate is checked against.",
			},
			"api_server_endpoint": schema.StringAttribute{
				Required: true,
				MarkdownDescription: "Where the API server answers: `berth_cluster.<name>.api_server_endpoint` " +
					"(`host:port`), or an `https://` URL such as a load balancer's.",
			},
			"validity": schema.StringAttribute{
				Optional: true,
				MarkdownDescription: "How long the certificate is valid, as a Go duration, from 1m to 24h. Default `" +
					defaultAdminValidity + "`. It must outlast the Terraform run that uses it.",
			},
			"user_name": schema.StringAttribute{
				Optional: true,
				MarkdownDescription: "The Kubernetes user name of the certificate (its common name), as the audit log " +
					"shows it, such as the pipeline that runs Terraform. Default `" + defaultAdminUser + "`. Names " +
					"starting with `system:` belong to Kubernetes' own components and are refused.",
			},
			"host": computed("`https://` URL of the API server, for the `host` of the `kubernetes` and `helm` providers.", false),
			"cluster_ca_certificate": computed("PEM certificate of the cluster's CA (`kubernetes_ca_certificate`), "+
				"for `cluster_ca_certificate` of the `kubernetes` and `helm` providers.", false),
			"client_certificate": computed("PEM client certificate, user `user_name` in group `"+adminGroup+"`.", false),
			"client_key":         computed("PEM (PKCS#8) private key of `client_certificate`, made for this run.", true),
			"kubeconfig":         computed("A kubeconfig with `host`, the CA and the client certificate and key embedded, for the `kubeconfig` of an aliased `berth` provider or for tools run by provisioners.", true),
			"expires_at":         computed("When the certificate expires, RFC 3339 in UTC.", false),
		},
	}
}

// adminRequest is what a configuration asks to be minted.
type adminRequest struct {
	host     string
	validity time.Duration
	user     string
}

// request checks the arguments that are known; ValidateConfig sees some unknown, Open sees them all.
func (m *adminCredentialsModel) request(diags *diag.Diagnostics) adminRequest {
	var r adminRequest
	if known(m.RootKey) {
		if _, err := clustersecrets.ParseRootKey(m.RootKey.ValueString()); err != nil {
			diags.AddAttributeError(path.Root("root_key"), "Invalid root key", err.Error())
		}
	}
	if known(m.APIServerEndpoint) {
		host, err := apiServerURL(m.APIServerEndpoint.ValueString())
		if err != nil {
			diags.AddAttributeError(path.Root("api_server_endpoint"), "Invalid API server endpoint", err.Error())
		}
		r.host = host
	}
	if !m.Validity.IsUnknown() {
		text := defaultAdminValidity
		if !m.Validity.IsNull() {
			text = m.Validity.ValueString()
		}
		d, err := time.ParseDuration(text)
		switch {
		case err != nil:
			diags.AddAttributeError(path.Root("validity"), "Invalid validity",
				fmt.Sprintf("validity %q is not a Go duration such as \"1h\" or \"30m\": %v", text, err))
		case d < minAdminValidity || d > maxAdminValidity:
			diags.AddAttributeError(path.Root("validity"), "Validity out of range",
				fmt.Sprintf("validity is %s; it must be from %s to %s. A certificate cannot be revoked, so it is "+
					"minted for one run; for credentials that last, use berth_cluster's kubeconfig.", d, minAdminValidity, maxAdminValidity))
		}
		r.validity = d
	}
	if !m.UserName.IsUnknown() {
		r.user = defaultAdminUser
		if !m.UserName.IsNull() {
			r.user = m.UserName.ValueString()
		}
		switch {
		case strings.TrimSpace(r.user) == "":
			diags.AddAttributeError(path.Root("user_name"), "Invalid user name", "user_name is empty.")
		case strings.HasPrefix(r.user, "system:"):
			diags.AddAttributeError(path.Root("user_name"), "Invalid user name",
				fmt.Sprintf("user_name %q starts with \"system:\", which Kubernetes reserves for its own components: "+
					"an admin under such a name would pass for one of them in the audit log.", r.user))
		}
	}
	return r
}

// apiServerURL makes the https URL of an endpoint given as host:port or as a URL.
func apiServerURL(endpoint string) (string, error) {
	if strings.Contains(endpoint, "://") {
		u, err := url.Parse(endpoint)
		if err != nil {
			return "", err
		}
		if u.Scheme != "https" || u.Host == "" || u.User != nil || u.RawQuery != "" || u.Fragment != "" {
			return "", fmt.Errorf("%q: an API server URL is https://host[:port][/path], with nothing else", endpoint)
		}
		return strings.TrimSuffix(u.String(), "/"), nil
	}
	host, port, err := net.SplitHostPort(endpoint)
	if err != nil || host == "" || port == "" {
		return "", fmt.Errorf("%q is neither host:port (as berth_cluster's api_server_endpoint) nor an https:// URL", endpoint)
	}
	return "https://" + net.JoinHostPort(host, port), nil
}

func (e *adminCredentialsEphemeralResource) ValidateConfig(ctx context.Context, req ephemeral.ValidateConfigRequest, resp *ephemeral.ValidateConfigResponse) {
	var m adminCredentialsModel
	resp.Diagnostics.Append(req.Config.Get(ctx, &m)...)
	if resp.Diagnostics.HasError() {
		return
	}
	m.request(&resp.Diagnostics)
}

func (e *adminCredentialsEphemeralResource) Open(ctx context.Context, req ephemeral.OpenRequest, resp *ephemeral.OpenResponse) {
	var m adminCredentialsModel
	resp.Diagnostics.Append(req.Config.Get(ctx, &m)...)
	if resp.Diagnostics.HasError() {
		return
	}
	r := m.request(&resp.Diagnostics)
	if resp.Diagnostics.HasError() {
		return
	}
	ca, err := kubernetesCA(m.RootKey.ValueString(), m.KubernetesCACertificate.ValueString())
	switch {
	case errors.Is(err, clustersecrets.ErrWrongRootKey):
		resp.Diagnostics.AddAttributeError(path.Root("root_key"), "Root key does not match the Kubernetes CA",
			"The root key given to berth_admin_credentials did not make kubernetes_ca_certificate: pass the root key "+
				"of berth_secrets.root_key_wo and that berth_secrets' kubernetes_ca_certificate.")
		return
	case err != nil:
		resp.Diagnostics.AddAttributeError(path.Root("kubernetes_ca_certificate"), "Invalid Kubernetes CA certificate",
			"kubernetes_ca_certificate must be berth_secrets' kubernetes_ca_certificate: "+err.Error())
		return
	}
	admin, err := mintAdmin(ca, r, time.Now())
	if err != nil {
		resp.Diagnostics.AddError("Minting admin credentials failed", err.Error())
		return
	}
	expires := admin.notAfter.UTC().Format(time.RFC3339)
	tflog.Info(ctx, "minted admin credentials", map[string]any{"user": r.user, "group": adminGroup, "host": r.host, "expires_at": expires})
	m.Host = types.StringValue(r.host)
	m.ClusterCACertificate = types.StringValue(string(ca.CertPEM()))
	m.ClientCertificate = types.StringValue(string(admin.certPEM))
	m.ClientKey = types.StringValue(string(admin.keyPEM))
	m.Kubeconfig = types.StringValue(string(admin.kubeconfig))
	m.ExpiresAt = types.StringValue(expires)
	resp.Diagnostics.Append(resp.Result.Set(ctx, &m)...)
}

// deriveSecrets derives the secrets of a root key written as the provider takes it (base64).
func deriveSecrets(rootKey string) (*clustersecrets.Secrets, error) {
	root, err := clustersecrets.ParseRootKey(rootKey)
	if err != nil {
		return nil, err
	}
	return clustersecrets.Derive(root)
}

// kubernetesCA pairs the kept Kubernetes CA certificate with the key root derives, refusing a root key that
// did not make the certificate.
func kubernetesCA(rootKey, certPEM string) (*pki.CA, error) {
	secrets, err := deriveSecrets(rootKey)
	if err != nil {
		return nil, err
	}
	cert, err := pki.ParseCertPEM([]byte(certPEM))
	if err != nil {
		return nil, err
	}
	if !secrets.KubernetesCAKey.PublicKey.Equal(cert.PublicKey) {
		return nil, clustersecrets.ErrWrongRootKey
	}
	if !cert.IsCA {
		return nil, fmt.Errorf("certificate %q is not a CA certificate", cert.Subject.CommonName)
	}
	return &pki.CA{Cert: cert, Key: secrets.KubernetesCAKey}, nil
}

// adminCredentials are a minted admin certificate, its key, and a kubeconfig with both.
type adminCredentials struct {
	kubeconfig, certPEM, keyPEM []byte
	notAfter                    time.Time
}

// mintAdmin issues from ca, at now, a client certificate for r's user in adminGroup (bound to cluster-admin)
// and writes it into a kubeconfig for r's host.
func mintAdmin(ca *pki.CA, r adminRequest, now time.Time) (adminCredentials, error) {
	key, err := pki.NewKey()
	if err != nil {
		return adminCredentials{}, fmt.Errorf("making the admin key: %w", err)
	}
	cert, err := ca.IssueClient(pki.ClientTemplate{CommonName: r.user, Organization: []string{adminGroup}}, key.Public(), now, r.validity)
	if err != nil {
		return adminCredentials{}, fmt.Errorf("issuing the admin certificate: %w", err)
	}
	certPEM := pki.EncodeCertPEM(cert)
	keyPEM, err := pki.EncodeKeyPEM(key)
	if err != nil {
		return adminCredentials{}, fmt.Errorf("encoding the admin key: %w", err)
	}
	kubeconfig, err := adminKubeconfig(r, ca.CertPEM(), certPEM, keyPEM)
	if err != nil {
		return adminCredentials{}, fmt.Errorf("writing the admin kubeconfig: %w", err)
	}
	return adminCredentials{kubeconfig: kubeconfig, certPEM: certPEM, keyPEM: keyPEM, notAfter: cert.NotAfter}, nil
}

func adminKubeconfig(r adminRequest, caPEM, certPEM, keyPEM []byte) ([]byte, error) {
	const cluster = "berth"
	current := r.user + "@" + cluster
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters[cluster] = &clientcmdapi.Cluster{Server: r.host, CertificateAuthorityData: caPEM}
	cfg.AuthInfos[r.user] = &clientcmdapi.AuthInfo{ClientCertificateData: certPEM, ClientKeyData: keyPEM}
	cfg.Contexts[current] = &clientcmdapi.Context{Cluster: cluster, AuthInfo: r.user}
	cfg.CurrentContext = current
	return clientcmd.Write(*cfg)
}
