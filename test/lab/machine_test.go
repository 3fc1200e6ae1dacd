package lab

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/berthlabs/berth/internal/metadata"
)

const (
	testPin   = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	testHash  = "$argon2id$v=19$m=65536,t=3,p=4$c2FsdHNhbHQ$aGFzaGhhc2hoYXNo"
	otherHash = "$argon2id$v=19$m=65536,t=3,p=4$b3RoZXJzYWx0$b3RoZXJoYXNo"
)

func testUserData(hash string) metadata.UserData {
	return metadata.UserData{ClusterName: "lab", JoinPort: 7450, JoinCAPin: testPin, InitSecretHash: hash}
}

func testMachine(name, addr string, hash string) Machine {
	return Machine{Name: name, Role: metadata.RoleWorker, Addr: netip.MustParseAddr(addr), Image: "berthlab-a", UserData: testUserData(hash)}
}

func TestCheckMachine(t *testing.T) {
	for _, tc := range []struct {
		name    string
		mutate  func(*Machine)
		wantErr string
	}{
		{"valid", func(*Machine) {}, ""},
		{"name not a label", func(m *Machine) { m.Name = "Worker_0" }, "not a DNS-1123 label"},
		{"name a path", func(m *Machine) { m.Name = "../x" }, "not a DNS-1123 label"},
		{"name too long for a veth", func(m *Machine) { m.Name = "worker-number-1" }, "longer than 12 characters"},
		{"role", func(m *Machine) { m.Role = "etcd" }, `role "etcd"`},
		{"outside the lab network", func(m *Machine) { m.Addr = netip.MustParseAddr("10.250.1.5") }, "not in the lab's network"},
		{"IPv6", func(m *Machine) { m.Addr = netip.MustParseAddr("fd00::5") }, "not in the lab's network"},
		{"no address", func(m *Machine) { m.Addr = netip.Addr{} }, "not in the lab's network"},
		{"host address", func(m *Machine) { m.Addr = netip.MustParseAddr("10.250.0.1") }, "the lab host's"},
		{"network address", func(m *Machine) { m.Addr = netip.MustParseAddr("10.250.0.0") }, "broadcast"},
		{"broadcast address", func(m *Machine) { m.Addr = netip.MustParseAddr("10.250.0.255") }, "broadcast"},
		{"unknown image", func(m *Machine) { m.Image = "ubuntu" }, `image "ubuntu" is not one of the lab's images (berthlab-a, berthlab-b)`},
		{"invalid user-data", func(m *Machine) { m.UserData.JoinCAPin = "" }, "user-data: join CA pin is empty"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := testMachine("worker-0", "10.250.0.20", "")
			tc.mutate(&m)
			err := checkMachine(m, ImageNames)
			if tc.wantErr == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("error %v, want one containing %q", err, tc.wantErr)
			}
		})
	}
}

// A machine outside the lab (ListMachine) may run any image the join policy names, but must name one.
func TestCheckOutsideMachine(t *testing.T) {
	m := testMachine("vm-0", "10.250.0.40", "")
	m.Image = "berth-node-qemu"
	if err := checkMachine(m, nil); err != nil {
		t.Fatal(err)
	}
	m.Image = ""
	if err := checkMachine(m, nil); err == nil || !strings.Contains(err.Error(), "names no image") {
		t.Fatalf("error %v, want one saying the machine names no image", err)
	}
}

func TestAdmit(t *testing.T) {
	cp := testMachine("cp-0", "10.250.0.10", testHash)
	cp.Role = metadata.RoleControlPlane
	for _, tc := range []struct {
		name     string
		first    *Machine // admitted before
		next     Machine
		wantErr  string
		wantHash string
	}{
		{name: "first node sets the user-data", next: cp, wantHash: testHash},
		{name: "worker without hash keeps the lab's", first: &cp, next: testMachine("w-0", "10.250.0.20", ""), wantHash: testHash},
		{name: "control plane brings the hash", first: ptr(testMachine("w-0", "10.250.0.20", "")), next: cp, wantHash: testHash},
		{name: "same hash", first: &cp, next: testMachine("w-0", "10.250.0.20", testHash), wantHash: testHash},
		{name: "another hash", first: &cp, next: testMachine("w-0", "10.250.0.20", otherHash), wantErr: "another init secret hash"},
		{name: "another cluster", first: &cp, next: func() Machine {
			m := testMachine("w-0", "10.250.0.20", "")
			m.UserData.ClusterName = "prod"
			return m
		}(), wantErr: `user-data names cluster "prod", the lab's nodes are of cluster "lab"`},
		{name: "another pin", first: &cp, next: func() Machine {
			m := testMachine("w-0", "10.250.0.20", "")
			m.UserData.JoinCAPin = "sha256:" + strings.Repeat("f", 64)
			return m
		}(), wantErr: "user-data pins join CA"},
		{name: "another join port", first: &cp, next: func() Machine {
			m := testMachine("w-0", "10.250.0.20", "")
			m.UserData.JoinPort = 1
			return m
		}(), wantErr: "join port 1"},
		{name: "join endpoints", first: &cp, next: func() Machine {
			m := testMachine("w-0", "10.250.0.20", "")
			m.UserData.JoinEndpoints = []string{"lb:7450"}
			return m
		}(), wantErr: "join endpoints [lb:7450]"},
		{name: "name taken", first: &cp, next: func() Machine { m := cp; m.Addr = netip.MustParseAddr("10.250.0.11"); return m }(),
			wantErr: "has a node cp-0 already"},
		{name: "address taken", first: &cp, next: testMachine("w-0", "10.250.0.10", ""), wantErr: "10.250.0.10 belongs to node cp-0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			doc := &metadata.Document{}
			if tc.first != nil {
				if err := admit(doc, *tc.first); err != nil {
					t.Fatal(err)
				}
			}
			before := len(doc.Instances)
			err := admit(doc, tc.next)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error %v, want one containing %q", err, tc.wantErr)
				}
				if strings.Contains(err.Error(), "argon2id") {
					t.Errorf("the error shows an init secret hash: %v", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(doc.Instances) != before+1 {
				t.Fatalf("%d instances after admitting one to %d", len(doc.Instances), before)
			}
			inst := doc.Instances[len(doc.Instances)-1]
			if inst.Name != tc.next.Name || inst.Role != tc.next.Role || inst.ImageID != tc.next.Image ||
				len(inst.Addresses) != 1 || inst.Addresses[0] != tc.next.Addr {
				t.Errorf("instance %+v for machine %+v", inst, tc.next)
			}
			if doc.UserData.InitSecretHash != tc.wantHash {
				t.Errorf("the lab's user-data has init secret hash %q, want %q", doc.UserData.InitSecretHash, tc.wantHash)
			}
		})
	}
}

func ptr[T any](v T) *T { return &v }
