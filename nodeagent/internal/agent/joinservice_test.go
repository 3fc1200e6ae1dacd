package agent

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
)

func TestLocalAPIServer(t *testing.T) {
	kubeconfig := filepath.Join(t.TempDir(), "admin.conf")
	write := func(server string) {
		t.Helper()
		data := `apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "` + server + `"}}]
users: [{name: u, user: {}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
`
		if err := os.WriteFile(kubeconfig, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	self := []netip.Addr{netip.MustParseAddr("10.0.0.7"), netip.MustParseAddr("fd00::7")}
	for server, want := range map[string]string{
		"https://10.0.0.5:6443":         "https://10.0.0.7:6443",
		"https://api.example.com:16443": "https://10.0.0.7:16443",
		"https://lb.example.com":        "https://10.0.0.7:443",
		"https://[fd00::5]:6443":        "https://10.0.0.7:6443",
	} {
		write(server)
		got, err := localAPIServer(kubeconfig, self)
		if err != nil || got != want {
			t.Errorf("cluster server %s: localAPIServer = %q, %v; want %q", server, got, err, want)
		}
	}
	if _, err := localAPIServer(kubeconfig, nil); err == nil {
		t.Error("localAPIServer without an address succeeded")
	}
	if err := os.WriteFile(kubeconfig, []byte("apiVersion: v1\nkind: Config\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := localAPIServer(kubeconfig, self); err == nil {
		t.Error("localAPIServer of a kubeconfig without a context succeeded")
	}
}

// TestBareMetalServesNoJoins: a node without a metadata service, asked to serve joins, says that it cannot
// tell who a node is, not that it lacks the cluster's secrets (which it never had).
func TestBareMetalServesNoJoins(t *testing.T) {
	dir := t.TempDir()
	userData := filepath.Join(dir, "user-data.json")
	pin := "sha256:" + strings.Repeat("0123456789abcdef", 4)
	doc := `{"clusterName": "metal", "joinEndpoints": ["10.0.0.5:7450"], "joinPort": 7450, "joinCAPin": "` + pin + `"}`
	if err := os.WriteFile(userData, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := &Config{UserDataFile: userData, StateDisk: filepath.Join(dir, "state.img"), SourceAddress: "127.0.0.7",
		Paths: nodestate.Paths{State: filepath.Join(dir, "state"), KubernetesDir: filepath.Join(dir, "k8s"), KubeletDir: filepath.Join(dir, "kubelet")}}
	cfg.Defaults()
	a, err := New(cfg, Deps{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	if err := a.ServeJoinService(ctx); err == nil || !strings.Contains(err.Error(), "serves no joins") {
		t.Fatalf("ServeJoinService on bare metal: %v, want it refused for want of a metadata service", err)
	}
}
