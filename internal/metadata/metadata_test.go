package metadata

import (
	"net/netip"
	"strings"
	"testing"
)

const testPin = "sha256:" + "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

func validUserData() UserData {
	return UserData{
		ClusterName:    "lab",
		JoinEndpoints:  []string{"127.0.0.1:9000", "[::1]:9000", "join.example.com:443"},
		JoinPort:       9000,
		JoinCAPin:      testPin,
		InitSecretHash: "$argon2id$v=19$m=65536,t=3,p=4$c2FsdHNhbHQ$aGFzaGhhc2hoYXNo",
	}
}

func validInstance() Instance {
	return Instance{
		Name:      "cp-0.lab",
		Role:      RoleControlPlane,
		Addresses: []netip.Addr{netip.MustParseAddr("127.0.0.2"), netip.MustParseAddr("fd00::2")},
		ImageID:   "ami-0123456789",
	}
}

func TestRoleValid(t *testing.T) {
	for role, want := range map[Role]bool{
		RoleControlPlane: true,
		RoleWorker:       true,
		"":               false,
		"Worker":         false,
		"controlplane":   false,
	} {
		if got := role.Valid(); got != want {
			t.Errorf("Role(%q).Valid() = %v, want %v", role, got, want)
		}
	}
}

func TestInstanceValidate(t *testing.T) {
	tests := []struct {
		name    string
		mutate  func(*Instance)
		wantErr string
	}{
		{name: "valid", mutate: func(*Instance) {}},
		{name: "worker without image id", mutate: func(i *Instance) { i.Role, i.ImageID = RoleWorker, "" }},
		{name: "empty name", mutate: func(i *Instance) { i.Name = "" }, wantErr: "instance name is empty"},
		{name: "uppercase name", mutate: func(i *Instance) { i.Name = "CP-0" }, wantErr: "not a DNS-1123 subdomain"},
		{name: "name too long", mutate: func(i *Instance) { i.Name = strings.Repeat("a", 254) }, wantErr: "not a DNS-1123 subdomain"},
		{name: "bad role", mutate: func(i *Instance) { i.Role = "master" }, wantErr: `role "master" is not`},
		{name: "no addresses", mutate: func(i *Instance) { i.Addresses = nil }, wantErr: "has no addresses"},
		{name: "zero address", mutate: func(i *Instance) { i.Addresses = []netip.Addr{{}} }, wantErr: "empty or invalid"},
		{name: "mapped address", mutate: func(i *Instance) { i.Addresses = []netip.Addr{netip.MustParseAddr("::ffff:10.0.0.1")} }, wantErr: "write it as 10.0.0.1"},
		{name: "zoned address", mutate: func(i *Instance) { i.Addresses = []netip.Addr{netip.MustParseAddr("fe80::1%eth0")} }, wantErr: "has a zone"},
		{name: "unspecified address", mutate: func(i *Instance) { i.Addresses = []netip.Addr{netip.MustParseAddr("0.0.0.0")} }, wantErr: "unspecified"},
		{name: "multicast address", mutate: func(i *Instance) { i.Addresses = []netip.Addr{netip.MustParseAddr("ff02::1")} }, wantErr: "multicast"},
		{name: "duplicate address", mutate: func(i *Instance) { i.Addresses = append(i.Addresses, i.Addresses[0]) }, wantErr: "lists address 127.0.0.2 twice"},
		{name: "image id too long", mutate: func(i *Instance) { i.ImageID = strings.Repeat("x", 1025) }, wantErr: "longer than 1024"},
		{name: "image id control char", mutate: func(i *Instance) { i.ImageID = "ami\n1" }, wantErr: "control characters"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			inst := validInstance()
			tt.mutate(&inst)
			checkErr(t, inst.Validate(), tt.wantErr)
		})
	}
}

func TestUserDataValidate(t *testing.T) {
	tests := []struct {
		name    string
		mutate  func(*UserData)
		wantErr string
	}{
		{name: "valid", mutate: func(*UserData) {}},
		{name: "minimal", mutate: func(u *UserData) { u.JoinEndpoints, u.InitSecretHash = nil, "" }},
		{name: "empty cluster name", mutate: func(u *UserData) { u.ClusterName = "" }, wantErr: "cluster name is empty"},
		{name: "dotted cluster name", mutate: func(u *UserData) { u.ClusterName = "a.b" }, wantErr: "not a DNS-1123 label"},
		{name: "endpoint without port", mutate: func(u *UserData) { u.JoinEndpoints = []string{"lb.example.com"} }, wantErr: "is not host:port"},
		{name: "endpoint without host", mutate: func(u *UserData) { u.JoinEndpoints = []string{":9000"} }, wantErr: "has no host"},
		{name: "endpoint port zero", mutate: func(u *UserData) { u.JoinEndpoints = []string{"lb:0"} }, wantErr: "not a number from 1 to 65535"},
		{name: "endpoint port too big", mutate: func(u *UserData) { u.JoinEndpoints = []string{"lb:65536"} }, wantErr: "not a number from 1 to 65535"},
		{name: "endpoint port named", mutate: func(u *UserData) { u.JoinEndpoints = []string{"lb:https"} }, wantErr: "not a number from 1 to 65535"},
		{name: "endpoint with path", mutate: func(u *UserData) { u.JoinEndpoints = []string{"lb/x:80"} }, wantErr: "spaces, slashes"},
		{name: "endpoint twice", mutate: func(u *UserData) { u.JoinEndpoints = []string{"lb:80", "lb:80"} }, wantErr: "listed twice"},
		{name: "join port zero", mutate: func(u *UserData) { u.JoinPort = 0 }, wantErr: "join port is 0"},
		{name: "no pin", mutate: func(u *UserData) { u.JoinCAPin = "" }, wantErr: "join CA pin is empty"},
		{name: "pin without prefix", mutate: func(u *UserData) { u.JoinCAPin = strings.TrimPrefix(testPin, "sha256:") }, wantErr: `does not start with "sha256:"`},
		{name: "pin short", mutate: func(u *UserData) { u.JoinCAPin = testPin[:len(testPin)-2] }, wantErr: "digest has 62 characters"},
		{name: "pin uppercase", mutate: func(u *UserData) { u.JoinCAPin = strings.ToUpper(testPin[:9]) + testPin[9:] }, wantErr: "does not start with"},
		{name: "pin uppercase hex", mutate: func(u *UserData) { u.JoinCAPin = "sha256:" + strings.ToUpper(testPin[7:]) }, wantErr: "not lowercase hex"},
		{name: "pin not hex", mutate: func(u *UserData) { u.JoinCAPin = "sha256:" + strings.Repeat("g", 64) }, wantErr: "not lowercase hex"},
		{name: "hash not PHC", mutate: func(u *UserData) { u.InitSecretHash = "plaintext" }, wantErr: "not an argon2id PHC string"},
		{name: "hash argon2i", mutate: func(u *UserData) { u.InitSecretHash = "$argon2i$v=19$m=1,t=1,p=1$c2FsdA$aGFzaA" }, wantErr: "not an argon2id PHC string"},
		{name: "hash old version", mutate: func(u *UserData) { u.InitSecretHash = "$argon2id$v=16$m=1,t=1,p=1$c2FsdA$aGFzaA" }, wantErr: "version is not v=19"},
		{name: "hash params order", mutate: func(u *UserData) { u.InitSecretHash = "$argon2id$v=19$t=1,m=1,p=1$c2FsdA$aGFzaA" }, wantErr: "not m=…,t=…,p=…"},
		{name: "hash zero param", mutate: func(u *UserData) { u.InitSecretHash = "$argon2id$v=19$m=1,t=0,p=1$c2FsdA$aGFzaA" }, wantErr: "parameter t is not a positive number"},
		{name: "role", mutate: func(u *UserData) { u.Role = RoleControlPlane }},
		{name: "unknown role", mutate: func(u *UserData) { u.Role = "admin" }, wantErr: `role "admin" is not`},
		{name: "autoscaling groups", mutate: func(u *UserData) {
			u.AutoscalingGroups = map[string]Role{"prod-cp": RoleControlPlane, "prod-workers": RoleWorker}
		}},
		{name: "autoscaling group of no role", mutate: func(u *UserData) { u.AutoscalingGroups = map[string]Role{"prod-workers": "admin"} },
			wantErr: `autoscaling group "prod-workers": role "admin" is not`},
		{name: "autoscaling group unnamed", mutate: func(u *UserData) { u.AutoscalingGroups = map[string]Role{"": RoleWorker} },
			wantErr: "autoscaling group name \"\" is empty"},
		{name: "hash no salt", mutate: func(u *UserData) { u.InitSecretHash = "$argon2id$v=19$m=1,t=1,p=1$$aGFzaA" }, wantErr: "salt or hash is empty"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			u := validUserData()
			tt.mutate(&u)
			checkErr(t, u.Validate(), tt.wantErr)
		})
	}
}

func TestUserDataErrorsLeaveOutInitSecretHash(t *testing.T) {
	u := validUserData()
	u.InitSecretHash = "$argon2id$v=19$m=1,t=1,p=1$c2FsdA$"
	err := u.Validate()
	if err == nil {
		t.Fatal("Validate accepted a hash without its digest")
	}
	if strings.Contains(err.Error(), "c2FsdA") {
		t.Errorf("error %q contains part of the init secret hash", err)
	}
}

func TestParseDocument(t *testing.T) {
	const ud = `"userData":{"clusterName":"lab","joinPort":9000,"joinCAPin":"` + testPin + `"}`
	tests := []struct {
		name    string
		input   string
		wantErr string
		wantN   int
	}{
		{
			name:  "two instances",
			input: `{` + ud + `,"instances":[{"name":"cp-0","role":"control-plane","addresses":["127.0.0.2"]},{"name":"w-0","role":"worker","addresses":["127.0.0.3","fd00::3"],"imageID":"img"}]}`,
			wantN: 2,
		},
		{name: "no instances", input: `{` + ud + `,"instances":[]}`},
		{name: "not JSON", input: `userData: {}`, wantErr: "decoding metadata document"},
		{name: "unknown field", input: `{` + ud + `,"instances":[],"nodes":[]}`, wantErr: `unknown field "nodes"`},
		{name: "unknown instance field", input: `{` + ud + `,"instances":[{"name":"a","role":"worker","addresses":["10.0.0.1"],"zone":"x"}]}`, wantErr: `unknown field "zone"`},
		{name: "trailing data", input: `{` + ud + `,"instances":[]} {}`, wantErr: "trailing data"},
		{name: "bad address", input: `{` + ud + `,"instances":[{"name":"a","role":"worker","addresses":["10.0.0.300"]}]}`, wantErr: "decoding metadata document"},
		{name: "missing user-data", input: `{"instances":[]}`, wantErr: "user-data: cluster name is empty"},
		{name: "invalid instance", input: `{` + ud + `,"instances":[{"name":"a","role":"boss","addresses":["10.0.0.1"]}]}`, wantErr: `instance 0: instance "a": role "boss"`},
		{
			name:    "duplicate names",
			input:   `{` + ud + `,"instances":[{"name":"a","role":"worker","addresses":["10.0.0.1"]},{"name":"a","role":"worker","addresses":["10.0.0.2"]}]}`,
			wantErr: `instances 0 and 1 are both named "a"`,
		},
		{
			name:    "shared address",
			input:   `{` + ud + `,"instances":[{"name":"a","role":"worker","addresses":["10.0.0.1"]},{"name":"b","role":"worker","addresses":["10.0.0.2","10.0.0.1"]}]}`,
			wantErr: `address 10.0.0.1 belongs to both "a" and "b"`,
		},
		{name: "too large", input: `{` + ud + `,"instances":[]}` + strings.Repeat(" ", MaxDocumentSize), wantErr: "more than the limit"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			doc, err := ParseDocument([]byte(tt.input))
			checkErr(t, err, tt.wantErr)
			if err == nil && len(doc.Instances) != tt.wantN {
				t.Errorf("got %d instances, want %d", len(doc.Instances), tt.wantN)
			}
		})
	}
}

func TestParseDocumentKeepsAddressOrder(t *testing.T) {
	input := []byte(`{"userData":{"clusterName":"lab","joinPort":9000,"joinCAPin":"` + testPin + `"},` +
		`"instances":[{"name":"w","role":"worker","addresses":["fd00::9","10.0.0.9"]}]}`)
	doc, err := ParseDocument(input)
	if err != nil {
		t.Fatal(err)
	}
	got := doc.Instances[0].Addresses
	if len(got) != 2 || got[0] != netip.MustParseAddr("fd00::9") {
		t.Errorf("addresses = %v, want the primary fd00::9 first", got)
	}
}

func checkErr(t *testing.T, err error, want string) {
	t.Helper()
	switch {
	case want == "" && err != nil:
		t.Fatalf("unexpected error: %v", err)
	case want != "" && err == nil:
		t.Fatalf("no error, want one containing %q", want)
	case want != "" && !strings.Contains(err.Error(), want):
		t.Fatalf("error %q does not contain %q", err, want)
	}
}

func TestValidateInstanceGroup(t *testing.T) {
	for _, ok := range []string{"europe-west1/berth-workers", "us-central1-a/cp", "northamerica-northeast2/a"} {
		if err := ValidateInstanceGroup(ok); err != nil {
			t.Errorf("ValidateInstanceGroup(%q) = %v, want nil", ok, err)
		}
	}
	for _, bad := range []string{"", "berth-workers", "europe-west1/", "europe-west1/Workers", "europe-west1/-w",
		"projects/p/regions/europe-west1/instanceGroupManagers/w", "europe-west1/w/x", "europe-west1/" + strings.Repeat("a", 64)} {
		if err := ValidateInstanceGroup(bad); err == nil {
			t.Errorf("ValidateInstanceGroup(%q) = nil, want an error", bad)
		}
	}
	u := validUserData()
	u.InstanceGroups = map[string]Role{"europe-west1/w": "admin"}
	if err := u.Validate(); err == nil || !strings.Contains(err.Error(), `instance group "europe-west1/w": role "admin"`) {
		t.Errorf("Validate with a bad role: %v", err)
	}
}
