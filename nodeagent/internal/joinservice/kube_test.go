package joinservice

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
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

	token, expires, err := tokens.Issue(context.Background(), ttl)
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

	token2, _, err := tokens.Issue(context.Background(), ttl)
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
	if len(list.Items) != 2 {
		t.Errorf("%d secrets after two tokens, want 2", len(list.Items))
	}
}

func TestKubeTokensIssueCreateFails(t *testing.T) {
	client := fake.NewClientset()
	client.PrependReactor("create", "secrets", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewForbidden(schema.GroupResource{Resource: "secrets"}, "x", errors.New("RBAC"))
	})
	token, _, err := (&KubeTokens{Client: client}).Issue(context.Background(), time.Minute)
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

func TestKubeDisksClaimAndOwner(t *testing.T) {
	ctx := context.Background()
	client := fake.NewClientset()
	disks := &KubeDisks{Client: client}

	if owner, err := disks.Owner(ctx, testDisk); !errors.Is(err, ErrDiskUnknown) {
		t.Fatalf("Owner of an unknown disk = %q, %v; want ErrDiskUnknown", owner, err)
	}
	if err := disks.Claim(ctx, testDisk, ekAlice); err != nil {
		t.Fatalf("first claim: %v", err)
	}
	if err := disks.Claim(ctx, testDisk, ekAlice); err != nil {
		t.Errorf("the owner claiming again: %v", err)
	}
	if err := disks.Claim(ctx, testDisk, ekBob); !errors.Is(err, ErrDiskOwnedByOther) {
		t.Errorf("another TPM claiming: %v, want ErrDiskOwnedByOther", err)
	}
	if owner, err := disks.Owner(ctx, testDisk); err != nil || owner != ekAlice {
		t.Errorf("Owner = %q, %v; want alice", owner, err)
	}
	if err := disks.Claim(ctx, otherDisk, ekBob); err != nil {
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
				errs[i] = disks.Claim(context.Background(), testDisk, fmt.Sprintf("%064x", i))
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
	if err := (&KubeDisks{Client: client}).Claim(ctx, testDisk, ekAlice); !apierrors.IsServiceUnavailable(err) {
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
	if err := disks.Claim(ctx, testDisk, ekAlice); err != nil {
		t.Fatalf("first claim: %v", err)
	}
	// The disk exists now: a second claim must read the owner, and must not succeed when it cannot.
	if err := disks.Claim(ctx, testDisk, ekBob); err == nil || errors.Is(err, ErrDiskOwnedByOther) {
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
