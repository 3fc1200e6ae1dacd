package lab

import (
	"context"
	"crypto/rand"
	"crypto/x509"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	bootstrapapi "k8s.io/cluster-bootstrap/token/api"
	"sigs.k8s.io/yaml"

	"github.com/berthlabs/berth/internal/cloudinit"
	"github.com/berthlabs/berth/internal/clustersecrets"
	"github.com/berthlabs/berth/internal/keys"
	"github.com/berthlabs/berth/internal/luks"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/internal/repotest"
	"github.com/berthlabs/berth/test/cfssltest"
	"github.com/berthlabs/berth/test/kubetest"
)

// TestExternalControlPlane is docs/external-control-plane.md run for real: a control plane kubeadm did not
// make (kube-apiserver and kube-controller-manager on the lab host, Node,RBAC), its CA held by a real `cfssl
// serve` with a sqlite certificate database, and the Berth join service beside it as a process with its
// configuration file, least-privilege credentials, an inventory and the secrets of a root key. A bare-metal
// lab node boots with the cloud-config berth_node_config renders for it (no metadata service: user-data
// file, hostname), attests, and its agent writes the kubelet's files itself (no kubeadm on the way):
//   - with a wrong CFSSL auth key the operator's log says CFSSL refused authentication, the node retries
//     and its state disk is not rekeyed;
//   - with CFSSL down the log says it is unreachable, and again the disk keeps its key;
//   - with CFSSL back the Node registers and becomes Ready, its kubelet's client certificate is issued by
//     the CFSSL CA and recorded in cfssl's database, and the disk opens with its derived key alone.
func TestExternalControlPlane(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	var l *Lab
	c := labTest(t, func(c Config) (err error) {
		l, err = StartHost(ctx, c.HostConfig)
		return err
	})
	agent := c.AgentBinary

	// The external control plane: its CA's key lives in CFSSL (and here, for the test's own certificates).
	clusterCA, err := pki.NewCA("external-cluster-ca", time.Now(), 48*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	// Kubelet certificates live two minutes, so that the node renews its own within the test: long enough for
	// a join and a Ready node under load, short enough not to make the test wait for most of its time.
	signer := cfssltest.StartWith(t, cfssltest.Options{CA: clusterCA, KubeletExpiry: "2m", KubeletBackdate: "30s"})
	api := kubetest.StartWith(t, kubetest.Options{Address: hostAddr, CA: clusterCA, ControllerManager: true})
	// The join service's identity gets the Role and RoleBinding of the document, ConfigMaps in kube-system
	// and nothing else.
	api.CreateRBAC(t, repotest.MarkdownBlock(t, "docs/external-control-plane.md", "kind: Role"))

	svc := newExternalService(t, l, agent, api, signer, clusterCA)
	wrongKey := make([]byte, len(signer.AuthKey))
	rand.Read(wrongKey)
	svc.start(t, hex.EncodeToString(wrongKey))

	node, err := l.AddNode(ctx, Machine{Name: "metal-1", Role: metadata.RoleWorker, Addr: netip.MustParseAddr("10.250.0.30"),
		Image: ImageNames[0], CloudInit: svc.cloudInit(t, "metal-1")})
	if err != nil {
		t.Fatal(err)
	}
	// An external control plane brings its own pod network; this one runs no scheduler for a DaemonSet's
	// pods, so its one node gets what a lone node needs to be Ready: a bridge of its own.
	bridge := `{"cniVersion": "0.3.1", "name": "bridge", "plugins": [{"type": "bridge", "bridge": "cni0", "isGateway": true,
  "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.244.30.0/24"}]]}}]}`
	if err := os.WriteFile(node.path("fs/etc/cni/net.d/10-bridge.conflist"), []byte(bridge), 0o644); err != nil {
		t.Fatal(err)
	}

	// By the time the service refuses the node, the agent has formatted its state disk.
	svc.waitLog(t, "refused authentication")
	disk := luks.New(node.path("state.img"), nil)
	uuid, err := disk.UUID(ctx)
	if err != nil {
		t.Fatal(err)
	}
	label, err := keys.DiskLabel(uuid)
	if err != nil {
		t.Fatal(err)
	}
	diskKey, err := keys.Derive(svc.secrets.MasterSecret, svc.secrets.Salt, label, 32)
	if err != nil {
		t.Fatal(err)
	}
	waitFile(t, node.path("logs/agent.log"), "retrying join ticket")
	checkNotRekeyed(t, disk, diskKey)
	if log := svc.log(t); strings.Contains(log, hex.EncodeToString(wrongKey)) || strings.Contains(log, signer.AuthKeyHex) {
		t.Error("the join service logged a CFSSL auth key")
	}

	signer.Stop()
	svc.restart(t, signer.AuthKeyHex)
	svc.waitLog(t, "is unreachable")
	checkNotRekeyed(t, disk, diskKey)

	signer.Restart(t)
	var ready *corev1.Node
	for deadline := time.Now().Add(5 * time.Minute); ready == nil; time.Sleep(time.Second) {
		if n, err := api.Client.CoreV1().Nodes().Get(ctx, "metal-1", metav1.GetOptions{}); err == nil && nodeReady(n) {
			ready = n
		}
		if time.Now().After(deadline) {
			t.Fatal(l.nodeFailure(node, "register", fmt.Errorf("node metal-1 not Ready\n--- join service log ---\n%s", tail(svc.log(t), 30))))
		}
		if err := node.agentGone(); err != nil {
			t.Fatal(l.nodeFailure(node, "boot", err))
		}
	}
	if !nodeHasAddress(ready, "10.250.0.30") {
		t.Errorf("node metal-1 registered with addresses %v, want its own 10.250.0.30", ready.Status.Addresses)
	}

	cert, err := node.KubeletClientCert()
	if err != nil {
		t.Fatal(err)
	}
	if err := cert.CheckSignatureFrom(clusterCA.Cert); err != nil || cert.Issuer.String() != clusterCA.Cert.Subject.String() {
		t.Errorf("kubelet certificate issued by %q is not the CFSSL CA's: %v", cert.Issuer, err)
	}
	if rec, ok := signer.Recorded(t, cert.SerialNumber); !ok || rec.Status != "good" || rec.CommonName != "system:node:metal-1" {
		t.Errorf("cfssl's database has %+v (found %v) for the kubelet's serial %s", rec, ok, cert.SerialNumber.Text(16))
	}
	if slot, err := disk.KeySlot(ctx, diskKey); err != nil {
		t.Errorf("the state disk does not open with its derived key: %v", err)
	} else if slots, err := disk.Slots(ctx); err != nil || len(slots) != 1 || slots[0] != slot {
		t.Errorf("the state disk has key slots %v (%v), want the derived key's (%d) alone", slots, err, slot)
	}
	agentLog, err := os.ReadFile(node.path("logs/agent.log"))
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(agentLog), `"msg":"running kubeadm"`) || !strings.Contains(string(agentLog), "the kubelet registers the node") {
		t.Error("the node did not join by writing the kubelet's files itself")
	}
	secrets, err := api.Client.CoreV1().Secrets("kube-system").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range secrets.Items {
		if s.Type == bootstrapapi.SecretTypeBootstrapToken {
			t.Errorf("bootstrap token %s exists: a kubelet-method join needs none", s.Name)
		}
	}
	if _, err := api.Client.CoreV1().ConfigMaps("kube-system").Get(ctx, "berth-disk-"+uuid, metav1.GetOptions{}); err != nil {
		t.Errorf("the join service's record of the disk's TPM: %v", err)
	}
	checkRenewal(ctx, t, l, node, api, signer, cert)
	checkExternalMetrics(t)
	t.Logf("node metal-1 Ready; join service log:\n%s", tail(svc.log(t), 15))
}

// checkExternalMetrics reads the external join service's metrics and readiness: it is ready, and counts the
// join and the renewal it served.
func checkExternalMetrics(t *testing.T) {
	t.Helper()
	base := "http://" + net.JoinHostPort(hostAddr.String(), fmt.Sprint(externalMetricsPort))
	get := func(path string) (int, string) {
		resp, err := http.Get(base + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		return resp.StatusCode, string(body)
	}
	if code, body := get("/readyz"); code != http.StatusOK {
		t.Errorf("the external join service's /readyz: %d %s", code, body)
	}
	_, metrics := get("/metrics")
	for _, line := range []string{`berth_join_tickets_issued_total{call="join"} `, `berth_join_tickets_issued_total{call="renew"} `,
		"berth_build_info{", "berth_join_policy_loaded 1"} {
		if !strings.Contains(metrics, line) {
			t.Errorf("the external join service's metrics lack %q", line)
		}
	}
	for _, none := range []string{`berth_join_tickets_issued_total{call="join"} 0`, `berth_join_tickets_issued_total{call="renew"} 0`} {
		if strings.Contains(metrics, none+"\n") {
			t.Errorf("the external join service's metrics say %q, though the node joined and renewed its certificate", none)
		}
	}
}

// checkRenewal waits until the node's agent has renewed the kubelet's client certificate through the join
// service (no kubeadm, no CSR signer in the cluster: nothing else would), checks the new one is recorded by
// CFSSL, and that the kubelet still talks to the API server with it after the first one expired.
func checkRenewal(ctx context.Context, t *testing.T, l *Lab, node *Node, api *kubetest.APIServer, signer *cfssltest.Server, first *x509.Certificate) {
	t.Helper()
	var renewed *x509.Certificate
	for deadline := first.NotAfter; renewed == nil; time.Sleep(time.Second) {
		if cert, err := node.KubeletClientCert(); err == nil && cert.SerialNumber.Cmp(first.SerialNumber) != 0 {
			renewed = cert
		}
		if time.Now().After(deadline) {
			t.Fatal(l.nodeFailure(node, "kubelet certificate renewal", fmt.Errorf("the certificate %s was not renewed before it expired at %v", first.SerialNumber.Text(16), first.NotAfter)))
		}
	}
	if rec, ok := signer.Recorded(t, renewed.SerialNumber); !ok || rec.CommonName != "system:node:metal-1" {
		t.Errorf("cfssl's database has %+v (found %v) for the renewed serial %s", rec, ok, renewed.SerialNumber.Text(16))
	}
	// The kubelet renews its lease every 10 s with its client certificate: a renewal after the first
	// certificate expired was made with the new one.
	for deadline := first.NotAfter.Add(time.Minute); ; time.Sleep(2 * time.Second) {
		lease, err := api.Client.CoordinationV1().Leases("kube-node-lease").Get(ctx, "metal-1", metav1.GetOptions{})
		if err == nil && lease.Spec.RenewTime != nil && lease.Spec.RenewTime.After(first.NotAfter.Add(5*time.Second)) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal(l.nodeFailure(node, "kubelet after its first certificate expired", fmt.Errorf("node lease not renewed after %v: %v", first.NotAfter, err)))
		}
	}
	n, err := api.Client.CoreV1().Nodes().Get(ctx, "metal-1", metav1.GetOptions{})
	if err != nil || !nodeReady(n) {
		t.Errorf("node metal-1 after its first kubelet certificate expired: Ready %v (%v)", n != nil && nodeReady(n), err)
	}
	t.Logf("kubelet certificate %s renewed as %s (not after %v); the kubelet renewed its lease past the first one's expiry",
		first.SerialNumber.Text(16), renewed.SerialNumber.Text(16), renewed.NotAfter)
}

// externalService is the join service beside the external control plane, as its systemd unit runs it.
type externalService struct {
	dir, agent string
	config     map[string]any
	secrets    *clustersecrets.Secrets
	joinPin    string
	cmd        *exec.Cmd
}

const externalJoinPort = 7450

// externalMetricsPort is where the external join service serves its metrics (join-service.yaml metricsListen).
const externalMetricsPort = 9452

func newExternalService(t *testing.T, l *Lab, agent string, api *kubetest.APIServer, signer *cfssltest.Server, clusterCA *pki.CA) *externalService {
	t.Helper()
	dir := t.TempDir()
	write := func(name string, data []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, data, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	// The operator's root key, as berth_secrets was made with it; the join CA certificate is its output.
	root := make([]byte, 32)
	rand.Read(root)
	secrets, err := clustersecrets.Derive(root)
	if err != nil {
		t.Fatal(err)
	}
	_, joinCA, err := secrets.NewCAs(time.Now(), 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	image := ImageNames[0]
	pol, err := (&policy.Policy{Images: []policy.Image{{Name: image, PCRs: PredictedPCRs(image), Roles: []metadata.Role{metadata.RoleWorker}}}}).Marshal()
	if err != nil {
		t.Fatal(err)
	}
	inventory := "- name: metal-1\n  role: worker\n  addresses: [10.250.0.30]\n"
	_, apiPort, err := net.SplitHostPort(strings.TrimPrefix(api.URL, "https://"))
	if err != nil {
		t.Fatal(err)
	}
	s := &externalService{dir: dir, agent: agent, secrets: secrets, joinPin: pki.SPKIPin(joinCA.Cert)}
	s.config = map[string]any{
		"listen":            net.JoinHostPort(hostAddr.String(), fmt.Sprint(externalJoinPort)),
		"inventoryFile":     write("inventory.yaml", []byte(inventory)),
		"apiServerEndpoint": net.JoinHostPort(hostAddr.String(), apiPort),
		"kubeconfig":        write("join-service.kubeconfig", api.ClientKubeconfig(t, "berth-join-service")),
		"kubernetesCA":      write("ca.crt", clusterCA.CertPEM()),
		"cfssl":             map[string]string{"url": signer.URL, "profile": signer.Profile, "authKeyFile": filepath.Join(dir, "cfssl-auth-key")},
		"rootKeyFile":       write("root-key", []byte(base64.StdEncoding.EncodeToString(root)+"\n")),
		"joinCACertificate": write("join-ca.crt", joinCA.CertPEM()),
		"ekCABundle":        l.EKCAPath(),
		"policyFile":        write("join-policy.yaml", pol),
		"clusterDNS":        []string{"10.96.0.10"},
		"clusterDomain":     "cluster.local",
		"metricsListen":     net.JoinHostPort(hostAddr.String(), fmt.Sprint(externalMetricsPort)),
	}
	data, err := yaml.Marshal(s.config)
	if err != nil {
		t.Fatal(err)
	}
	write("join-service.yaml", data)
	t.Cleanup(s.stop)
	return s
}

// cloudInit is what berth_node_config with bare_metal and hostname renders for the node.
func (s *externalService) cloudInit(t *testing.T, hostname string) string {
	t.Helper()
	_, doc, err := cloudinit.Render(metadata.UserData{ClusterName: "metal", JoinPort: externalJoinPort, JoinCAPin: s.joinPin,
		JoinEndpoints: []string{net.JoinHostPort(hostAddr.String(), fmt.Sprint(externalJoinPort))}}, hostname)
	if err != nil {
		t.Fatal(err)
	}
	return doc
}

// start runs `berth-agent joinservice --service-config` with authKeyHex in the CFSSL auth key file.
func (s *externalService) start(t *testing.T, authKeyHex string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(s.dir, "cfssl-auth-key"), []byte(authKeyHex+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := os.OpenFile(filepath.Join(s.dir, "join-service.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	cmd := exec.Command(s.agent, "joinservice", "--service-config", filepath.Join(s.dir, "join-service.yaml"))
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	s.cmd = cmd
	s.waitLog(t, `"msg":"join service listening"`)
}

func (s *externalService) restart(t *testing.T, authKeyHex string) {
	t.Helper()
	s.stop()
	if err := os.Truncate(filepath.Join(s.dir, "join-service.log"), 0); err != nil {
		t.Fatal(err)
	}
	s.start(t, authKeyHex)
}

func (s *externalService) stop() {
	if s.cmd == nil {
		return
	}
	s.cmd.Process.Signal(syscall.SIGTERM)
	s.cmd.Wait()
	s.cmd = nil
}

func (s *externalService) log(t *testing.T) string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(s.dir, "join-service.log"))
	if err != nil {
		t.Fatal(err)
	}
	return string(data)
}

func (s *externalService) waitLog(t *testing.T, text string) {
	t.Helper()
	waitFile(t, filepath.Join(s.dir, "join-service.log"), text)
}

// waitFile waits until the file at path contains text.
func waitFile(t *testing.T, path, text string) {
	t.Helper()
	deadline := time.Now().Add(3 * time.Minute)
	for {
		data, _ := os.ReadFile(path)
		if strings.Contains(string(data), text) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %q in %s:\n%s", text, path, tail(string(data), 30))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// checkNotRekeyed fails when the node's state disk took the derived key although no ticket was issued.
func checkNotRekeyed(t *testing.T, disk *luks.Volume, diskKey []byte) {
	t.Helper()
	if _, err := disk.KeySlot(context.Background(), diskKey); !errors.Is(err, luks.ErrWrongKey) {
		t.Fatalf("the state disk was rekeyed although no ticket was issued (derived key: %v)", err)
	}
	if slots, err := disk.Slots(context.Background()); err != nil || len(slots) != 1 {
		t.Fatalf("the state disk has key slots %v (%v), want its initial key's alone", slots, err)
	}
}

func nodeHasAddress(n *corev1.Node, addr string) bool {
	for _, a := range n.Status.Addresses {
		if a.Type == corev1.NodeInternalIP && a.Address == addr {
			return true
		}
	}
	return false
}
