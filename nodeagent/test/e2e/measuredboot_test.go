package e2e

import (
	"bufio"
	"cmp"
	"context"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/manifest"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/internal/repotest"
	"github.com/berthlabs/berth/internal/rpc"
	"github.com/berthlabs/berth/internal/uki/ukitest"
	"github.com/berthlabs/berth/nodeagent/internal/joinservice"
	"github.com/berthlabs/berth/test/clustertest"
	"github.com/berthlabs/berth/test/kubetest"
	"github.com/berthlabs/berth/test/measuredboot"
	"github.com/berthlabs/berth/test/packertest"
	"github.com/berthlabs/berth/test/swtpm/swtpmtest"
)

// The guest's view of the host (testdata/agent.yaml): the instance metadata, and the control-plane node
// whose join service it dials. Each is a QEMU guest forward to a loopback port of this test.
var (
	metadataGuest = netip.MustParseAddrPort("10.0.2.100:80")
	joinGuestAddr = netip.MustParseAddr("10.0.2.101")
	// QEMU's user network reaches the host from 127.0.0.1: that is the node's address as the host sees it.
	nodeAddr = netip.MustParseAddr("127.0.0.1")
)

const (
	imageName = "berth-attest-local"
	cmdline   = "console=ttyS0 panic=-1 quiet"
	// changedCmdline differs from cmdline in one byte.
	changedCmdline = "console=ttyS0 panic=-2 quiet"
)

// TestMeasuredBootJoin builds the image of testdata/attest.pkr.hcl with the real packer, and the
// same image with one byte of its kernel command line changed. A join service on the host, backed by a real
// kube-apiserver and knowing nothing of the image but berth-image.json, then sees the first image's agent
// attest from a QEMU boot (OVMF, swtpm) and issues it a ticket, its quoted PCR 4, 9, 11 and 12 being the
// predicted ones. The node seals its disk key to that policy, and boots again with no join service
// running: it unseals at the PCRs of the real boot, mounts its state disk (dm-crypt in the guest) and
// reads back the membership it wrote there. The changed image is refused, naming PCR 4 with the expected
// and the quoted value.
func TestMeasuredBootJoin(t *testing.T) {
	if os.Getenv("BERTH_E2E") == "" {
		t.Skip("end-to-end test with the real packer, QEMU and kube-apiserver: make e2e-measured-boot runs it (BERTH_E2E=1)")
	}
	repotest.NeedsRoot(t, "the image build runs mmdebstrap and the provisioners' chroot")
	clock := &stages{t: t}
	t.Cleanup(clock.print)
	dir := t.TempDir()
	repo := repotest.Root(t)

	clock.start("tools: packer plugin, boot parts, guest root, static berth-agent")
	packertest.Setup(t)
	parts := ukitest.BootParts(t)
	root := ukitest.GuestRoot(t)
	agent := repotest.BuildBinary(t, "./nodeagent/cmd/berth-agent", "")
	if out, err := packer(t, repo, "init", "attest.pkr.hcl"); err != nil {
		t.Fatalf("packer init: %v\n%s", err, out)
	}

	images := map[string]*manifest.Image{}
	for _, c := range []struct{ name, cmdline string }{{"image", cmdline}, {"one-byte-changed", changedCmdline}} {
		clock.start("packer build: " + c.name)
		out := filepath.Join(dir, c.name)
		manifestPath := filepath.Join(dir, c.name+".json")
		log, err := packer(t, repo, "build",
			"-var", "stub="+parts.Stub, "-var", "kernel="+parts.Kernel, "-var", "root_directory="+root,
			"-var", "agent_binary="+agent, "-var", "cmdline="+c.cmdline,
			"-var", "output_directory="+out, "-var", "manifest="+manifestPath, "attest.pkr.hcl")
		if err != nil {
			t.Fatalf("packer build of %s: %v\n%s", c.name, err, log)
		}
		data, err := os.ReadFile(manifestPath)
		if err != nil {
			t.Fatal(err)
		}
		m, err := manifest.Parse(data)
		if err != nil {
			t.Fatal(err)
		}
		img, ok := m.Image(imageName)
		if !ok {
			t.Fatalf("%s names no image %s", manifestPath, imageName)
		}
		images[c.name] = &img
	}
	for _, i := range []string{"4", "9", "11"} {
		if images["image"].PCRs[i] == images["one-byte-changed"].PCRs[i] {
			t.Errorf("one byte of the command line left the prediction of PCR %s as it was", i)
		}
	}

	clock.start("host: kube-apiserver, metadata, join service knowing only berth-image.json")
	cluster := startHost(t, images["image"])

	clock.start("boot: image → attested, accepted, disk key sealed")
	accepted := cluster.boot(t, filepath.Join(dir, "image", "berth.raw"), filepath.Join(dir, "boot-image"), true, `"msg":"disk key sealed to the join policy"`)
	if accepted.decision != "join ticket issued" || accepted.image != imageName {
		t.Fatalf("the join service's decision on the image: %s (image %q, reason %q), want a ticket for %s", accepted.decision, accepted.image, accepted.reason, imageName)
	}
	for _, i := range []int{4, 9, 11, 12} {
		want := images["image"].PCRs[strconv.Itoa(i)]
		if got := accepted.quoted[strconv.Itoa(i)]; got != want {
			t.Errorf("PCR %d: the TPM quoted %s in that boot, berth-manifest predicted %s", i, got, want)
		}
	}
	if !strings.Contains(accepted.console, `"msg":"join ticket received"`) {
		t.Errorf("the agent in the guest did not log the ticket it received:\n%s", tail(accepted.console, 40))
	}

	// The same machine boots again with no join service anywhere: its key, sealed to the policy computed
	// from the predicted PCRs, unseals at the PCRs of a real measured boot, and the membership record it
	// wrote on the mounted state disk in the first boot is read back.
	clock.start("boot: the same machine again, no join service → unlocked from its TPM")
	cluster.stopJoins()
	again := cluster.boot(t, filepath.Join(dir, "image", "berth.raw"), filepath.Join(dir, "boot-image"), false, `"msg":"node rejoined"`)
	for _, want := range []string{`"msg":"state disk unlocked from the TPM"`, `"image":"` + imageName + `"`, `"msg":"state disk mounted"`} {
		if !strings.Contains(again.console, want) {
			t.Errorf("the second boot's console lacks %s:\n%s", want, tail(again.console, 40))
		}
	}
	if strings.Contains(again.console, "rejoin ticket received") || strings.Contains(again.console, "join ticket received") {
		t.Error("the second boot got a ticket, with no join service running")
	}
	cluster.startJoins(t)

	clock.start("boot: one-byte-changed image → refused")
	refused := cluster.boot(t, filepath.Join(dir, "one-byte-changed", "berth.raw"), filepath.Join(dir, "boot-changed"), true, "measurements refused")
	if refused.decision != "measurements refused" {
		t.Fatalf("the join service's decision on the changed image: %s (image %q), want it refused", refused.decision, refused.image)
	}
	want := fmt.Sprintf("PCR 4: expected %s, got %s", images["image"].PCRs["4"], images["one-byte-changed"].PCRs["4"])
	reason := refused.reason
	if !strings.Contains(reason, want) {
		t.Errorf("the refusal says %q, want it to name %q", reason, want)
	}
	if n := cluster.joinLog.count("join ticket issued"); n != 1 {
		t.Errorf("%d tickets issued in all, want only the accepted image's", n)
	}
	// PCR values are no secret: the node's own log says why it was refused, for whoever reads its console.
	if !strings.Contains(refused.console, "PCR 4: expected") {
		t.Errorf("the refused node's console does not say which PCR differed:\n%s", tail(refused.console, 20))
	}
	t.Logf("join service: %s", reason)
}

// host is the cluster side of the test: what the guest reaches through QEMU's forwards.
type host struct {
	forwards []measuredboot.Forward
	ekCA     *swtpmtest.CA
	joinLog  *logLines
	// The join service, which stopJoins and startJoins take away and bring back on the same address.
	joinAddr string
	cert     tls.Certificate
	svc      *joinservice.Server
	srv      *grpc.Server
}

func startHost(t *testing.T, img *manifest.Image) *host {
	api := kubetest.Start(t)

	// The policy is berth-image.json's prediction and nothing else.
	pcrs := map[int][]byte{}
	for i, v := range img.PCRs {
		idx, err := strconv.Atoi(i)
		if err != nil {
			t.Fatal(err)
		}
		if pcrs[idx], err = hex.DecodeString(v); err != nil {
			t.Fatal(err)
		}
	}
	pol := &policy.Policy{Images: []policy.Image{{Name: img.Name, Roles: []metadata.Role{metadata.RoleWorker}, PCRs: pcrs}}}
	if err := pol.Validate(); err != nil {
		t.Fatal(err)
	}

	joinLis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	joinPort := joinLis.Addr().(*net.TCPAddr).Port
	c := clustertest.New(t, clustertest.Options{Name: "e2e", JoinPort: uint16(joinPort), ControlPlaneAddr: joinGuestAddr,
		KubernetesCA: api.CA})
	c.AddInstances(metadata.Instance{Name: "node-0", Role: metadata.RoleWorker, Addresses: []netip.Addr{nodeAddr}})
	metaAddr := strings.TrimPrefix(c.MetaURL, "http://")

	h := &host{ekCA: c.EKCA, joinLog: &logLines{}}
	// Tickets of the kubelet method let the node finish its join in the guest, which has no kubeadm: the
	// agent writes the kubelet's files and its membership, and then seals its disk key.
	svc, err := joinservice.New(joinservice.Config{
		Verifier:          attest.NewVerifier(attest.NewCertChain(c.EKCA.Roots(), c.EKCA.Intermediates(), nil)),
		Policy:            policy.NewStore(pol),
		Instances:         &metadata.Client{BaseURL: c.MetaURL},
		Method:            berthv1.JoinMethod_JOIN_METHOD_KUBELET,
		Kubelet:           &berthv1.KubeletSettings{ClusterDns: []string{"10.96.0.10"}, ClusterDomain: "cluster.local"},
		Disks:             &joinservice.KubeDisks{Client: api.Client},
		MasterSecret:      c.Master,
		Salt:              c.Salt,
		KubernetesCA:      api.CA,
		APIServerEndpoint: strings.TrimPrefix(api.URL, "https://"),
		KubernetesVersion: repotest.KubernetesVersion,
		Logger:            slog.New(slog.NewJSONHandler(h.joinLog, &slog.HandlerOptions{Level: slog.LevelDebug})),
	})
	if err != nil {
		t.Fatal(err)
	}
	key, err := pki.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := c.JoinCA.IssueServer(key.Public(), []string{"cp-0"}, []net.IP{joinGuestAddr.AsSlice()}, time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	// The chain goes with the leaf: the node holds only the join CA's pin.
	h.cert = tls.Certificate{Certificate: [][]byte{leaf.Raw, c.JoinCA.Cert.Raw}, PrivateKey: key, Leaf: leaf}
	h.svc, h.joinAddr = svc, joinLis.Addr().String()
	h.serve(joinLis)
	t.Cleanup(h.stopJoins)

	h.forwards = []measuredboot.Forward{
		{Guest: metadataGuest, Host: metaAddr},
		{Guest: netip.AddrPortFrom(joinGuestAddr, uint16(joinPort)), Host: joinLis.Addr().String()},
	}
	return h
}

func (h *host) serve(lis net.Listener) {
	h.srv = grpc.NewServer(rpc.ServerOptions(h.cert)...)
	berthv1.RegisterJoinServiceServer(h.srv, h.svc)
	go h.srv.Serve(lis)
}

// stopJoins takes the join service away: its port refuses connections.
func (h *host) stopJoins() { h.srv.Stop() }

// startJoins brings the join service back on its address.
func (h *host) startJoins(t *testing.T) {
	lis, err := net.Listen("tcp", h.joinAddr)
	if err != nil {
		t.Fatal(err)
	}
	h.serve(lis)
}

// bootResult is what one boot showed.
type bootResult struct {
	console string
	// decision is the join service's first answer to the node: "join ticket issued" or a refusal's message,
	// with the image it matched and the refusal's reason.
	decision, image, reason string
	// quoted are the PCR values of the quote the join service verified, as hex by index.
	quoted map[string]string
}

// boot boots disk until the guest's console shows consoleWant and, for a fresh machine (a newly
// manufactured TPM and an empty state disk in dir), the join service has decided on the node; otherwise it
// boots the machine of an earlier boot in dir again, TPM state and state disk as that boot left them. It
// returns what the boot showed.
func (h *host) boot(t *testing.T, disk, dir string, fresh bool, consoleWant string) bootResult {
	t.Helper()
	const timeout = 8 * time.Minute
	state := filepath.Join(dir, "tpm")
	stateDisk := filepath.Join(dir, "state.img")
	if fresh {
		if err := os.MkdirAll(state, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := h.ekCA.Manufacture(state); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(stateDisk, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(stateDisk, 64<<20); err != nil {
			t.Fatal(err)
		}
	}
	seen := h.joinLog.len()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	console := &logLines{}
	m := measuredboot.Machine{Disk: disk, Dir: dir, TPMState: state, Disks: []string{stateDisk}, Forwards: h.forwards, Console: console}
	booted := make(chan error, 1)
	start := time.Now()
	go func() {
		_, err := m.Boot(ctx)
		booted <- err
	}()
	res := bootResult{quoted: map[string]string{}}
	decided := func() bool {
		if !fresh {
			return true
		}
		for _, line := range h.joinLog.lines()[seen:] {
			msg, _ := line["msg"].(string)
			switch {
			case msg == "quote verified":
				if pcrs, ok := line["pcrs"].(map[string]any); ok {
					for i, v := range pcrs {
						res.quoted[i], _ = v.(string)
					}
				}
			case msg == "join ticket issued" || strings.HasSuffix(msg, "refused"):
				res.decision = msg
				res.image, _ = line["image"].(string)
				res.reason, _ = line["reason"].(string)
				return true
			}
		}
		return false
	}
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	for !decided() || !strings.Contains(console.String(), consoleWant) {
		select {
		case err := <-booted:
			t.Fatalf("the machine stopped before the join service decided (%v); console:\n%s", err, tail(console.String(), 60))
		case <-ctx.Done():
			t.Fatalf("no decision of the join service and no %q on the console in %v; console:\n%s\njoin service:\n%s",
				consoleWant, timeout, tail(console.String(), 60), tail(h.joinLog.String(), 20))
		case <-tick.C:
		}
	}
	t.Logf("%s %.1fs after power-on; the node's console ends:\n%s", cmp.Or(res.decision, consoleWant), time.Since(start).Seconds(), tail(console.String(), 6))
	cancel()
	<-booted
	res.console = console.String()
	return res
}

// packer runs the real packer in testdata, as a user of the template would.
func packer(t *testing.T, repo string, args ...string) ([]byte, error) {
	t.Helper()
	cmd := exec.Command("packer", args...)
	cmd.Dir = filepath.Join(repo, "nodeagent", "test", "e2e", "testdata")
	return cmd.CombinedOutput()
}

// stages times the test's stages and prints them together at the end.
type stages struct {
	t     *testing.T
	names []string
	times []time.Duration
	at    time.Time
}

func (s *stages) start(name string) {
	s.stop()
	s.t.Logf("== %s", name)
	s.names = append(s.names, name)
	s.at = time.Now()
}

func (s *stages) stop() {
	if len(s.times) < len(s.names) {
		s.times = append(s.times, time.Since(s.at))
	}
}

func (s *stages) print() {
	s.stop()
	var b strings.Builder
	var total time.Duration
	for i, n := range s.names {
		fmt.Fprintf(&b, "%8.1fs  %s\n", s.times[i].Seconds(), n)
		total += s.times[i]
	}
	fmt.Fprintf(&b, "%8.1fs  total", total.Seconds())
	s.t.Logf("stage times:\n%s", b.String())
}

// logLines collects what a process writes, line by line, for tests to wait on.
type logLines struct{ clustertest.SafeBuffer }

func (l *logLines) len() int { return len(l.lines()) }

// lines are the JSON lines written so far, parsed.
func (l *logLines) lines() []map[string]any {
	var out []map[string]any
	sc := bufio.NewScanner(strings.NewReader(l.String()))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var m map[string]any
		if json.Unmarshal(sc.Bytes(), &m) == nil {
			out = append(out, m)
		}
	}
	return out
}

func (l *logLines) count(msg string) int {
	n := 0
	for _, m := range l.lines() {
		if m["msg"] == msg {
			n++
		}
	}
	return n
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}
