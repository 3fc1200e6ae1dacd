package cloudinit

import (
	"fmt"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/berthlabs/berth/internal/metadata"
)

const testPin = "sha256:0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f"

func TestParseRefuses(t *testing.T) {
	for name, doc := range map[string]string{
		"no header":     "write_files: []\n",
		"unknown field": "#cloud-config\nruncmd: [reboot]\nwrite_files: []\n",
	} {
		if _, err := Parse(doc); err == nil {
			t.Errorf("%s: parsed", name)
		}
	}
}

func TestRenderUserDataLimit(t *testing.T) {
	u := metadata.UserData{ClusterName: "prod", JoinPort: 7450, JoinCAPin: testPin}
	_, small, err := Render(u, "")
	if err != nil {
		t.Fatal(err)
	}
	// Grow the document with endpoints until it passes the limit: the last size accepted is at most the limit.
	last := len(small)
	for i := 0; ; i++ {
		u.JoinEndpoints = append(u.JoinEndpoints, fmt.Sprintf("join-%04d.example.internal:7450", i))
		_, doc, err := Render(u, "")
		if err != nil {
			if !strings.Contains(err.Error(), "16 KiB") || last > MaxSize {
				t.Fatalf("after %d bytes accepted: %v", last, err)
			}
			return
		}
		last = len(doc)
	}
}

func TestRenderUserDataRefusesInvalid(t *testing.T) {
	for _, u := range []metadata.UserData{
		{ClusterName: "Prod", JoinPort: 7450, JoinCAPin: testPin},
		{ClusterName: "prod", JoinPort: 7450, JoinCAPin: "sha256:xyz"},
		{ClusterName: "prod", JoinPort: 7450, JoinCAPin: testPin, InitSecretHash: "plain-text-secret"},
	} {
		if _, _, err := Render(u, ""); err == nil {
			t.Errorf("rendered invalid user-data %+v", u)
		} else if strings.Contains(err.Error(), "plain-text-secret") {
			t.Errorf("error echoes the init secret hash field: %v", err)
		}
	}
}

func TestRenderUserDataHostname(t *testing.T) {
	u := metadata.UserData{ClusterName: "prod", JoinEndpoints: []string{"join.rack1.example.internal:7450"},
		JoinPort: 7450, JoinCAPin: testPin}
	plain, _, err := Render(u, "")
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"rack1-node07", "rack1-node07.dc1.example.com", strings.Repeat("a", 64)} {
		doc, cloudInit, err := Render(u, name)
		if err != nil {
			t.Fatalf("hostname %q: %v", name, err)
		}
		if doc != plain {
			t.Errorf("hostname %q changed the JSON: %s, want %s", name, doc, plain)
		}
		cc, err := Parse(cloudInit)
		if err != nil {
			t.Fatalf("hostname %q: %v", name, err)
		}
		if cc.Hostname != name || cc.FQDN != name || cc.PreserveHostname == nil || *cc.PreserveHostname {
			t.Errorf("hostname %q: cloud-config sets hostname %q, fqdn %q, preserve_hostname %v", name, cc.Hostname, cc.FQDN, cc.PreserveHostname)
		}
		if len(cc.WriteFiles) != 1 || cc.WriteFiles[0].Path != UserDataPath || cc.WriteFiles[0].Content != plain {
			t.Errorf("hostname %q: cloud_init writes %+v", name, cc.WriteFiles)
		}
		// cloud-init reads YAML 1.1: preserve_hostname must be the boolean false, not a string.
		var keys map[string]any
		if err := yaml.Unmarshal([]byte(cloudInit), &keys); err != nil {
			t.Fatal(err)
		}
		if len(keys) != 4 || keys["preserve_hostname"] != false || keys["hostname"] != name || keys["fqdn"] != name {
			t.Errorf("hostname %q: cloud_init has %v", name, keys)
		}
	}
}

func TestValidateHostname(t *testing.T) {
	for _, tt := range []struct {
		name, wantErr string
	}{
		{name: "rack1-node07"},
		{name: "rack1-node07.dc1.example.com"},
		{name: "0"},
		{name: strings.Repeat("a", 64)},
		{name: "", wantErr: "hostname is empty"},
		{name: "Rack1", wantErr: `'R' at byte 0 is not a lowercase letter`},
		{name: "rack1_node07", wantErr: `'_' at byte 5`},
		{name: "rack1 node07", wantErr: `' ' at byte 5`},
		{name: "node\nruncmd: [reboot]", wantErr: `'\n' at byte 4`},
		{name: "nöde", wantErr: `'ö' at byte 1`},
		{name: "-rack1", wantErr: "is not a Kubernetes node name"},
		{name: "rack1-", wantErr: "is not a Kubernetes node name"},
		{name: "rack1..example", wantErr: "is not a Kubernetes node name"},
		{name: "rack1.example.", wantErr: "is not a Kubernetes node name"},
		{name: strings.Repeat("a", 65), wantErr: "has 65 characters; Linux takes at most 64"},
		{name: strings.Repeat("a", 254), wantErr: "must be no more than 253 characters"},
	} {
		err := ValidateHostname(tt.name)
		switch {
		case tt.wantErr == "" && err != nil:
			t.Errorf("ValidateHostname(%q) = %v, want nil", tt.name, err)
		case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
			t.Errorf("ValidateHostname(%q) = %v, want an error with %q", tt.name, err, tt.wantErr)
		}
	}
	if _, _, err := Render(metadata.UserData{ClusterName: "prod", JoinPort: 7450, JoinCAPin: testPin}, "Rack1"); err == nil {
		t.Error("renderUserData took hostname Rack1")
	}
}
