package joinservice

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/metadata"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"
	bootstrapapi "k8s.io/cluster-bootstrap/token/api"
	bootstraputil "k8s.io/cluster-bootstrap/token/util"
)

// secretData is a Secret's content whichever way it was written: the fake clientset keeps StringData as
// given, an API server would have moved it to Data.
func secretData(s *corev1.Secret) map[string]string {
	m := make(map[string]string, len(s.Data)+len(s.StringData))
	for k, v := range s.Data {
		m[k] = string(v)
	}
	for k, v := range s.StringData {
		m[k] = v
	}
	return m
}

func TestKubeTokensIssue(t *testing.T) {
	client := fake.NewClientset()
	clock := time.Date(2030, 1, 2, 3, 4, 5, 678_000_000, time.FixedZone("CET", 3600))
	tokens := &KubeTokens{Client: client, Clock: func() time.Time { return clock }}
	ttl := 10 * time.Minute

	token, expires, err := tokens.Issue(context.Background(), ttl, "worker-1")
	if err != nil {
		t.Fatal(err)
	}
	if !bootstraputil.IsValidBootstrapToken(token) {
		t.Fatalf("token %q is not a valid bootstrap token", token)
	}
	id, secret, _ := strings.Cut(token, ".")
	wantExpires := time.Date(2030, 1, 2, 2, 14, 5, 0, time.UTC)
	if !expires.Equal(wantExpires) {
		t.Errorf("expires %s, want %s (clock + ttl, whole seconds)", expires, wantExpires)
	}

	s, err := client.CoreV1().Secrets(metav1.NamespaceSystem).Get(context.Background(), "bootstrap-token-"+id, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("token secret: %v", err)
	}
	if s.Type != corev1.SecretType("bootstrap.kubernetes.io/token") {
		t.Errorf("secret type %q", s.Type)
	}
	data := secretData(s)
	for key, want := range map[string]string{
		bootstrapapi.BootstrapTokenIDKey:               id,
		bootstrapapi.BootstrapTokenSecretKey:           secret,
		bootstrapapi.BootstrapTokenExpirationKey:       "2030-01-02T02:14:05Z",
		bootstrapapi.BootstrapTokenUsageAuthentication: "true",
		bootstrapapi.BootstrapTokenUsageSigningKey:     "true",
		bootstrapapi.BootstrapTokenExtraGroupsKey:      "system:bootstrappers:kubeadm:default-node-token",
	} {
		if got := data[key]; got != want {
			t.Errorf("secret %s = %q, want %q", key, got, want)
		}
	}
	exp, err := time.Parse(time.RFC3339, data[bootstrapapi.BootstrapTokenExpirationKey])
	if err != nil || !exp.Equal(expires) {
		t.Errorf("expiration %q parses to %v (%v); want the returned %v", data[bootstrapapi.BootstrapTokenExpirationKey], exp, err, expires)
	}
	if err := bootstraputil.ValidateBootstrapGroupName(data[bootstrapapi.BootstrapTokenExtraGroupsKey]); err != nil {
		t.Errorf("extra group: %v", err)
	}
	if strings.Contains(data[bootstrapapi.BootstrapTokenDescriptionKey], secret) {
		t.Error("description contains the token secret")
	}

	// A node that asks again replaces its token; another node's stays.
	if _, _, err := tokens.Issue(context.Background(), ttl, "worker-2"); err != nil {
		t.Fatal(err)
	}
	token2, _, err := tokens.Issue(context.Background(), ttl, "worker-1")
	if err != nil {
		t.Fatal(err)
	}
	if token2 == token {
		t.Errorf("two tokens are both %q", token)
	}
	list, err := client.CoreV1().Secrets(metav1.NamespaceSystem).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var nodes []string
	for _, s := range list.Items {
		nodes = append(nodes, s.Annotations["berth.dev/instance-name"]+"="+secretData(&s)[bootstrapapi.BootstrapTokenIDKey])
	}
	id2, _, _ := strings.Cut(token2, ".")
	if len(list.Items) != 2 || !slices.Contains(nodes, "worker-1="+id2) {
		t.Errorf("tokens after worker-1 asked twice and worker-2 once: %v, want worker-1's second and worker-2's", nodes)
	}
}

func TestKubeTokensIssueCreateFails(t *testing.T) {
	client := fake.NewClientset()
	client.PrependReactor("create", "secrets", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewForbidden(schema.GroupResource{Resource: "secrets"}, "x", errors.New("RBAC"))
	})
	token, _, err := (&KubeTokens{Client: client}).Issue(context.Background(), time.Minute, "worker-1")
	if err == nil || !strings.Contains(err.Error(), "creating bootstrap token secret") || !apierrors.IsForbidden(err) {
		t.Fatalf("Issue = %q, %v; want the wrapped Forbidden error", token, err)
	}
	if token != "" {
		t.Errorf("failed Issue returned token %q", token)
	}
}

const (
	testDisk  = "0b2c5c36-7f1e-4a5e-9d8b-1f0e6a2b3c4d"
	otherDisk = "5d4c3b2a-1f0e-4d8b-9e5a-7f1e0b2c5c36"
	ekAlice   = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
	ekBob     = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
)

// instanceFor is the instance of the machine with ek: one machine per TPM in these tests.
func instanceFor(ek string) *metadata.Instance {
	return &metadata.Instance{Name: "node-" + ek[:8], Role: metadata.RoleWorker, Addresses: []netip.Addr{netip.MustParseAddr("10.0.0.5")}}
}

func TestKubeDisksClaimAndOwner(t *testing.T) {
	ctx := context.Background()
	client := fake.NewClientset()
	disks := &KubeDisks{Client: client}

	if owner, err := disks.Owner(ctx, testDisk); !errors.Is(err, ErrDiskUnknown) {
		t.Fatalf("Owner of an unknown disk = %q, %v; want ErrDiskUnknown", owner, err)
	}
	if err := disks.Claim(ctx, testDisk, ekAlice, instanceFor(ekAlice)); err != nil {
		t.Fatalf("first claim: %v", err)
	}
	if err := disks.Claim(ctx, testDisk, ekAlice, instanceFor(ekAlice)); err != nil {
		t.Errorf("the owner claiming again: %v", err)
	}
	if err := disks.Claim(ctx, testDisk, ekBob, instanceFor(ekBob)); !errors.Is(err, ErrDiskOwnedByOther) {
		t.Errorf("another TPM claiming: %v, want ErrDiskOwnedByOther", err)
	}
	if owner, err := disks.Owner(ctx, testDisk); err != nil || owner != ekAlice {
		t.Errorf("Owner = %q, %v; want alice", owner, err)
	}
	if err := disks.Claim(ctx, otherDisk, ekBob, instanceFor(ekBob)); err != nil {
		t.Errorf("bob claiming another disk: %v", err)
	}
	if owner, err := disks.Owner(ctx, otherDisk); err != nil || owner != ekBob {
		t.Errorf("Owner of the other disk = %q, %v; want bob", owner, err)
	}

	cm, err := client.CoreV1().ConfigMaps(metav1.NamespaceSystem).Get(ctx, "berth-disk-"+testDisk, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if cm.Data["ek-sha256"] != ekAlice || cm.Labels["app.kubernetes.io/managed-by"] != "berth" {
		t.Errorf("config map data %v labels %v", cm.Data, cm.Labels)
	}
}

func TestKubeDisksRace(t *testing.T) {
	const racers = 8
	for round := range 20 {
		disks := &KubeDisks{Client: fake.NewClientset()}
		errs := make([]error, racers)
		var start, wg sync.WaitGroup
		start.Add(1)
		for i := range racers {
			wg.Go(func() {
				start.Wait()
				errs[i] = disks.Claim(context.Background(), testDisk, fmt.Sprintf("%064x", i), instanceFor(fmt.Sprintf("%064x", i)))
			})
		}
		start.Done()
		wg.Wait()
		winner := -1
		for i, err := range errs {
			switch {
			case err == nil && winner >= 0:
				t.Fatalf("round %d: TPMs %d and %d both claimed the disk", round, winner, i)
			case err == nil:
				winner = i
			case !errors.Is(err, ErrDiskOwnedByOther):
				t.Fatalf("round %d: TPM %d: %v, want ErrDiskOwnedByOther", round, i, err)
			}
		}
		if winner < 0 {
			t.Fatalf("round %d: nobody claimed the disk: %v", round, errs)
		}
		if owner, err := disks.Owner(context.Background(), testDisk); err != nil || owner != fmt.Sprintf("%064x", winner) {
			t.Fatalf("round %d: Owner = %q, %v; want the winner %d", round, owner, err, winner)
		}
	}
}

func TestKubeDisksAPIErrors(t *testing.T) {
	ctx := context.Background()
	unavailable := apierrors.NewServiceUnavailable("etcd is down")

	client := fake.NewClientset()
	client.PrependReactor("create", "configmaps", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, unavailable
	})
	if err := (&KubeDisks{Client: client}).Claim(ctx, testDisk, ekAlice, instanceFor(ekAlice)); !apierrors.IsServiceUnavailable(err) {
		t.Errorf("Claim with a failing create: %v, want the API error", err)
	}

	client = fake.NewClientset()
	client.PrependReactor("get", "configmaps", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, unavailable
	})
	disks := &KubeDisks{Client: client}
	if _, err := disks.Owner(ctx, testDisk); !apierrors.IsServiceUnavailable(err) || errors.Is(err, ErrDiskUnknown) {
		t.Errorf("Owner with a failing get: %v, want the API error and not ErrDiskUnknown", err)
	}
	if err := disks.Claim(ctx, testDisk, ekAlice, instanceFor(ekAlice)); err != nil {
		t.Fatalf("first claim: %v", err)
	}
	// The disk exists now: a second claim must read the owner, and must not succeed when it cannot.
	if err := disks.Claim(ctx, testDisk, ekBob, instanceFor(ekBob)); err == nil || errors.Is(err, ErrDiskOwnedByOther) {
		t.Errorf("Claim with a failing get: %v, want the API error", err)
	}
}

func writePKIFiles(t *testing.T, dir string) map[string]string {
	t.Helper()
	want := map[string]string{}
	for _, name := range []string{"ca.crt", "ca.key", "sa.key", "sa.pub", "front-proxy-ca.crt", "front-proxy-ca.key", "etcd/ca.crt", "etcd/ca.key"} {
		content := "content of " + name
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		want[name] = content
	}
	// kubeadm leaves more in the directory; none of it may be handed out.
	if err := os.WriteFile(filepath.Join(dir, "apiserver.key"), []byte("apiserver key"), 0o600); err != nil {
		t.Fatal(err)
	}
	return want
}

func TestPKIFiles(t *testing.T) {
	dir := t.TempDir()
	want := writePKIFiles(t, dir)
	files, err := PKIFiles(dir)()
	if err != nil {
		t.Fatal(err)
	}
	if len(files) != len(want) {
		t.Errorf("%d files, want %d", len(files), len(want))
	}
	seen := map[string]bool{}
	for _, f := range files {
		content, ok := want[f.Path]
		if !ok {
			t.Errorf("unexpected file %q", f.Path)
			continue
		}
		seen[f.Path] = true
		if string(f.Content) != content {
			t.Errorf("%s: content %q, want %q", f.Path, f.Content, content)
		}
		wantMode := uint32(0o644)
		if strings.HasSuffix(f.Path, ".key") {
			wantMode = 0o600
		}
		if f.Mode != wantMode {
			t.Errorf("%s: mode %#o, want %#o", f.Path, f.Mode, wantMode)
		}
		if !filepath.IsLocal(f.Path) {
			t.Errorf("%s: path is not local", f.Path)
		}
	}
	if len(seen) != len(want) {
		t.Errorf("files %v, want each of %v once", seen, want)
	}
}

func TestPKIFilesMissingFile(t *testing.T) {
	for _, missing := range []string{"ca.key", "etcd/ca.key", "sa.pub"} {
		t.Run(missing, func(t *testing.T) {
			dir := t.TempDir()
			writePKIFiles(t, dir)
			if err := os.Remove(filepath.Join(dir, missing)); err != nil {
				t.Fatal(err)
			}
			files, err := PKIFiles(dir)()
			if err == nil {
				t.Fatalf("PKIFiles = %d files, want an error", len(files))
			}
			if !errors.Is(err, os.ErrNotExist) || !strings.Contains(err.Error(), missing) {
				t.Errorf("error %q does not name the missing %s", err, missing)
			}
			if strings.Contains(err.Error(), "content of") {
				t.Errorf("error %q carries file content", err)
			}
		})
	}
}

func TestRemoveBootstrapAutoApproval(t *testing.T) {
	ctx := context.Background()
	rotation := &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "kubeadm:node-autoapprove-certificate-rotation"}}
	bootstrap := &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: BootstrapAutoApproveBinding}}
	client := fake.NewClientset(rotation, bootstrap)
	if removed, err := RemoveBootstrapAutoApproval(ctx, client); err != nil || !removed {
		t.Fatalf("first removal: %v, %v; want removed", removed, err)
	}
	if removed, err := RemoveBootstrapAutoApproval(ctx, client); err != nil || removed {
		t.Fatalf("second removal: %v, %v; want nothing to remove and no error", removed, err)
	}
	left, err := client.RbacV1().ClusterRoleBindings().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(left.Items) != 1 || left.Items[0].Name != rotation.Name {
		t.Fatalf("bindings left %v, want only the certificate-rotation one", left.Items)
	}
}

func diskRecords(t *testing.T, client *fake.Clientset) []string {
	t.Helper()
	list, err := client.CoreV1().ConfigMaps(metav1.NamespaceSystem).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, cm := range list.Items {
		names = append(names, strings.TrimPrefix(cm.Name, "berth-disk-"))
	}
	slices.Sort(names)
	return names
}

// TestKubeDisksOneRecordPerInstance: a node that joins again with a fresh disk (it crashed before its key
// swap, and formatted anew) replaces its record; other nodes' records stay.
func TestKubeDisksOneRecordPerInstance(t *testing.T) {
	ctx := context.Background()
	client := fake.NewClientset()
	disks := &KubeDisks{Client: client}
	w1 := &metadata.Instance{Name: "worker-1", Role: metadata.RoleWorker, Addresses: []netip.Addr{netip.MustParseAddr("10.0.0.5")}}
	w2 := &metadata.Instance{Name: "worker-2", Role: metadata.RoleWorker, Addresses: []netip.Addr{netip.MustParseAddr("10.0.0.6")}}
	third := "9e8d7c6b-5a49-4382-a716-0f1e2d3c4b5a"
	for _, c := range []struct {
		disk, ek string
		inst     *metadata.Instance
	}{{testDisk, ekAlice, w1}, {otherDisk, ekBob, w2}, {third, ekAlice, w1}} {
		if err := disks.Claim(ctx, c.disk, c.ek, c.inst); err != nil {
			t.Fatal(err)
		}
	}
	if got, want := diskRecords(t, client), []string{otherDisk, third}; !slices.Equal(got, want) {
		t.Fatalf("records %v, want %v: worker-1's second disk replaces its first", got, want)
	}
	if _, err := disks.Owner(ctx, testDisk); !errors.Is(err, ErrDiskUnknown) {
		t.Fatalf("the replaced disk: %v, want ErrDiskUnknown", err)
	}
}

// fixedLookup finds the instances it holds, by address.
type fixedLookup map[netip.Addr]string

func (f fixedLookup) InstanceByAddress(_ context.Context, a netip.Addr) (*metadata.Instance, error) {
	name, ok := f[a]
	if !ok {
		return nil, metadata.ErrNotFound
	}
	return &metadata.Instance{Name: name, Role: metadata.RoleWorker, Addresses: []netip.Addr{a}}, nil
}

func TestKubeDisksCollect(t *testing.T) {
	ctx := context.Background()
	client := fake.NewClientset()
	disks := &KubeDisks{Client: client}
	a5, a6 := netip.MustParseAddr("10.0.0.5"), netip.MustParseAddr("10.0.0.6")
	for disk, inst := range map[string]*metadata.Instance{
		testDisk:  {Name: "worker-1", Addresses: []netip.Addr{a5}},
		otherDisk: {Name: "worker-2", Addresses: []netip.Addr{a6}},
	} {
		if err := disks.Claim(ctx, disk, ekAlice, inst); err != nil {
			t.Fatal(err)
		}
	}
	now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	retention := time.Hour
	sweep := func(lookup InstanceLookup, at time.Duration) []string {
		t.Helper()
		removed, err := disks.Collect(ctx, lookup, retention, now.Add(at))
		if err != nil {
			t.Fatal(err)
		}
		return removed
	}
	// worker-2 is gone; worker-1 is stopped for a while (its cloud no longer lists it) and comes back.
	onlyW1 := fixedLookup{a5: "worker-1"}
	if removed := sweep(fixedLookup{}, 0); len(removed) != 0 {
		t.Fatalf("the first sweep that misses them removed %v; it only marks", removed)
	}
	if removed := sweep(onlyW1, 30*time.Minute); len(removed) != 0 {
		t.Fatalf("a sweep within the retention removed %v", removed)
	}
	// Another instance now has worker-2's address: worker-2 is still gone.
	if removed := sweep(fixedLookup{a5: "worker-1", a6: "worker-9"}, 2*time.Hour); !slices.Equal(removed, []string{otherDisk}) {
		t.Fatalf("after the retention: removed %v, want worker-2's disk only", removed)
	}
	if got := diskRecords(t, client); !slices.Equal(got, []string{testDisk}) {
		t.Fatalf("records left %v", got)
	}
	// worker-1 came back before its retention ended: its mark is gone, and a later absence starts anew.
	if removed := sweep(fixedLookup{}, 3*time.Hour); len(removed) != 0 {
		t.Fatalf("removed %v: worker-1's absence must count from its new mark", removed)
	}

	failing := lookupFunc(func(context.Context, netip.Addr) (*metadata.Instance, error) { return nil, errors.New("API down") })
	if _, err := disks.Collect(ctx, failing, retention, now.Add(10*time.Hour)); err == nil {
		t.Fatal("a failing lookup gave no error")
	}
	if got := diskRecords(t, client); !slices.Equal(got, []string{testDisk}) {
		t.Fatalf("a failing lookup removed records: %v left", got)
	}
}

type lookupFunc func(context.Context, netip.Addr) (*metadata.Instance, error)

func (f lookupFunc) InstanceByAddress(ctx context.Context, a netip.Addr) (*metadata.Instance, error) {
	return f(ctx, a)
}

// With the records watched, a ticket removes its node's earlier token and disk record as before, and asks
// the API server for no list: the watch's own first list is the only one.
func TestNodeRecordsReplaceListsPerTicket(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	client := fake.NewClientset()
	records, err := WatchNodeRecords(ctx, client, true)
	if err != nil {
		t.Fatal(err)
	}
	tokens := &KubeTokens{Client: client, Records: records}
	disks := &KubeDisks{Client: client, Records: records}
	w1 := &metadata.Instance{Name: "worker-1", Role: metadata.RoleWorker, Addresses: []netip.Addr{netip.MustParseAddr("10.0.0.5")}}
	// The watch is asynchronous: wait until it shows what a step wrote before the next step relies on it.
	seen := func(what string, inf func(*NodeRecords) cache.SharedIndexInformer, want int) {
		t.Helper()
		waitForWatch(t, "the watch to show "+what, func() bool {
			got, ok := records.names(inf, w1.Name)
			return ok && len(got) == want
		})
	}

	first, _, err := tokens.Issue(ctx, time.Minute, w1.Name)
	if err != nil {
		t.Fatal(err)
	}
	if err := disks.Claim(ctx, testDisk, ekAlice, w1); err != nil {
		t.Fatal(err)
	}
	seen("the token", secretsOf, 1)
	seen("the disk record", configMapsOf, 1)
	lists := func() int {
		n := 0
		for _, a := range client.Actions() {
			if a.GetVerb() == "list" {
				n++
			}
		}
		return n
	}
	before := lists()
	second, _, err := tokens.Issue(ctx, time.Minute, w1.Name)
	if err != nil {
		t.Fatal(err)
	}
	if err := disks.Claim(ctx, otherDisk, ekAlice, w1); err != nil {
		t.Fatal(err)
	}
	if n := lists() - before; n != 0 {
		t.Errorf("a ticket made %d list requests with the records watched, want 0", n)
	}
	firstID, _, _ := strings.Cut(first, ".")
	if _, err := client.CoreV1().Secrets(Namespace).Get(ctx, bootstraputil.BootstrapTokenSecretName(firstID), metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("the node's first token: %v, want it removed by its second", err)
	}
	secondID, _, _ := strings.Cut(second, ".")
	if _, err := client.CoreV1().Secrets(Namespace).Get(ctx, bootstraputil.BootstrapTokenSecretName(secondID), metav1.GetOptions{}); err != nil {
		t.Errorf("the node's second token: %v", err)
	}
	if got, want := diskRecords(t, client), []string{otherDisk}; !slices.Equal(got, want) {
		t.Errorf("disk records %v, want %v: the second disk replaces the first", got, want)
	}
}

// A service that issues no tokens watches no Secrets: its role may not allow reading them. Its tokens' lookups
// fall back to the API server.
func TestNodeRecordsWithoutTokens(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	client := fake.NewClientset()
	records, err := WatchNodeRecords(ctx, client, false)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := records.names(secretsOf, "worker-1"); ok {
		t.Error("records answered for Secrets without watching them")
	}
	waitForWatch(t, "the disk records' watch to list them", func() bool {
		_, ok := records.names(configMapsOf, "worker-1")
		return ok
	})
	for _, a := range client.Actions() {
		if a.GetResource().Resource == "secrets" {
			t.Errorf("%s secrets without issuing tokens", a.GetVerb())
		}
	}
}

// waitForWatch waits, for at most 10 s, until cond holds.
func waitForWatch(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("waited 10 s for %s", what)
		}
	}
}
