package agent

import (
	"net/netip"
	"os"
	"path/filepath"
	"testing"
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
