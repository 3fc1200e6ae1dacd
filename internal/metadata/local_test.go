package metadata

import (
	"context"
	"encoding/json"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func writeUserData(t *testing.T, u any) string {
	t.Helper()
	data, err := json.Marshal(u)
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(t.TempDir(), "user-data.json")
	if err := os.WriteFile(p, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestLocalSelf(t *testing.T) {
	ud := UserData{ClusterName: "metal", JoinEndpoints: []string{"10.0.0.5:7450"}, JoinPort: 7450, JoinCAPin: testPin}
	var routed string
	l := &Local{
		UserDataFile: writeUserData(t, ud),
		Hostname:     func() (string, error) { return "rack1-node7", nil },
		Route: func(ep string) (netip.Addr, error) {
			routed = ep
			return netip.MustParseAddr("10.0.0.17"), nil
		},
	}
	self, err := l.Self(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	want := Instance{Name: "rack1-node7", Role: RoleWorker, Addresses: []netip.Addr{netip.MustParseAddr("10.0.0.17")}}
	if self.Instance.Name != want.Name || self.Instance.Role != want.Role || self.Instance.Addresses[0] != want.Addresses[0] {
		t.Errorf("instance %+v, want %+v", self.Instance, want)
	}
	if routed != "10.0.0.5:7450" {
		t.Errorf("address found towards %q, want the first join endpoint", routed)
	}
	if self.UserData.ClusterName != "metal" || self.UserData.JoinCAPin != testPin {
		t.Errorf("user-data %+v", self.UserData)
	}
	l.Address = netip.MustParseAddr("10.0.0.99")
	if self, err := l.Self(context.Background()); err != nil || self.Instance.Addresses[0] != l.Address {
		t.Errorf("configured address: %+v, %v", self, err)
	}
	if insts, err := l.ControlPlanes(context.Background()); err != nil || len(insts) != 0 {
		t.Errorf("ControlPlanes = %v, %v; a node without metadata knows no other", insts, err)
	}
}

func TestLocalSelfRefuses(t *testing.T) {
	good := UserData{ClusterName: "metal", JoinEndpoints: []string{"10.0.0.5:7450"}, JoinPort: 7450, JoinCAPin: testPin}
	noEndpoints := good
	noEndpoints.JoinEndpoints = nil
	tests := []struct {
		name     string
		userData any
		hostname string
		wantErr  string
	}{
		{"no join endpoint", noEndpoints, "n1", "names no join endpoint"},
		{"unknown field", map[string]any{"clusterName": "metal", "joinPort": 7450, "joinCAPin": testPin, "nodeRole": "control-plane"}, "n1", `unknown field "nodeRole"`},
		{"control-plane role", map[string]any{"clusterName": "metal", "joinEndpoints": []string{"10.0.0.1:7450"}, "joinPort": 7450, "joinCAPin": testPin, "role": "control-plane"}, "n1", "join as workers"},
		{"invalid user-data", UserData{ClusterName: "metal", JoinEndpoints: []string{"x"}, JoinPort: 7450, JoinCAPin: testPin}, "n1", "not host:port"},
		{"hostname not a node name", good, "Node_7", "not a DNS-1123 subdomain"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l := &Local{UserDataFile: writeUserData(t, tt.userData), Address: netip.MustParseAddr("10.0.0.17"),
				Hostname: func() (string, error) { return tt.hostname, nil }}
			if _, err := l.Self(context.Background()); err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("Self: %v, want an error containing %q", err, tt.wantErr)
			}
		})
	}
	l := &Local{UserDataFile: filepath.Join(t.TempDir(), "missing.json")}
	if _, err := l.Self(context.Background()); err == nil || !strings.Contains(err.Error(), "reading user-data") {
		t.Errorf("missing file: %v", err)
	}
}

// TestRouteTo asks the kernel, as a bare-metal node does, which address reaches an endpoint.
func TestRouteTo(t *testing.T) {
	addr, err := routeTo("127.0.0.1:7450")
	if err != nil {
		t.Fatal(err)
	}
	if addr != netip.MustParseAddr("127.0.0.1") {
		t.Errorf("route to loopback from %s", addr)
	}
}

func TestInventory(t *testing.T) {
	path := filepath.Join(t.TempDir(), "inventory.yaml")
	write := func(text string) {
		t.Helper()
		if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		// A later write must look changed even on a file system with coarse timestamps.
		later := time.Now().Add(time.Duration(len(text)) * time.Second)
		if err := os.Chtimes(path, later, later); err != nil {
			t.Fatal(err)
		}
	}
	write("- name: metal-1\n  role: worker\n  addresses: [10.0.0.11]\n")
	inv := &Inventory{Path: path}
	ctx := context.Background()
	inst, err := inv.InstanceByAddress(ctx, netip.MustParseAddr("::ffff:10.0.0.11"))
	if err != nil || inst.Name != "metal-1" || inst.Role != RoleWorker {
		t.Fatalf("lookup: %+v, %v", inst, err)
	}
	if _, err := inv.InstanceByAddress(ctx, netip.MustParseAddr("10.0.0.12")); !errors.Is(err, ErrNotFound) {
		t.Errorf("unknown address: %v, want ErrNotFound", err)
	}

	write("- name: metal-1\n  role: worker\n  addresses: [10.0.0.11]\n- name: metal-2\n  role: worker\n  addresses: [10.0.0.12]\n")
	if inst, err := inv.InstanceByAddress(ctx, netip.MustParseAddr("10.0.0.12")); err != nil || inst.Name != "metal-2" {
		t.Errorf("machine added to the file: %+v, %v", inst, err)
	}

	write("- name: metal-1\n  role: worker\n  addresses: [10.0.0.11]\n  rack: 7\n")
	if _, err := inv.InstanceByAddress(ctx, netip.MustParseAddr("10.0.0.11")); err == nil || errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), "rack") {
		t.Errorf("broken file: %v, want every lookup to fail with the parse error", err)
	}

	for name, text := range map[string]string{
		"address twice": "- {name: a, role: worker, addresses: [10.0.0.1]}\n- {name: b, role: worker, addresses: [10.0.0.1]}\n",
		"name twice":    "- {name: a, role: worker, addresses: [10.0.0.1]}\n- {name: a, role: worker, addresses: [10.0.0.2]}\n",
		"bad role":      "- {name: a, role: boss, addresses: [10.0.0.1]}\n",
		"empty":         "\n",
	} {
		p := filepath.Join(t.TempDir(), "inv.yaml")
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		if _, err := ParseInventory(p); err == nil {
			t.Errorf("%s: inventory accepted", name)
		}
	}
}

func TestParseUserData(t *testing.T) {
	for _, tc := range []struct {
		name, json, wantErr string
	}{
		{"as berth_node_config renders it", `{"clusterName":"lab","joinPort":7450,"joinCAPin":"` + testPin + `"}`, ""},
		{"with init secret hash", `{"clusterName":"lab","joinPort":7450,"joinCAPin":"` + testPin + `","initSecretHash":"` + "$argon2id$v=19$m=65536,t=3,p=4$c2FsdHNhbHQ$aGFzaGhhc2hoYXNo" + `"}`, ""},
		{"unknown field", `{"clusterName":"lab","joinPort":7450,"joinCAPin":"` + testPin + `","joinport":1,"extra":1}`, "unknown field"},
		{"trailing data", `{"clusterName":"lab","joinPort":7450,"joinCAPin":"` + testPin + `"} {}`, "trailing data"},
		{"not JSON", `clusterName=lab`, "decoding user-data"},
		{"invalid", `{"clusterName":"lab","joinPort":0,"joinCAPin":"` + testPin + `"}`, "join port is 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			u, err := ParseUserData([]byte(tc.json))
			if tc.wantErr == "" {
				if err != nil || u.ClusterName != "lab" || u.JoinPort != 7450 || u.JoinCAPin != testPin {
					t.Fatalf("ParseUserData: %+v, %v", u, err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("error %v, want one containing %q", err, tc.wantErr)
			}
		})
	}
}
