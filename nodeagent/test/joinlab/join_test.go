package joinlab

import (
	"context"
	"crypto/x509"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	bootstrapapi "k8s.io/cluster-bootstrap/token/api"

	"github.com/berthlabs/berth/internal/backoff"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/nodeagent/internal/joinclient"
	"github.com/berthlabs/berth/nodeagent/internal/joinservice"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
	"github.com/berthlabs/berth/nodeagent/internal/statedisk"
)

// TestJoinThreeAgents is the attested join end to end: three agents with their own swtpm and LUKS2 image
// join concurrently over gRPC/TLS on loopback, then one reboots and rejoins.
func TestJoinThreeAgents(t *testing.T) {
	lab := New(t)
	nodes := []*Node{
		lab.AddNode("worker-1", metadata.RoleWorker),
		lab.AddNode("worker-2", metadata.RoleWorker),
		lab.AddNode("cp-1", metadata.RoleControlPlane),
	}
	kubeadm := &Kubeadm{}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	prepared := make([]statedisk.Prepared, len(nodes))
	states := make([]*nodestate.State, len(nodes))
	errs := make([]error, len(nodes))
	var wg sync.WaitGroup
	for i, n := range nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if prepared[i], errs[i] = n.Disk.Prepare(ctx); errs[i] != nil {
				return
			}
			states[i], errs[i] = lab.JoinClient(n, kubeadm, &nodestate.Lock{}).Join(ctx, prepared[i])
		}()
	}
	wg.Wait()
	for i, n := range nodes {
		if errs[i] != nil {
			t.Fatal(lab.Logs.Logf("%s: %v", n.Name, errs[i]))
		}
	}

	for i, n := range nodes {
		t.Run(n.Name, func(t *testing.T) {
			p := prepared[i]
			if !p.Fresh || p.InitialKey == nil {
				t.Fatalf("a new disk must be fresh with an initial key: %+v", p)
			}
			key := lab.DiskKey(p.UUID)
			if !opensWith(t, n.Volume.Path(), key) {
				t.Error("state disk does not open with the derived key")
			}
			if opensWith(t, n.Volume.Path(), p.InitialKey) {
				t.Error("state disk still opens with the initial passphrase")
			}
			if st := states[i]; st.NodeName != n.Name || st.Role != string(n.Role) || st.Via != nodestate.OwnerJoin {
				t.Errorf("node state %+v", st)
			}
			checkKubeletCert(t, lab, n)
			_, err := os.Stat(filepath.Join(n.Paths.PKIDir(), "ca.key"))
			if gotCPFiles := err == nil; gotCPFiles != (n.Role == metadata.RoleControlPlane) {
				t.Errorf("control-plane files present = %v for role %s", gotCPFiles, n.Role)
			}
		})
	}

	if len(kubeadm.Joins) != len(nodes) {
		t.Fatalf("kubeadm join ran %d times, want %d", len(kubeadm.Joins), len(nodes))
	}
	for _, n := range nodes {
		if !slices.ContainsFunc(kubeadm.Joins, func(cfg string) bool { return strings.Contains(cfg, "name: "+n.Name+"\n") }) {
			t.Errorf("no kubeadm join configuration names %s", n.Name)
		}
	}
	checkTokens(t, lab, len(nodes))

	t.Run("reboot rejoins with the same disk key", func(t *testing.T) {
		n := nodes[0]
		again, err := n.Disk.Prepare(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if again.Fresh || again.UUID != prepared[0].UUID {
			t.Fatalf("a keyed disk must not be fresh after reboot: %+v", again)
		}
		ticket, err := lab.JoinClient(n, kubeadm, &nodestate.Lock{}).Rejoin(ctx, again.UUID)
		if err != nil {
			t.Fatal(lab.Logs.Logf("rejoin: %v", err))
		}
		if err := n.Disk.SetKey(ctx, nil, ticket.DiskKey); err != nil {
			t.Fatalf("unlocking with the rejoin key: %v", err)
		}
		if !opensWith(t, n.Volume.Path(), lab.DiskKey(again.UUID)) {
			t.Fatal("disk does not open with the rejoin ticket's key")
		}
	})
}

// JoinClient is a node's join client as berth-agent wires it, retrying quickly.
func (l *Lab) JoinClient(n *Node, kubeadm *Kubeadm, lock *nodestate.Lock) *joinclient.Client {
	return l.joinClientWith(n, l.Metadata(n), kubeadm, lock)
}

// joinClientWith is JoinClient with the node's view of its metadata given.
func (l *Lab) joinClientWith(n *Node, meta *metadata.Client, kubeadm *Kubeadm, lock *nodestate.Lock) *joinclient.Client {
	return joinclient.New(joinclient.Config{
		Metadata:  meta,
		Prover:    n.Prover,
		Disk:      n.Disk,
		Lock:      lock,
		Kubeadm:   kubeadm,
		Paths:     n.Paths,
		LocalAddr: n.Addr,
		Backoff:   backoff.Policy{Initial: 50 * time.Millisecond, Max: 500 * time.Millisecond},
		Logger:    slog.New(slog.NewTextHandler(l.Logs, nil)).With("agent", n.Name),
	})
}

// refusedJoin has n try to join for a few seconds, and fails the test (with joined) when it joins, when the
// service's log lacks why, or when the node's disk lost its initial key.
func refusedJoin(ctx context.Context, t *testing.T, lab *Lab, n *Node, kubeadm *Kubeadm, joined, why string) {
	t.Helper()
	prepared, err := n.Disk.Prepare(ctx)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	if _, err := lab.JoinClient(n, kubeadm, &nodestate.Lock{}).Join(ctx, prepared); err == nil {
		t.Fatal(joined)
	}
	if !strings.Contains(lab.Logs.String(), why) {
		t.Error(lab.Logs.Logf("the refusal does not say why"))
	}
	if !opensWith(t, n.Volume.Path(), prepared.InitialKey) {
		t.Error("the refused node's disk lost its initial key")
	}
}

func opensWith(t *testing.T, image string, key []byte) bool {
	t.Helper()
	cmd := exec.Command("cryptsetup", "luksOpen", "--test-passphrase", "--key-file=-", image)
	cmd.Stdin = strings.NewReader(string(key))
	out, err := cmd.CombinedOutput()
	if ee, ok := err.(*exec.ExitError); ok && ee.ExitCode() == 2 {
		return false
	}
	if err != nil {
		t.Fatalf("cryptsetup luksOpen --test-passphrase: %v: %s", err, out)
	}
	return true
}

func checkKubeletCert(t *testing.T, lab *Lab, n *Node) {
	t.Helper()
	cert := readKubeletCert(t, n)
	roots := x509.NewCertPool()
	roots.AddCert(lab.KubeCA.Cert)
	if _, err := cert.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		t.Errorf("kubelet certificate does not verify against the cluster CA: %v", err)
	}
	if cert.Subject.CommonName != "system:node:"+n.Name {
		t.Errorf("CN %q", cert.Subject.CommonName)
	}
	if diff := cmp.Diff([]string{"system:nodes"}, cert.Subject.Organization); diff != "" {
		t.Errorf("O (-want +got):\n%s", diff)
	}
	if len(cert.IPAddresses) != 1 || !cert.IPAddresses[0].Equal(net.IP(n.Addr.AsSlice())) {
		t.Errorf("IP SANs %v, want [%s]", cert.IPAddresses, n.Addr)
	}
	if len(cert.DNSNames)+len(cert.EmailAddresses)+len(cert.URIs) != 0 {
		t.Errorf("extra SANs %v %v %v", cert.DNSNames, cert.EmailAddresses, cert.URIs)
	}
}

func checkTokens(t *testing.T, lab *Lab, want int) {
	t.Helper()
	secrets, err := lab.Kube.CoreV1().Secrets(joinservice.Namespace).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, s := range secrets.Items {
		if s.Type != bootstrapapi.SecretTypeBootstrapToken {
			continue
		}
		n++
		exp, err := time.Parse(time.RFC3339, s.StringData[bootstrapapi.BootstrapTokenExpirationKey])
		if err != nil {
			t.Fatalf("token %s expiration: %v", s.Name, err)
		}
		if ttl := time.Until(exp); ttl <= 0 || ttl > 10*time.Minute {
			t.Errorf("token %s lives %v: bootstrap tokens must live minutes", s.Name, ttl)
		}
	}
	if n != want {
		t.Errorf("%d bootstrap tokens, want one per ticket (%d)", n, want)
	}
}
