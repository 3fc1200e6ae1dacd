package agent

import (
	"encoding/json"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/repotest"
	"github.com/berthlabs/berth/nodeagent/internal/certrenew"
	"github.com/berthlabs/berth/nodeagent/internal/configfile"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
)

func writeConfig(t *testing.T, content string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "agent.yaml")
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

const minimalConfig = "metadataURL: http://169.254.169.254/berth\nstateDisk: /dev/vdb\n"

func TestLoadConfigDefaults(t *testing.T) {
	c, err := LoadConfig(writeConfig(t, minimalConfig))
	if err != nil {
		t.Fatal(err)
	}
	want := Config{
		MetadataURL:            "http://169.254.169.254/berth",
		StateDisk:              "/dev/vdb",
		TPM:                    "/dev/tpmrm0",
		MapperName:             "berth-state",
		Paths:                  nodestate.DefaultPaths,
		InitListen:             ":7451",
		Kubeadm:                "kubeadm",
		EKCABundle:             "/etc/berth/ek-ca.pem",
		PolicyConfigMap:        "berth-join-policy",
		LocalUnlockRefresh:     configfile.Duration{Duration: DefaultLocalUnlockRefresh},
		VerifiedRoot:           "/dev/mapper/berth-root",
		CertificateRenewBefore: configfile.Duration{Duration: certrenew.DefaultRenewBefore},
	}
	got, _ := json.Marshal(c)
	wantJSON, _ := json.Marshal(want)
	if string(got) != string(wantJSON) {
		t.Errorf("config\n%s\nwant\n%s", got, wantJSON)
	}
}

func TestLoadConfigKeepsSetValues(t *testing.T) {
	c, err := LoadConfig(writeConfig(t, `
metadataURL: http://127.0.0.1:8080
tpm: unix:/run/swtpm.sock
stateDisk: /var/lib/lab/state.img
stateMount: /mnt/state
mapperName: lab-state
paths:
  state: /lab/state
  kubernetesDir: /lab/etc/kubernetes
  kubeletDir: /lab/var/lib/kubelet
sourceAddress: 127.0.0.5
initListen: 127.0.0.5:7451
joinListenHost: 127.0.0.5
pcrs: [0, 4, 7]
kubeadm: /opt/bin/kubeadm
ignorePreflightErrors: [SystemVerification]
ekCABundle: /lab/ek.pem
kubeconfig: /lab/admin.conf
policyFile: /lab/policy.json
policyConfigMap: other-policy
retryMax: 1m30s
`))
	if err != nil {
		t.Fatal(err)
	}
	wantPaths := nodestate.Paths{State: "/lab/state", KubernetesDir: "/lab/etc/kubernetes", KubeletDir: "/lab/var/lib/kubelet"}
	switch {
	case c.TPM != "unix:/run/swtpm.sock", c.MapperName != "lab-state", c.Paths != wantPaths, c.InitListen != "127.0.0.5:7451",
		c.Kubeadm != "/opt/bin/kubeadm", c.EKCABundle != "/lab/ek.pem", c.PolicyConfigMap != "other-policy",
		c.StateMount != "/mnt/state", c.SourceAddress != "127.0.0.5", c.JoinListenHost != "127.0.0.5",
		c.Kubeconfig != "/lab/admin.conf", c.PolicyFile != "/lab/policy.json",
		len(c.PCRs) != 3 || c.PCRs[2] != 7, len(c.IgnorePreflightErrors) != 1:
		t.Errorf("configured values were lost or replaced by defaults: %+v", c)
	}
	if c.RetryMax.Duration != 90*time.Second {
		t.Errorf("retryMax %v, want 1m30s", c.RetryMax.Duration)
	}
}

func TestLoadConfigStateDirs(t *testing.T) {
	tests := []struct {
		name, content string
		want          []string
	}{
		{"no state mount, nothing bound", minimalConfig, nil},
		{"state mount, the defaults", minimalConfig + "stateMount: /var/lib/berth\npaths:\n  state: /var/lib/berth\n  kubernetesDir: /k8s\n  kubeletDir: /kubelet\n",
			[]string{"/k8s", "/kubelet", "/var/lib/etcd"}},
		{"an empty list binds nothing", minimalConfig + "stateMount: /var/lib/berth\nstateDirs: []\n", []string{}},
		{"a list of one's own", minimalConfig + "stateMount: /var/lib/berth\nstateDirs: [/var/lib/containerd]\n", []string{"/var/lib/containerd"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := LoadConfig(writeConfig(t, tt.content))
			if err != nil {
				t.Fatal(err)
			}
			if (c.StateDirs == nil) != (tt.want == nil) || strings.Join(c.StateDirs, " ") != strings.Join(tt.want, " ") {
				t.Errorf("stateDirs = %#v, want %#v", c.StateDirs, tt.want)
			}
		})
	}
}

func TestLoadConfigDurations(t *testing.T) {
	tests := []struct {
		value   string
		want    time.Duration
		wantErr bool
	}{
		{value: `"30s"`, want: 30 * time.Second},
		{value: `2m`, want: 2 * time.Minute},
		{value: `1h0m0.5s`, want: time.Hour + 500*time.Millisecond},
		{value: `soon`, wantErr: true},
		{value: `5`, wantErr: true},
		{value: `[1s]`, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.value, func(t *testing.T) {
			c, err := LoadConfig(writeConfig(t, minimalConfig+"retryMax: "+tt.value+"\n"))
			if tt.wantErr {
				if err == nil {
					t.Fatalf("retryMax %s parsed to %v, want an error", tt.value, c.RetryMax)
				}
				if !strings.Contains(err.Error(), "duration") && !strings.Contains(err.Error(), "retryMax") {
					t.Errorf("error %q names neither the field nor durations", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if c.RetryMax.Duration != tt.want {
				t.Errorf("retryMax %s = %v, want %v", tt.value, c.RetryMax.Duration, tt.want)
			}
		})
	}
}

// TestLoadConfigValueForms: the exact matching of keys keeps what sigs.k8s.io/yaml accepted in values:
// numbers where text is wanted, YAML 1.1's yes for a bool, null for a field left out, anchors.
func TestLoadConfigValueForms(t *testing.T) {
	c, err := LoadConfig(writeConfig(t, minimalConfig+`
retryMax: ~
tpm: &dev /dev/tpm0
ekCABundle: *dev
pcrs: [0x7, 4]
kubelet:
  run: yes
  extraArgs:
    max-pods: 110
    v: 2
`))
	if err != nil {
		t.Fatal(err)
	}
	if got := c.Kubelet.ExtraArgs; len(got) != 2 || got["max-pods"] != "110" || got["v"] != "2" {
		t.Errorf("kubelet.extraArgs %v, want max-pods 110 and v 2 as text", got)
	}
	if !c.Kubelet.Run || c.RetryMax.Duration != 0 || c.TPM != "/dev/tpm0" || c.EKCABundle != "/dev/tpm0" ||
		len(c.PCRs) != 2 || c.PCRs[0] != 7 {
		t.Errorf("kubelet.run %v, retryMax %v, tpm %q, ekCABundle %q, pcrs %v", c.Kubelet.Run, c.RetryMax, c.TPM, c.EKCABundle, c.PCRs)
	}
}

func TestLoadConfigRefusals(t *testing.T) {
	tests := []struct {
		name    string
		content string
		want    []string
		// notWant are messages that must not appear: the fields that were given.
		notWant []string
	}{
		{name: "unknown field", content: minimalConfig + "stateDsk: /dev/vdc\n", want: []string{`unknown field "stateDsk"`}},
		{name: "cfssl without a key", content: minimalConfig + "cfssl:\n  url: http://127.0.0.1:8888\n  profile: kubelet\n",
			want: []string{"cfssl needs url, profile and authKeyFile"}},
		{name: "unknown nested field", content: minimalConfig + "paths:\n  state: /s\n  kubernetesDir: /k\n  kubeletDir: /l\n  pkiDir: /p\n",
			want: []string{`unknown field "pkiDir"`}},
		{name: "empty file", content: "", want: []string{"set exactly one of metadataURL", "stateDisk is required"}},
		{name: "no metadata URL", content: "stateDisk: /dev/vdb\n", want: []string{"set exactly one of metadataURL (a metadata service), userDataFile (bare metal), aws (EC2) and gcp (Compute Engine)"},
			notWant: []string{"stateDisk"}},
		{name: "metadata URL and user-data file", content: minimalConfig + "userDataFile: /etc/berth/user-data.json\n",
			want: []string{"set exactly one of metadataURL"}},
		{name: "metadata URL and aws", content: minimalConfig + "aws: {}\n", want: []string{"set exactly one of metadataURL"}},
		{name: "aws group of no role", content: "stateDisk: /dev/vdb\naws:\n  autoscalingGroups:\n    berth-workers: admin\n",
			want: []string{`aws.autoscalingGroups: "berth-workers": "admin" is not "control-plane" or "worker"`}},
		{name: "aws endpoint not a URL", content: "stateDisk: /dev/vdb\naws:\n  ec2Endpoint: 127.0.0.1:4566\n",
			want: []string{`aws.ec2Endpoint "127.0.0.1:4566" is not an http(s) URL`}},
		{name: "aws and gcp", content: "stateDisk: /dev/vdb\naws: {}\ngcp: {}\n", want: []string{"set exactly one of metadataURL"}},
		{name: "gone node grace on a cloud", content: "stateDisk: /dev/vdb\naws: {}\ngoneNodeGrace: 10m\n",
			want: []string{"goneNodeGrace: on AWS and GCP a stopped instance is not listed either"}},
		{name: "gcp group not a location and name", content: "stateDisk: /dev/vdb\ngcp:\n  instanceGroups:\n    berth-workers: worker\n",
			want: []string{`gcp.instanceGroups: instance group "berth-workers" is not "<region or zone>/<name>"`}},
		{name: "gcp group of no role", content: "stateDisk: /dev/vdb\ngcp:\n  instanceGroups:\n    europe-west1/berth-workers: admin\n",
			want: []string{`gcp.instanceGroups: "europe-west1/berth-workers": "admin" is not "control-plane" or "worker"`}},
		{name: "gcp endpoint not a URL", content: "stateDisk: /dev/vdb\ngcp:\n  computeEndpoint: 127.0.0.1:8080\n  metadataEndpoint: ftp://m\n",
			want: []string{`gcp.computeEndpoint "127.0.0.1:8080" is not an http(s) URL`, `gcp.metadataEndpoint "ftp://m" is not an http(s) URL`}},
		{name: "no state disk", content: "metadataURL: http://m\n", want: []string{"stateDisk is required"},
			notWant: []string{"metadataURL"}},
		{name: "paths incomplete", content: minimalConfig + "paths:\n  state: /s\n",
			want: []string{"paths.state, paths.kubernetesDir and paths.kubeletDir must all be set"}},
		{name: "not YAML", content: "metadataURL: [\n", want: []string{"parsing agent configuration"}},
		{name: "wrong type", content: minimalConfig + "pcrs: seven\n", want: []string{"parsing agent configuration"}},
		// encoding/json, under sigs.k8s.io/yaml, took any case: statedisk set stateDisk.
		{name: "key of another case", content: "metadataURL: http://m\nstatedisk: /dev/vdb\n",
			want: []string{`line 2: unknown field "statedisk" (keys are case-sensitive: did you mean "stateDisk"?)`}},
		{name: "nested key of another case", content: "stateDisk: /dev/vdb\naws:\n  autoScalingGroups:\n    berth-workers: worker\n",
			want: []string{`line 3: aws: unknown field "autoScalingGroups" (keys are case-sensitive: did you mean "autoscalingGroups"?)`}},
		{name: "key of another case in a pointer's struct", content: minimalConfig + "cfssl:\n  URL: http://c\n",
			want: []string{`line 4: cfssl: unknown field "URL" (keys are case-sensitive: did you mean "url"?)`}},
		{name: "duration without a unit", content: minimalConfig + "retryMax: 5\n",
			want: []string{"line 3: retryMax: a duration such as 5s or 1m30s, not 5"}},
		{name: "key set twice", content: minimalConfig + "tpm: /dev/tpm0\ntpm: /dev/tpmrm0\n",
			want: []string{"line 4: tpm: set twice (first on line 3)"}},
		{name: "list item of the wrong type", content: minimalConfig + "pcrs: [0, seven]\n",
			want: []string{`line 3: pcrs[1]: an integer, not "seven"`}},
		{name: "map value of the wrong type", content: minimalConfig + "aws:\n  autoscalingGroups:\n    workers: [worker]\n",
			want: []string{`line 5: aws.autoscalingGroups["workers"]: a string, not a list`}},
		{name: "bool of the wrong type", content: minimalConfig + "localUnlock: sometimes\n",
			want: []string{`line 3: localUnlock: true or false, not "sometimes"`}},
		{name: "not a mapping", content: "- stateDisk: /dev/vdb\n", want: []string{"line 1: top level: a mapping of fields, not a list"}},
		{name: "every problem of the YAML at once", content: "metadataURL: http://m\nstatedisk: /dev/vdb\nretryMax: 5\npaths: /p\n",
			want: []string{"parsing agent configuration " + "PATH" + ":\n  line 2: unknown field \"statedisk\"", "\n  line 3: retryMax: a duration",
				"\n  line 4: paths: a mapping of fields, not \"/p\""}},
		{name: "PCR out of range", content: minimalConfig + "pcrs: [24]\n", want: []string{"pcrs: 24 is not a PCR index (0 to 23)"}},
		{name: "PCR negative and PCR twice", content: minimalConfig + "pcrs: [-1, 7, 4, 7]\n",
			want: []string{"pcrs: -1 is not a PCR index (0 to 23)", "pcrs: 7 is listed twice"}, notWant: []string{"pcrs: 4"}},
		{name: "state dirs without a state mount", content: minimalConfig + "stateDirs: [/etc/kubernetes]\n",
			want: []string{"stateDirs: binding directories from the state volume needs stateMount"}},
		{name: "state dirs that cannot be bound", content: minimalConfig + "stateMount: /var/lib/berth\n" +
			"stateDirs: [etc/kubernetes, /var/lib/, /, /var/lib/berth/k, /var, /etc/kubernetes, /etc/kubernetes, /etc/kubernetes/pki]\n",
			want: []string{`stateDirs: "etc/kubernetes" is not a clean absolute path`, `stateDirs: "/var/lib/" is not a clean absolute path`,
				"stateDirs: / cannot be bound", "stateDirs: /var/lib/berth/k is on the state volume already (stateMount /var/lib/berth)",
				"stateDirs: binding /var would hide the state volume mounted at /var/lib/berth", "stateDirs: /etc/kubernetes is listed twice",
				"stateDirs: /etc/kubernetes/pki is below /etc/kubernetes: list only the upper one"}},
		{name: "verified root not a path", content: minimalConfig + "verifiedRoot: berth-root\n",
			want: []string{`verifiedRoot: "berth-root" is not an absolute path or none`}},
		{name: "relative state mount", content: minimalConfig + "stateMount: var/lib/berth\nstateDirs: []\n",
			want: []string{`stateMount: "var/lib/berth" is not an absolute path`}},
		{name: "source address not an address", content: minimalConfig + "sourceAddress: eth0\n",
			want: []string{`sourceAddress: "eth0" is not an IP address`}},
		{name: "every validation problem at once", content: "pcrs: [24]\n",
			want: []string{"agent configuration " + "PATH" + ":\n  set exactly one of metadataURL", "\n  stateDisk is required", "\n  line 1: pcrs: 24 is not a PCR index"}},
		// What issue 30 found accepted: each value refused before anything runs, with its line and field.
		{name: "metadata URL not http", content: "metadataURL: ftp://169.254.169.254\nstateDisk: /dev/vdb\n",
			want: []string{`line 1: metadataURL "ftp://169.254.169.254" is not an http(s) URL`}},
		{name: "metadata URL without a host", content: "metadataURL: http://\nstateDisk: /dev/vdb\n",
			want: []string{`line 1: metadataURL "http://" is not an http(s) URL`}},
		{name: "relative state disk", content: "metadataURL: http://m\nstateDisk: vdb\n",
			want: []string{`line 2: stateDisk: "vdb" is not an absolute path`}},
		{name: "init listen without a port", content: minimalConfig + "initListen: localhost\n",
			want: []string{`line 3: initListen: "localhost" is not host:port (such as :7451)`}},
		{name: "init listen on port 0", content: minimalConfig + "initListen: \":0\"\n",
			want: []string{`line 3: initListen: ":0" has port 0`}},
		{name: "join listen host not a host", content: minimalConfig + "joinListenHost: \"not a host!\"\n",
			want: []string{`line 3: joinListenHost: "not a host!" is not an IP address or a host name`}},
		{name: "negative durations", content: minimalConfig + "localUnlockRefresh: -5m\nretryMax: -1s\ncertificateRenewBefore: -720h\ngoneNodeGrace: -1m\n",
			want: []string{"line 3: localUnlockRefresh: -5m0s is negative", "line 4: retryMax: -1s is negative", "line 5: certificateRenewBefore: -720h0m0s is negative",
				"line 6: goneNodeGrace: -1m0s is negative"}},
		{name: "kubelet flags of the agent's own, a cloud provider of no form", content: minimalConfig + "kubelet:\n  cloudProvider: aws\n  extraArgs:\n    provider-id: aws:///us-east-1a/i-0\n    node-ip: 10.0.0.1\n",
			want: []string{`line 4: kubelet.cloudProvider: "aws" is not "external"`, "line 5: kubelet.extraArgs: node-ip is set by the agent from the node's address; leave it out",
				"line 5: kubelet.extraArgs: provider-id is set by the agent from the platform"}},
		{name: "TPMs of no form", content: minimalConfig + "tpm: tpmrm0\n", want: []string{`line 3: tpm: "tpmrm0" is not a device path`}},
		{name: "software TPM on a relative socket", content: minimalConfig + "tpm: unix:tpm.sock\n",
			want: []string{`line 3: tpm: "unix:tpm.sock" is not unix:<absolute path of a socket>`}},
		{name: "software TPM without a port", content: minimalConfig + "tpm: tcp:localhost\n",
			want: []string{`line 3: tpm: "tcp:localhost" is not tcp:<host:port>`}},
		{name: "relative files", content: minimalConfig + "ekCABundle: ek.pem\nkubeconfig: kc\npolicyFile: p.yaml\npaths:\n  state: s\n  kubernetesDir: /k\n  kubeletDir: /l\n",
			want: []string{`line 3: ekCABundle: "ek.pem" is not an absolute path`, `line 4: kubeconfig: "kc" is not an absolute path`,
				`line 5: policyFile: "p.yaml" is not an absolute path`, `line 7: paths.state: "s" is not an absolute path`}},
		{name: "metrics listen of a non-numeric port", content: minimalConfig + "metricsListen: \"0.0.0.0:http\"\n",
			want: []string{`line 3: metricsListen: "0.0.0.0:http" is not host:port`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := writeConfig(t, tt.content)
			c, err := LoadConfig(path)
			if err == nil {
				t.Fatalf("LoadConfig = %+v, want an error", c)
			}
			if !strings.Contains(err.Error(), path) {
				t.Errorf("error %q does not name the file", err)
			}
			for _, w := range tt.want {
				if w = strings.ReplaceAll(w, "PATH", path); !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
			for _, nw := range tt.notWant {
				if strings.Contains(err.Error(), nw) {
					t.Errorf("error %q complains about %q, which is set", err, nw)
				}
			}
		})
	}
}

func TestLoadConfigMissingFile(t *testing.T) {
	_, err := LoadConfig(filepath.Join(t.TempDir(), "absent.yaml"))
	if err == nil || !strings.Contains(err.Error(), "reading agent configuration") || !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("LoadConfig of a missing file: %v", err)
	}
}

func TestSealsLocally(t *testing.T) {
	on, off := true, false
	for _, tc := range []struct {
		setting *bool
		role    metadata.Role
		want    bool
	}{
		{nil, metadata.RoleControlPlane, true},
		{nil, metadata.RoleWorker, false},
		{&off, metadata.RoleControlPlane, false},
		{&on, metadata.RoleWorker, true},
	} {
		c := &Config{LocalUnlock: tc.setting}
		if got := c.sealsLocally(tc.role); got != tc.want {
			t.Errorf("localUnlock %v, role %s: sealsLocally = %v, want %v", tc.setting, tc.role, got, tc.want)
		}
	}
}

// TestPlatformChoice: the configuration's one source of metadata picks the platform, and with it how the
// node reads itself and how its join service finds the other nodes.
func TestPlatformChoice(t *testing.T) {
	for _, c := range []struct {
		content, want string
	}{
		{minimalConfig, "lab"},
		{"userDataFile: /etc/berth/user-data.json\nstateDisk: /dev/vdb\n", "bare-metal"},
		{"aws: {}\nstateDisk: /dev/nvme1n1\n", "aws"},
		{"gcp: {}\nstateDisk: /dev/sdb\n", "gcp"},
	} {
		cfg, err := LoadConfig(writeConfig(t, c.content))
		if err != nil {
			t.Fatal(err)
		}
		if got := cfg.Platform().Name(); got != c.want {
			t.Errorf("%q: platform %q, want %q", c.content, got, c.want)
		}
	}
}

// TestLoadConfigAcceptsForms: the forms each checked field takes.
func TestLoadConfigAcceptsForms(t *testing.T) {
	for _, extra := range []string{
		"tpm: unix:/run/swtpm/tpm.sock\n", "tpm: tcp:127.0.0.1:2321\n", "tpm: /dev/tpm0\n",
		"initListen: 10.0.0.5:7451\n", "initListen: \"[::1]:7451\"\n", "initListen: node-1.internal:7451\n",
		"joinListenHost: 10.0.0.5\n", "joinListenHost: \"::\"\n", "joinListenHost: cp-0.berth.internal.\n",
		"localUnlockRefresh: 30s\nretryMax: 0s\n",
	} {
		c, err := LoadConfig(writeConfig(t, "metadataURL: https://metadata.internal:8443/berth\nstateDisk: /dev/disk/by-id/virtio-berth-state\n"+extra))
		if err != nil {
			t.Errorf("%q: %v", extra, err)
		} else if c.LocalUnlockRefresh.Duration <= 0 {
			t.Errorf("%q: localUnlockRefresh %v", extra, c.LocalUnlockRefresh)
		}
	}
}

// FuzzLoadConfig: whatever the file holds, LoadConfig refuses it or returns a configuration the agent runs
// with, never panicking: durations that a ticker and a backoff take, listen addresses that are host:port, a
// platform. (A negative localUnlockRefresh once reached time.NewTicker and panicked after the join.)
func FuzzLoadConfig(f *testing.F) {
	for _, seed := range []string{
		minimalConfig,
		minimalConfig + "localUnlockRefresh: -5m\n",
		minimalConfig + "initListen: localhost\njoinListenHost: \"not a host!\"\n",
		"stateDisk: /dev/vdb\naws:\n  autoscalingGroups:\n    w: worker\n",
		"stateDisk: /dev/vdb\ngcp:\n  instanceGroups:\n    europe-west1/w: worker\n",
		"userDataFile: /etc/berth/user-data.json\nstateDisk: /dev/vdb\nstateMount: /var/lib/berth\n",
		minimalConfig + "tpm: tcp:[::1]:2321\nretryMax: 1h\nmetricsListen: \":9452\"\npcrs: [4, 9]\n",
	} {
		f.Add([]byte(seed))
	}
	path := filepath.Join(f.TempDir(), "agent.yaml")
	f.Fuzz(func(t *testing.T, data []byte) {
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
		c, err := LoadConfig(path)
		if err != nil {
			return
		}
		if c.RetryMax.Duration < 0 || c.LocalUnlockRefresh.Duration <= 0 {
			t.Fatalf("accepted retryMax %v and localUnlockRefresh %v", c.RetryMax, c.LocalUnlockRefresh)
		}
		time.NewTicker(c.LocalUnlockRefresh.Duration).Stop()
		for _, addr := range []string{c.InitListen, c.MetricsListen, net.JoinHostPort(c.JoinListenHost, "7452")} {
			if _, _, err := net.SplitHostPort(addr); addr != "" && err != nil {
				t.Fatalf("accepted a listen address %q: %v", addr, err)
			}
		}
		if c.Platform() == nil {
			t.Fatal("an accepted configuration names no platform")
		}
	})
}

// TestCloudImageConfigs: the example cloud images' agent.yaml load, name their platform and leave their nodes
// to the cloud's controller manager, which the guides install.
func TestCloudImageConfigs(t *testing.T) {
	for _, cloud := range []string{"aws", "gcp"} {
		c, err := LoadConfig(filepath.Join(repotest.Root(t), "examples", "packer", cloud, "agent.yaml"))
		if err != nil {
			t.Fatal(err)
		}
		if got := c.Platform().Name(); got != cloud {
			t.Errorf("examples/packer/%s/agent.yaml: platform %s", cloud, got)
		}
		if c.Kubelet.CloudProvider != CloudProviderExternal {
			t.Errorf("examples/packer/%s/agent.yaml: kubelet.cloudProvider %q, want %q", cloud, c.Kubelet.CloudProvider, CloudProviderExternal)
		}
	}
}
