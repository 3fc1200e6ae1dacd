package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// subnetFile is what flanneld v0.27.4 writes with --ip-masq: the subnet carries the gateway's address.
const subnetFile = "FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_SUBNET=10.244.1.1/24\nFLANNEL_MTU=1450\nFLANNEL_IPMASQ=true\n"

// node is a node's files for the plugin: the subnet file, the data directory and CNI_PATH's last
// directory, where the fake delegate goes.
type node struct {
	dir, subnetFile, dataDir, bin string
}

// newNode makes a node with subnet as its subnet file and sets the environment the runtime gives plugins.
func newNode(t *testing.T, subnet string) node {
	t.Helper()
	dir := t.TempDir()
	n := node{dir: dir, subnetFile: filepath.Join(dir, "subnet.env"), dataDir: filepath.Join(dir, "data"), bin: filepath.Join(dir, "bin")}
	if err := os.WriteFile(n.subnetFile, []byte(subnet), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(n.bin, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("CNI_CONTAINERID", "c0ffee")
	t.Setenv("CNI_NETNS", "/var/run/netns/pod")
	t.Setenv("CNI_IFNAME", "eth0")
	// Two directories, the first without the delegate: it is looked up along the list.
	t.Setenv("CNI_PATH", filepath.Join(dir, "none")+string(filepath.ListSeparator)+n.bin)
	return n
}

// conf is the network configuration of upstream's manifest, pointed at the node's files.
func (n node) conf(extra string) string {
	return fmt.Sprintf(`{"cniVersion":"0.3.1","name":"cbr0","type":"flannel","subnetFile":%q,"dataDir":%q,
		"delegate":{"hairpinMode":true,"isDefaultGateway":true}%s}`, n.subnetFile, n.dataDir, extra)
}

// fakeDelegate installs a delegate plugin named typ that records its stdin and environment in the node's
// directory under the command's name, prints output and exits with status.
func (n node) fakeDelegate(t *testing.T, typ, output string, status int) {
	t.Helper()
	script := fmt.Sprintf("#!/bin/sh\ncat >%[1]q/\"$CNI_COMMAND.stdin\"\nenv >%[1]q/\"$CNI_COMMAND.env\"\nprintf '%%s\\n' %[2]q\nexit %[3]d\n",
		n.dir, output, status)
	if err := os.WriteFile(filepath.Join(n.bin, typ), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
}

// recorded returns what the fake delegate got on stdin for command ("" if it did not run), and its
// environment.
func (n node) recorded(t *testing.T, command string) (stdin, env string) {
	t.Helper()
	in, err := os.ReadFile(filepath.Join(n.dir, command+".stdin"))
	if os.IsNotExist(err) {
		return "", ""
	}
	if err != nil {
		t.Fatal(err)
	}
	e, err := os.ReadFile(filepath.Join(n.dir, command+".env"))
	if err != nil {
		t.Fatal(err)
	}
	return string(in), string(e)
}

// invoke runs the plugin as the runtime does and returns its exit status and stdout.
func invoke(t *testing.T, command, conf string) (int, string) {
	t.Helper()
	t.Setenv("CNI_COMMAND", command)
	var stdout, stderr bytes.Buffer
	status := run(strings.NewReader(conf), &stdout, &stderr)
	if stderr.Len() > 0 {
		t.Logf("%s stderr: %s", command, stderr.String())
	}
	return status, stdout.String()
}

// assertJSON fails unless got and want are the same JSON value.
func assertJSON(t *testing.T, what, got, want string) {
	t.Helper()
	var g, w any
	if err := json.Unmarshal([]byte(got), &g); err != nil {
		t.Fatalf("%s is not JSON: %v\n%s", what, err, got)
	}
	if err := json.Unmarshal([]byte(want), &w); err != nil {
		t.Fatal(err)
	}
	gb, _ := json.Marshal(g)
	wb, _ := json.Marshal(w)
	if !bytes.Equal(gb, wb) {
		t.Errorf("%s\n%s\nwant\n%s", what, gb, wb)
	}
}

func TestDelegateConf(t *testing.T) {
	n := newNode(t, subnetFile)
	for _, tc := range []struct {
		name, delegate, want string
	}{{
		name:     "upstream's manifest",
		delegate: `{"hairpinMode":true,"isDefaultGateway":true}`,
		want: `{"cniVersion":"0.3.1","name":"cbr0","type":"bridge","hairpinMode":true,"isDefaultGateway":true,
			"mtu":1450,"ipMasq":false,"isGateway":true,
			"ipam":{"type":"host-local","ranges":[[{"subnet":"10.244.1.0/24"}]],"routes":[{"dst":"10.244.0.0/16"}]}}`,
	}, {
		name:     "no delegate",
		delegate: `null`,
		want: `{"cniVersion":"0.3.1","name":"cbr0","type":"bridge","mtu":1450,"ipMasq":false,"isGateway":true,
			"ipam":{"type":"host-local","ranges":[[{"subnet":"10.244.1.0/24"}]],"routes":[{"dst":"10.244.0.0/16"}]}}`,
	}, {
		name:     "the delegate's own fields win, but not its name and version",
		delegate: `{"name":"other","cniVersion":"1.0.0","mtu":1400,"ipMasq":true,"isGateway":false,"ipam":{"type":"static"},"bridge":"cni0"}`,
		want: `{"cniVersion":"0.3.1","name":"cbr0","type":"bridge","bridge":"cni0","mtu":1400,"ipMasq":true,"isGateway":false,
			"ipam":{"type":"static"}}`,
	}, {
		name:     "another plugin gets no bridge's isGateway",
		delegate: `{"type":"ipvlan","master":"eth0"}`,
		want: `{"cniVersion":"0.3.1","name":"cbr0","type":"ipvlan","master":"eth0","mtu":1450,"ipMasq":false,
			"ipam":{"type":"host-local","ranges":[[{"subnet":"10.244.1.0/24"}]],"routes":[{"dst":"10.244.0.0/16"}]}}`,
	}} {
		t.Run(tc.name, func(t *testing.T) {
			conf, err := parseConf([]byte(fmt.Sprintf(`{"cniVersion":"0.3.1","name":"cbr0","type":"flannel","delegate":%s}`, tc.delegate)))
			if err != nil {
				t.Fatal(err)
			}
			env, err := readSubnetEnv(n.subnetFile)
			if err != nil {
				t.Fatal(err)
			}
			got, err := json.Marshal(delegateConf(conf, env))
			if err != nil {
				t.Fatal(err)
			}
			assertJSON(t, "delegate configuration", string(got), tc.want)
		})
	}
}

func TestParseConfDefaults(t *testing.T) {
	conf, err := parseConf([]byte(`{"cniVersion":"1.0.0","name":"cbr0","type":"flannel"}`))
	if err != nil {
		t.Fatal(err)
	}
	if conf.SubnetFile != "/run/flannel/subnet.env" || conf.DataDir != "/var/lib/cni/flannel" {
		t.Errorf("subnet file %q and data directory %q, want upstream's defaults", conf.SubnetFile, conf.DataDir)
	}
}

func TestReadSubnetEnvRefusesBadFiles(t *testing.T) {
	for _, tc := range []struct{ name, file, want string }{
		{"a key missing", "FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_SUBNET=10.244.1.1/24\nFLANNEL_IPMASQ=true\n", "no FLANNEL_MTU"},
		{"a bad subnet", strings.Replace(subnetFile, "10.244.1.1/24", "10.244.1.1", 1), "FLANNEL_SUBNET"},
		{"a bad MTU", strings.Replace(subnetFile, "1450", "big", 1), "FLANNEL_MTU"},
		{"a bad flag", strings.Replace(subnetFile, "IPMASQ=true", "IPMASQ=yes", 1), "FLANNEL_IPMASQ"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := newNode(t, tc.file)
			_, err := readSubnetEnv(n.subnetFile)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("got error %v, want one naming %s", err, tc.want)
			}
		})
	}
}

// TestAddCheckDel runs a delegate through ADD, CHECK and DEL; CHECK and DEL after flanneld's subnet file is
// gone, as when the node's flanneld stopped.
func TestAddCheckDel(t *testing.T) {
	n := newNode(t, subnetFile)
	const result = `{"cniVersion":"0.3.1","ips":[{"version":"4","address":"10.244.1.2/24","gateway":"10.244.1.1"}]}`
	n.fakeDelegate(t, "bridge", result, 0)

	status, out := invoke(t, "ADD", n.conf(""))
	if status != 0 {
		t.Fatalf("ADD exited %d: %s", status, out)
	}
	assertJSON(t, "ADD's output", out, result)
	stdin, env := n.recorded(t, "ADD")
	wantConf := `{"cniVersion":"0.3.1","name":"cbr0","type":"bridge","hairpinMode":true,"isDefaultGateway":true,
		"mtu":1450,"ipMasq":false,"isGateway":true,
		"ipam":{"type":"host-local","ranges":[[{"subnet":"10.244.1.0/24"}]],"routes":[{"dst":"10.244.0.0/16"}]}}`
	assertJSON(t, "the delegate's stdin on ADD", stdin, wantConf)
	for _, v := range []string{"CNI_COMMAND=ADD", "CNI_CONTAINERID=c0ffee", "CNI_NETNS=/var/run/netns/pod", "CNI_IFNAME=eth0", "CNI_PATH=" + os.Getenv("CNI_PATH")} {
		if !strings.Contains(env, v+"\n") {
			t.Errorf("the delegate's environment lacks %s:\n%s", v, env)
		}
	}
	saved, err := os.ReadFile(filepath.Join(n.dataDir, "c0ffee"))
	if err != nil {
		t.Fatalf("ADD saved no configuration for DEL: %v", err)
	}
	assertJSON(t, "the saved configuration", string(saved), wantConf)

	if err := os.Remove(n.subnetFile); err != nil {
		t.Fatal(err)
	}
	status, out = invoke(t, "CHECK", n.conf(`,"prevResult":`+result))
	if status != 0 {
		t.Fatalf("CHECK exited %d: %s", status, out)
	}
	stdin, _ = n.recorded(t, "CHECK")
	assertJSON(t, "the delegate's stdin on CHECK", stdin, strings.TrimSuffix(wantConf, "}")+`,"prevResult":`+result+"}")

	status, out = invoke(t, "DEL", n.conf(""))
	if status != 0 {
		t.Fatalf("DEL exited %d: %s", status, out)
	}
	stdin, env = n.recorded(t, "DEL")
	assertJSON(t, "the delegate's stdin on DEL", stdin, wantConf)
	if !strings.Contains(env, "CNI_COMMAND=DEL\n") {
		t.Errorf("the delegate ran without CNI_COMMAND=DEL:\n%s", env)
	}
	if _, err := os.Stat(filepath.Join(n.dataDir, "c0ffee")); !os.IsNotExist(err) {
		t.Errorf("DEL left the saved configuration: %v", err)
	}
}

// TestDelIsIdempotent: a DEL with nothing saved (ADD failed early, or DEL ran before) succeeds without a
// delegate, and without the subnet file.
func TestDelIsIdempotent(t *testing.T) {
	n := newNode(t, subnetFile)
	n.fakeDelegate(t, "bridge", `{}`, 0)
	if err := os.Remove(n.subnetFile); err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		if status, out := invoke(t, "DEL", n.conf("")); status != 0 || out != "" {
			t.Errorf("DEL %d exited %d with %q, want 0 and no output", i+1, status, out)
		}
	}
	if stdin, _ := n.recorded(t, "DEL"); stdin != "" {
		t.Errorf("DEL ran the delegate with nothing saved:\n%s", stdin)
	}
}

// TestDelegateFailurePassesThrough: the runtime reads the delegate's error and status; a failed DEL keeps
// the saved configuration for the runtime's retry.
func TestDelegateFailurePassesThrough(t *testing.T) {
	n := newNode(t, subnetFile)
	const failure = `{"cniVersion":"0.3.1","code":7,"msg":"bridge says no"}`
	n.fakeDelegate(t, "bridge", failure, 3)
	for _, command := range []string{"ADD", "DEL"} {
		status, out := invoke(t, command, n.conf(""))
		if status != 3 {
			t.Errorf("%s exited %d, want the delegate's 3", command, status)
		}
		assertJSON(t, command+"'s output", out, failure)
	}
	if _, err := os.Stat(filepath.Join(n.dataDir, "c0ffee")); err != nil {
		t.Errorf("a failed DEL removed the saved configuration: %v", err)
	}
}

func TestErrors(t *testing.T) {
	for _, tc := range []struct {
		name, command, conf string
		env                 map[string]string
		code                int
		msg                 string
	}{
		{name: "no subnet file", command: "ADD", conf: `{"cniVersion":"0.3.1","name":"cbr0","type":"flannel","subnetFile":"/nonexistent/subnet.env"}`,
			code: codeTryAgainLater, msg: "flanneld is not running"},
		{name: "not JSON", command: "ADD", conf: `{"cniVersion":`, code: codeDecode, msg: "decoding"},
		{name: "an unknown version", command: "ADD", conf: `{"cniVersion":"9.9.9","name":"cbr0","type":"flannel"}`,
			code: codeIncompatibleVersion, msg: "9.9.9"},
		{name: "an unknown command", command: "GC", conf: `{"cniVersion":"1.0.0","name":"cbr0","type":"flannel"}`,
			code: codeInvalidEnv, msg: "GC"},
		{name: "no container ID", command: "DEL", conf: `{"cniVersion":"1.0.0","name":"cbr0","type":"flannel"}`,
			env: map[string]string{"CNI_CONTAINERID": ""}, code: codeInvalidEnv, msg: "CNI_CONTAINERID"},
		{name: "a container ID that is a path", command: "DEL", conf: `{"cniVersion":"1.0.0","name":"cbr0","type":"flannel"}`,
			env: map[string]string{"CNI_CONTAINERID": "../../etc/passwd"}, code: codeInvalidEnv, msg: "CNI_CONTAINERID"},
		{name: "no delegate plugin", command: "ADD", env: map[string]string{"CNI_PATH": "/nonexistent"}, code: codeInvalidEnv, msg: `"bridge"`},
		{name: "CHECK before ADD", command: "CHECK", code: codeUnknownContainer, msg: "no ADD"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := newNode(t, subnetFile)
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			conf := tc.conf
			if conf == "" {
				conf = n.conf("")
			}
			status, out := invoke(t, tc.command, conf)
			if status != 1 {
				t.Errorf("exited %d, want 1", status)
			}
			var got cniError
			if err := json.Unmarshal([]byte(out), &got); err != nil {
				t.Fatalf("the output is no CNI error: %v\n%s", err, out)
			}
			if got.Code != tc.code || !strings.Contains(got.Msg, tc.msg) || got.CNIVersion == "" {
				t.Errorf("got %+v, want code %d and a message naming %s", got, tc.code, tc.msg)
			}
		})
	}
}

func TestVersion(t *testing.T) {
	status, out := invoke(t, "VERSION", "")
	if status != 0 {
		t.Fatalf("VERSION exited %d", status)
	}
	assertJSON(t, "VERSION's output", out, `{"cniVersion":"1.0.0","supportedVersions":["0.1.0","0.2.0","0.3.0","0.3.1","0.4.0","1.0.0"]}`)
}
