package provider

import (
	"context"
	"crypto/tls"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/diag"
	fwresource "github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/tfsdk"
	"github.com/hashicorp/terraform-plugin-go/tftypes"
	"github.com/hashicorp/terraform-plugin-testing/config"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/cloud/gcp/shieldedvm"
	"github.com/berthlabs/berth/internal/cloud/gcp/shieldedvm/shieldedvmtest"
	"github.com/berthlabs/berth/internal/keys"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/rpc"
	"github.com/berthlabs/berth/test/swtpm/swtpmtest"
)

// gcpInstance is gcp for an instance of the project and zone that TestClusterGCPInit's Google-shaped vTPM
// is certified in.
const gcpInstance = `
  gcp = {
    project            = "berth-lab"
    zone               = "europe-west1-b"
    instance           = "%s"
    ek_ca_certificates = var.vtpm_ca
  }
`

// vtpmCAVariable is gcp.ek_ca_certificates; null leaves Google's CAs.
const vtpmCAVariable = `
variable "vtpm_ca" {
  type    = string
  default = null
}
`

// nodeData is a resource whose output Terraform knows only after apply: at plan time a block set from it
// is wholly unknown.
const nodeData = `
resource "terraform_data" "node" {
  input = {
    project     = "berth-lab"
    zone        = "europe-west1-b"
    instance    = "cp-0"
    instance_id = "i-0123456789abcdef0"
    region      = "eu-west-1"
  }
}
`

// TestClusterGCPValidation covers berth_cluster's plan-time checks of gcp with the real terraform: each bad
// part of the instance is named with its value, all in one run, even while another part is unknown; a bad
// CA bundle is named; and a wholly unknown gcp or aws block (set from another resource's output) plans.
func TestClusterGCPValidation(t *testing.T) {
	t.Parallel()
	vars := config.Variables{"root_key": config.StringVariable(base64.StdEncoding.EncodeToString(make([]byte, 32)))}
	good := clusterArgs("127.0.0.1:1", "lab", zeroPCR11)
	// partError matches Terraform's rendering of an error on berth_cluster.test. Terraform shows the
	// resource's line for an attribute inside gcp; TestClusterTrustDiagnosticPaths checks the paths.
	partError := func(summary, detail string) string {
		return regexp.QuoteMeta("Error: "+summary) + `.*with berth_cluster\.test,.*` + phrase(detail).String()
	}
	step := func(args, want string) resource.TestStep {
		s := resource.TestStep{Config: clusterConfig(good+args) + nodeData, ConfigVariables: vars,
			PlanOnly: true, ExpectNonEmptyPlan: true}
		if want != "" {
			s.ExpectError = regexp.MustCompile(`(?s)` + want)
		}
		return s
	}
	resource.UnitTest(t, resource.TestCase{
		ProtoV6ProviderFactories: providers,
		Steps: []resource.TestStep{
			step(`
  gcp = {
    project  = "Berth_Lab"
    zone     = "europe-west1"
    instance = "cp_0"
  }`, partError("Invalid Compute Engine instance", `gcp.project is "Berth_Lab", which is not a project id`)+`.*`+
				partError("Invalid Compute Engine instance", `gcp.zone is "europe-west1", which is not a zone such as "europe-west1-b"`)+`.*`+
				partError("Invalid Compute Engine instance", `gcp.instance is "cp_0", which is not an instance name`)),
			step(`
  gcp = {
    project  = "123456789012"
    zone     = "europe-west1-b"
    instance = terraform_data.node.output.instance
  }`, partError("Invalid Compute Engine instance", `gcp.project is "123456789012", which is not a project id`)),
			step(`
  gcp = {
    project            = "berth-lab"
    zone               = "europe-west1-b"
    instance           = "cp-0"
    ek_ca_certificates = "not PEM"
  }`, partError("Invalid EK CA certificates", "no certificate in the EK CA bundle")),
			// Neither block is known before terraform_data.node is created; nothing else is set, and the plan
			// must neither fail to read the block nor say that no trust is set.
			step(`  gcp = terraform_data.node.output`, ""),
			step(`  aws = terraform_data.node.output`, ""),
		},
	})
}

// TestClusterGCPInit runs berth_cluster with gcp against nodes whose real TPMs (swtpm) attest over the init
// connection: a TPM whose EK certificate is not Google-shaped (swtpm_localca's, which names no instance) is
// refused whether or not its chain is trusted; a Google-shaped vTPM certified for another instance, or by
// a CA other than gcp's, is refused; the one certified for the instance is initialized, and a later change
// of how gcp names it changes only state.
func TestClusterGCPInit(t *testing.T) {
	t.Parallel()
	localCA := swtpmtest.NewCA(t)
	plainNode := startTestNode(t, localCA.NewTPM(t))

	vtpmCA, err := shieldedvmtest.NewCA()
	if err != nil {
		t.Fatal(err)
	}
	vtpm := swtpmtest.NewTPMWithoutEKCertificate(t)
	cert, err := vtpmCA.IssueEK(vtpm.EKPublic(t), shieldedvm.InstanceInfo{Zone: "europe-west1-b", ProjectNumber: 123456789012,
		ProjectID: "berth-lab", InstanceID: 4242, InstanceName: "cp-0"})
	if err != nil {
		t.Fatal(err)
	}
	vtpm.WriteEKCertificate(t, cert.Raw)
	shieldedNode := startTestNode(t, vtpm)

	rootKey := config.StringVariable(base64.StdEncoding.EncodeToString(make([]byte, 32)))
	step := func(endpoint, instance string, ca []byte) resource.TestStep {
		vars := config.Variables{"root_key": rootKey}
		if ca != nil {
			vars["vtpm_ca"] = config.StringVariable(string(ca))
		}
		args := clusterArgs(endpoint, "lab", zeroPCR11) + `  init_timeout = "1m"` + clusterSecrets + fmt.Sprintf(gcpInstance, instance)
		return resource.TestStep{Config: clusterConfig(args) + vtpmCAVariable, ConfigVariables: vars}
	}
	refused := func(s resource.TestStep, why string) resource.TestStep {
		s.ExpectError = regexp.MustCompile(`(?s)Initializing the cluster at .* failed.*` + phrase(why).String())
		return s
	}
	updated := step(shieldedNode, "4242", vtpmCA.PEM())
	updated.ConfigPlanChecks = resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{
		plancheck.ExpectResourceAction("berth_cluster.test", plancheck.ResourceActionUpdate)}}
	updated.Check = resource.TestCheckResourceAttr("berth_cluster.test", "gcp.instance", "4242")

	resource.UnitTest(t, resource.TestCase{
		ProtoV6ProviderFactories: providers,
		Steps: []resource.TestStep{
			refused(step(plainNode, "cp-0", nil), "does not chain to a trusted EK root"),
			refused(step(plainNode, "cp-0", localCA.BundlePEM()),
				"the EK certificate names no instance, and without the Compute API nothing binds it to "+
					"projects/berth-lab/zones/europe-west1-b/instances/cp-0"),
			refused(step(shieldedNode, "cp-1", vtpmCA.PEM()),
				`the EK certificate is for projects/berth-lab/zones/europe-west1-b/instances/cp-0 (id 4242), not `+
					`projects/berth-lab/zones/europe-west1-b/instances/cp-1: instance name "cp-0"`),
			refused(step(shieldedNode, "cp-0", nil), "does not chain to a trusted EK root"),
			func() resource.TestStep {
				s := step(shieldedNode, "cp-0", vtpmCA.PEM())
				s.Check = resource.ComposeTestCheckFunc(
					resource.TestCheckResourceAttrPair("berth_cluster.test", "cluster_id", "berth_secrets.test", "cluster_id"),
					resource.TestCheckResourceAttr("berth_cluster.test", "gcp.instance", "cp-0"),
				)
				return s
			}(),
			updated,
		},
	})
}

// testNode stands in for berth-agent's init server on a fresh control-plane node, for the provider's side
// of the exchange: its real TPM attests over the connection as the agent's does (attest.Prover, the TLS
// exporter nonce, credential activation), and a request that reaches it gets the result a node would make
// of it (the cluster ID its secrets derive, an admin kubeconfig from its Kubernetes CA) without kubeadm.
// Once initialized it refuses every exchange, so that a refresh finds no node waiting for init.
type testNode struct {
	berthv1.UnimplementedInitServiceServer
	prover *attest.Prover
	// mu serves one exchange at a time, as the agent's init slot does: a TPM runs one command at a time.
	mu          sync.Mutex
	initialized bool
}

// startTestNode serves a testNode on tpm at a loopback address, which it returns, until the test ends.
func startTestNode(t *testing.T, tpm *swtpmtest.TPM) string {
	t.Helper()
	open, err := attest.OpenTPM(tpm.Device())
	if err != nil {
		t.Fatal(err)
	}
	prover, err := attest.NewProver(open)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { prover.Close() })
	now := time.Now()
	// The CA outlives its one certificate: certificates keep whole seconds, and now does not.
	ca, err := pki.NewCA("test-node", now, 2*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	key, err := pki.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := ca.IssueServer(key.Public(), []string{"berth-init"}, nil, now, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(rpc.ServerOptions(tls.Certificate{Certificate: [][]byte{leaf.Raw, ca.Cert.Raw}, PrivateKey: key})...)
	berthv1.RegisterInitServiceServer(srv, &testNode{prover: prover})
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	return lis.Addr().String()
}

func (n *testNode) Init(st berthv1.InitService_InitServer) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.initialized {
		return status.Error(codes.FailedPrecondition, "node is already a cluster member")
	}
	hello, err := st.Recv()
	if err != nil {
		return err
	}
	nonce, err := rpc.StreamNonce(st.Context())
	if err != nil {
		return err
	}
	pcrs, err := attest.PCRIndexes(hello.GetHello().GetPcrs())
	if err != nil {
		return err
	}
	ev, err := n.prover.Evidence(nonce, pcrs)
	if err != nil {
		return err
	}
	if err := st.Send(&berthv1.InitServerMessage{Msg: &berthv1.InitServerMessage_Evidence{Evidence: ev}}); err != nil {
		return err
	}
	// A client that refuses the evidence hangs up here.
	msg, err := st.Recv()
	if err != nil {
		return err
	}
	secret, err := n.prover.Activate(msg.GetChallenge())
	if err != nil {
		return err
	}
	proof := &berthv1.ActivationProof{Secret: secret}
	if err := st.Send(&berthv1.InitServerMessage{Msg: &berthv1.InitServerMessage_Proof{Proof: proof}}); err != nil {
		return err
	}
	if msg, err = st.Recv(); err != nil {
		return err
	}
	result, err := initResult(msg.GetRequest())
	if err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	if err := st.Send(&berthv1.InitServerMessage{Msg: &berthv1.InitServerMessage_Result{Result: result}}); err != nil {
		return err
	}
	n.initialized = true
	return nil
}

// initResult is what a node initialized by req returns. The API server it names does not answer (nothing
// listens on port 1), as an API server still starting would not.
func initResult(req *berthv1.InitRequest) (*berthv1.InitResult, error) {
	if req == nil {
		return nil, errors.New("no init request")
	}
	id, err := keys.ClusterIDOf(req.MasterSecret, req.Salt)
	if err != nil {
		return nil, err
	}
	ca, err := pki.ParseCA(req.KubernetesCaCertificate, req.KubernetesCaKey)
	if err != nil {
		return nil, err
	}
	key, err := pki.NewKey()
	if err != nil {
		return nil, err
	}
	cert, err := ca.IssueClient(pki.ClientTemplate{CommonName: "kubernetes-admin", Organization: []string{"system:masters"}},
		key.Public(), time.Now(), time.Hour)
	if err != nil {
		return nil, err
	}
	keyPEM, err := pki.EncodeKeyPEM(key)
	if err != nil {
		return nil, err
	}
	const endpoint = "127.0.0.1:1"
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["lab"] = &clientcmdapi.Cluster{Server: "https://" + endpoint, CertificateAuthorityData: req.KubernetesCaCertificate}
	cfg.AuthInfos["admin"] = &clientcmdapi.AuthInfo{ClientCertificateData: pki.EncodeCertPEM(cert), ClientKeyData: keyPEM}
	cfg.Contexts["admin@lab"] = &clientcmdapi.Context{Cluster: "lab", AuthInfo: "admin"}
	cfg.CurrentContext = "admin@lab"
	kubeconfig, err := clientcmd.Write(*cfg)
	if err != nil {
		return nil, err
	}
	return &berthv1.InitResult{Kubeconfig: kubeconfig, ClusterId: id, ApiServerEndpoint: endpoint}, nil
}

// TestClusterTrustDiagnosticPaths checks where berth_cluster's trust errors land, which Terraform's output
// does not show for attributes inside a block: each bad part of gcp on its own attribute, all at once, none
// on a part not known yet; several trusts on the last one set; none for a block not known yet.
func TestClusterTrustDiagnosticPaths(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var sch fwresource.SchemaResponse
	(&clusterResource{}).Schema(ctx, fwresource.SchemaRequest{}, &sch)
	typ := sch.Schema.Type().TerraformType(ctx).(tftypes.Object)
	str := func(s string) tftypes.Value { return tftypes.NewValue(tftypes.String, s) }
	unknown := func(typ tftypes.Type) tftypes.Value { return tftypes.NewValue(typ, tftypes.UnknownValue) }
	gcp := func(project, zone, instance, ca tftypes.Value) tftypes.Value {
		return tftypes.NewValue(typ.AttributeTypes["gcp"], map[string]tftypes.Value{
			"project": project, "zone": zone, "instance": instance, "ek_ca_certificates": ca})
	}
	noCA := tftypes.NewValue(tftypes.String, nil)
	aws := tftypes.NewValue(typ.AttributeTypes["aws"], map[string]tftypes.Value{
		"instance_id": str("i-0123456789abcdef0"), "region": str("eu-west-1"), "endpoint": tftypes.NewValue(tftypes.String, nil)})

	for _, tc := range []struct {
		name string
		set  map[string]tftypes.Value
		// want is each error's path and a phrase of its detail.
		want map[string]string
	}{
		{"bad parts", map[string]tftypes.Value{"gcp": gcp(str("Berth_Lab"), str("europe-west1"), unknown(tftypes.String), str("not PEM"))},
			map[string]string{
				"gcp.project":            `gcp.project is "Berth_Lab"`,
				"gcp.zone":               `gcp.zone is "europe-west1"`,
				"gcp.ek_ca_certificates": "no certificate in the EK CA bundle",
			}},
		{"numeric instance", map[string]tftypes.Value{"gcp": gcp(str("berth-lab"), str("europe-west1-b"), str("4242"), noCA)}, nil},
		{"unknown gcp", map[string]tftypes.Value{"gcp": unknown(typ.AttributeTypes["gcp"])}, nil},
		{"unknown aws", map[string]tftypes.Value{"aws": unknown(typ.AttributeTypes["aws"])}, nil},
		{"unknown trust beside another", map[string]tftypes.Value{"aws": aws, "ek_ca_certificates": unknown(tftypes.String)}, nil},
		{"no trust", nil, map[string]string{"ek_ca_certificates": "Set ek_ca_certificates"}},
		{"three trusts", map[string]tftypes.Value{"ek_ca_certificates": str("PEM"), "aws": aws,
			"gcp": gcp(str("berth-lab"), str("europe-west1-b"), str("cp-0"), noCA)},
			map[string]string{
				"ek_ca_certificates": "no certificate in the EK CA bundle",
				"gcp":                "ek_ca_certificates, aws and gcp are set",
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			vals := map[string]tftypes.Value{}
			for name, at := range typ.AttributeTypes {
				vals[name] = tftypes.NewValue(at, nil)
				if v, ok := tc.set[name]; ok {
					vals[name] = v
				}
			}
			var resp fwresource.ValidateConfigResponse
			(&clusterResource{}).ValidateConfig(ctx, fwresource.ValidateConfigRequest{
				Config: tfsdk.Config{Schema: sch.Schema, Raw: tftypes.NewValue(typ, vals)}}, &resp)
			got := map[string]string{}
			for _, d := range resp.Diagnostics {
				p, ok := d.(diag.DiagnosticWithPath)
				if !ok || d.Severity() != diag.SeverityError {
					t.Fatalf("diagnostic without a path, or not an error: %s: %s", d.Summary(), d.Detail())
				}
				if _, dup := got[p.Path().String()]; dup {
					t.Errorf("two errors on %s", p.Path())
				}
				got[p.Path().String()] = d.Detail()
			}
			for at, detail := range got {
				if want, ok := tc.want[at]; !ok || !strings.Contains(detail, want) {
					t.Errorf("error on %s: %q; want %q", at, detail, want)
				}
			}
			for at := range tc.want {
				if _, ok := got[at]; !ok {
					t.Errorf("no error on %s", at)
				}
			}
		})
	}
}
