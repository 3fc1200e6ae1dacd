package agent

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/hashicorp/hcl/v2"
	"github.com/hashicorp/hcl/v2/hcldec"
	"github.com/hashicorp/hcl/v2/hclsyntax"
	packersdk "github.com/hashicorp/packer-plugin-sdk/packer"
)

func sum(data string) string {
	h := sha256.Sum256([]byte(data))
	return hex.EncodeToString(h[:])
}

// sources writes local files with the given contents into a temporary directory and returns their paths.
func sources(t *testing.T, contents map[string]string) map[string]string {
	t.Helper()
	dir := t.TempDir()
	paths := map[string]string{}
	for name, data := range contents {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
		paths[name] = p
	}
	return paths
}

var contents = map[string]string{
	"berth-agent":     "#!/bin/sh\necho berth-agent \"$@\"\n",
	"kubelet":         "kubelet binary\n",
	"kubeadm":         "kubeadm binary\n",
	"agent.yaml":      "metadataURL: http://169.254.169.254\nstateDisk: /dev/vdb\n",
	"containerd.toml": "version = 2\n",
}

// validConfig is a configuration Prepare accepts, for files made by sources.
func validConfig(src map[string]string) map[string]any {
	return map[string]any{
		"agent_binary":      src["berth-agent"],
		"agent_sha256":      sum(contents["berth-agent"]),
		"agent_config":      src["agent.yaml"],
		"containerd_config": src["containerd.toml"],
		"files": []map[string]any{
			{"source": src["kubelet"], "destination": "/usr/bin/kubelet", "sha256": sum(contents["kubelet"]), "mode": "0750"},
			{"source": src["kubeadm"], "destination": "/usr/bin/kubeadm", "sha256": sum(contents["kubeadm"])},
		},
	}
}

func TestPrepare(t *testing.T) {
	src := sources(t, contents)
	file := func(change map[string]any) []map[string]any {
		f := map[string]any{"source": src["kubelet"], "destination": "/usr/bin/kubelet", "sha256": sum(contents["kubelet"])}
		maps.Copy(f, change)
		return []map[string]any{f}
	}
	for _, tc := range []struct {
		name   string
		change map[string]any
		want   []string
	}{
		{"valid", nil, nil},
		{"no agent_binary", map[string]any{"agent_binary": ""}, []string{"agent_binary is required"}},
		{"agent_binary missing", map[string]any{"agent_binary": src["kubelet"] + ".gone"}, []string{"agent_binary: stat ", "no such file"}},
		{"agent_binary a directory", map[string]any{"agent_binary": filepath.Dir(src["kubelet"])}, []string{"agent_binary: ", "is not a regular file"}},
		{"agent_sha256 upper case", map[string]any{"agent_sha256": strings.ToUpper(sum("x"))}, []string{"agent_sha256: ", "64 lowercase hex digits"}},
		{"agent_sha256 short", map[string]any{"agent_sha256": "abc"}, []string{"agent_sha256: \"abc\" is not a SHA-256"}},
		{"agent_config missing", map[string]any{"agent_config": "/nonexistent/agent.yaml"}, []string{"agent_config: stat /nonexistent/agent.yaml"}},
		{"containerd_config a directory", map[string]any{"containerd_config": "/"}, []string{"containerd_config: / is not a regular file"}},
		{"file without source", map[string]any{"files": file(map[string]any{"source": ""})}, []string{"files[0]: source is required"}},
		{"file without sha256", map[string]any{"files": file(map[string]any{"sha256": ""})}, []string{"files[0]: sha256 is required"}},
		{"file with a bad sha256", map[string]any{"files": file(map[string]any{"sha256": "sha256:" + sum("x")})}, []string{"files[0]: sha256: ", "is not a SHA-256"}},
		{"file without destination", map[string]any{"files": file(map[string]any{"destination": ""})}, []string{"files[0]: destination is required"}},
		{"relative destination", map[string]any{"files": file(map[string]any{"destination": "usr/bin/kubelet"})}, []string{"files[0]: destination: \"usr/bin/kubelet\" is not an absolute path"}},
		{"destination with ..", map[string]any{"files": file(map[string]any{"destination": "/usr/../etc/kubelet"})}, []string{"contains .."}},
		{"destination of a directory", map[string]any{"files": file(map[string]any{"destination": "/usr/bin/"})}, []string{"ends in /: name the file itself"}},
		{"unclean destination", map[string]any{"files": file(map[string]any{"destination": "/usr//bin/kubelet"})}, []string{"is not a clean path: write \"/usr/bin/kubelet\""}},
		{"destination with a newline", map[string]any{"files": file(map[string]any{"destination": "/usr/bin/kube\nlet"})}, []string{"contains a control character"}},
		{"mode not octal", map[string]any{"files": file(map[string]any{"mode": "0855"})}, []string{"files[0]: mode: \"0855\" is not an octal mode"}},
		{"mode too short", map[string]any{"files": file(map[string]any{"mode": "75"})}, []string{"not an octal mode"}},
		{"mode too long", map[string]any{"files": file(map[string]any{"mode": "00755"})}, []string{"not an octal mode"}},
		{"two files to one destination", map[string]any{"files": append(file(nil), file(nil)...)}, []string{"files[1]: destination /usr/bin/kubelet is also that of files[0]"}},
		{"a file over the agent", map[string]any{"files": file(map[string]any{"destination": AgentPath})}, []string{"files[0]: destination /usr/local/bin/berth-agent is also that of agent_binary"}},
		{"a file over the unit", map[string]any{"files": file(map[string]any{"destination": UnitPath})}, []string{"also that of the agent's unit"}},
		{"a file over agent_config", map[string]any{"files": file(map[string]any{"destination": AgentConfigPath})}, []string{"also that of agent_config"}},
		{"relative install_prefix", map[string]any{"install_prefix": "mnt"}, []string{"install_prefix: \"mnt\" is not an absolute path"}},
		{"staging_directory /", map[string]any{"staging_directory": "/"}, []string{"staging_directory: ", "/ cannot be it"}},
		{"staging_directory with a quote", map[string]any{"staging_directory": "/tmp/it's"}, []string{"staging_directory: ", "only letters"}},
		{"execute_command unparsable", map[string]any{"execute_command": "sh '{{.Path'"}, []string{"execute_command"}},
		{"execute_command with an unknown field", map[string]any{"execute_command": "sh '{{.Vars}}'"}, []string{"execute_command: ", "can't evaluate field Vars"}},
		{"execute_command blank", map[string]any{"execute_command": "{{if false}}x{{end}}"}, []string{"execute_command is empty"}},
		{"every error at once", map[string]any{"agent_binary": "", "files": file(map[string]any{"mode": "9", "sha256": ""})},
			[]string{"agent_binary is required", "files[0]: mode", "files[0]: sha256 is required"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			raw := validConfig(src)
			maps.Copy(raw, tc.change)
			p := &Provisioner{}
			err := p.Prepare(raw)
			if len(tc.want) == 0 {
				if err != nil {
					t.Fatalf("Prepare: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("Prepare accepted %v; want an error containing %q", tc.change, tc.want)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("Prepare error %q does not contain %q", err, w)
				}
			}
		})
	}
}

func TestPrepareDefaults(t *testing.T) {
	src := sources(t, contents)
	p := &Provisioner{}
	if err := p.Prepare(map[string]any{
		"agent_binary": src["berth-agent"],
		"files":        []map[string]any{{"source": src["kubelet"], "destination": "/usr/bin/kubelet", "sha256": sum(contents["kubelet"]), "mode": "750"}},
	}); err != nil {
		t.Fatal(err)
	}
	c := p.config
	if c.InstallPrefix != "/" || c.StagingDirectory != "/tmp/berth-provision" || c.ExecuteCommand != "sh '{{.Path}}'" {
		t.Errorf("defaults: install_prefix %q, staging_directory %q, execute_command %q", c.InstallPrefix, c.StagingDirectory, c.ExecuteCommand)
	}
	var got []string
	for _, it := range p.config.items {
		got = append(got, fmt.Sprintf("%s %s %s", it.staged, it.mode, it.dest))
	}
	want := []string{
		"00-berth-agent 0755 /usr/local/bin/berth-agent",
		"01-berth-agent.service 0644 /etc/systemd/system/berth-agent.service",
		"02-kubelet 0750 /usr/bin/kubelet",
	}
	if !slices.Equal(got, want) {
		t.Errorf("items:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// TestPrepareHCL2 decodes an HCL2 configuration with the generated spec, as Packer does before it hands the
// value to Prepare: files are blocks, and what they say arrives.
func TestPrepareHCL2(t *testing.T) {
	src := sources(t, contents)
	text := fmt.Sprintf(`
agent_binary    = %q
execute_command = "sudo -n sh '{{.Path}}'"
files {
  source      = %q
  destination = "/usr/bin/kubelet"
  sha256      = %q
  mode        = "0750"
}
files {
  source      = %q
  destination = "/usr/bin/kubeadm"
  sha256      = %q
}
`, src["berth-agent"], src["kubelet"], sum(contents["kubelet"]), src["kubeadm"], sum(contents["kubeadm"]))
	file, diags := hclsyntax.ParseConfig([]byte(text), "agent.pkr.hcl", hcl.InitialPos)
	if diags.HasErrors() {
		t.Fatal(diags)
	}
	p := &Provisioner{}
	val, diags := hcldec.Decode(file.Body, p.ConfigSpec(), nil)
	if diags.HasErrors() {
		t.Fatal(diags)
	}
	if err := p.Prepare(val); err != nil {
		t.Fatal(err)
	}
	got := []string{p.config.ExecuteCommand}
	for _, f := range p.config.Files {
		got = append(got, f.Destination+" "+f.Mode)
	}
	if want := []string{"sudo -n sh '{{.Path}}'", "/usr/bin/kubelet 0750", "/usr/bin/kubeadm "}; !slices.Equal(got, want) {
		t.Errorf("decoded %q, want %q", got, want)
	}
}

type upload struct{ path, data string }

// recorder is the SDK's MockCommunicator, which keeps only the last upload and command, with a record of
// every one. A command containing fail exits with status 1; afterUpload runs after each upload.
type recorder struct {
	packersdk.MockCommunicator
	uploads     []upload
	commands    []string
	fail        string
	afterUpload func()
}

func (r *recorder) Upload(path string, data io.Reader, fi *os.FileInfo) error {
	if err := r.MockCommunicator.Upload(path, data, fi); err != nil {
		return err
	}
	r.uploads = append(r.uploads, upload{path, r.UploadData})
	if r.afterUpload != nil {
		r.afterUpload()
	}
	return nil
}

// Start runs one command at a time, as Provision does: the previous command's exit is seen before the
// next one changes StartExitStatus.
func (r *recorder) Start(ctx context.Context, rc *packersdk.RemoteCmd) error {
	r.commands = append(r.commands, rc.Command)
	r.StartExitStatus = 0
	if r.fail != "" && strings.Contains(rc.Command, r.fail) {
		r.StartExitStatus = 1
	}
	return r.MockCommunicator.Start(ctx, rc)
}

func prepared(t *testing.T, change map[string]any) (*Provisioner, map[string]string) {
	t.Helper()
	src := sources(t, contents)
	raw := validConfig(src)
	maps.Copy(raw, change)
	p := &Provisioner{}
	if err := p.Prepare(raw); err != nil {
		t.Fatal(err)
	}
	return p, src
}

// TestProvisionMockCommunicator checks what is uploaded where and which commands run, in which order.
func TestProvisionMockCommunicator(t *testing.T) {
	p, _ := prepared(t, map[string]any{"install_prefix": "/mnt/image", "execute_command": "sudo -n sh '{{.Path}}'"})
	comm := &recorder{}
	ui := &packersdk.MockUi{}
	if err := p.Provision(context.Background(), ui, comm, nil); err != nil {
		t.Fatal(err)
	}

	wantCommands := []string{
		"mkdir -p '/tmp/berth-provision' && chmod 0700 '/tmp/berth-provision'",
		"sudo -n sh '/tmp/berth-provision/install.sh'",
	}
	if !slices.Equal(comm.commands, wantCommands) {
		t.Errorf("commands:\n%s\nwant:\n%s", strings.Join(comm.commands, "\n"), strings.Join(wantCommands, "\n"))
	}
	wantUploads := []upload{
		{"/tmp/berth-provision/00-berth-agent", contents["berth-agent"]},
		{"/tmp/berth-provision/01-berth-agent.service", string(unit)},
		{"/tmp/berth-provision/02-agent.yaml", contents["agent.yaml"]},
		{"/tmp/berth-provision/03-config.toml", contents["containerd.toml"]},
		{"/tmp/berth-provision/04-kubelet", contents["kubelet"]},
		{"/tmp/berth-provision/05-kubeadm", contents["kubeadm"]},
	}
	if len(comm.uploads) != len(wantUploads)+1 {
		t.Fatalf("%d uploads, want %d files and the script: %v", len(comm.uploads), len(wantUploads), comm.uploads)
	}
	if got := comm.uploads[:len(wantUploads)]; !slices.Equal(got, wantUploads) {
		t.Errorf("uploads %q, want %q", got, wantUploads)
	}

	script := comm.uploads[len(wantUploads)]
	if script.path != "/tmp/berth-provision/install.sh" {
		t.Errorf("the script went to %s", script.path)
	}
	for _, want := range []string{
		"staging='/tmp/berth-provision'\n",
		sum(contents["kubelet"]) + "  04-kubelet\n",
		sum(string(unit)) + "  01-berth-agent.service\n",
		"install -D -m 0755 '00-berth-agent' '/mnt/image/usr/local/bin/berth-agent'\n",
		"install -D -m 0644 '01-berth-agent.service' '/mnt/image/etc/systemd/system/berth-agent.service'\n",
		"install -D -m 0600 '02-agent.yaml' '/mnt/image/etc/berth/agent.yaml'\n",
		"install -D -m 0644 '03-config.toml' '/mnt/image/etc/containerd/config.toml'\n",
		"install -D -m 0750 '04-kubelet' '/mnt/image/usr/bin/kubelet'\n",
		"install -D -m 0755 '05-kubeadm' '/mnt/image/usr/bin/kubeadm'\n",
		"for target in '/mnt/image/usr/local/bin/berth-agent' '/mnt/image/etc/systemd/system/berth-agent.service' '/mnt/image/etc/berth/agent.yaml' '/mnt/image/etc/containerd/config.toml' '/mnt/image/usr/bin/kubelet' '/mnt/image/usr/bin/kubeadm'; do\n",
		"systemctl --root='/mnt/image' enable berth-agent.service\n",
		"ln -sf /etc/systemd/system/berth-agent.service '/mnt/image/etc/systemd/system/multi-user.target.wants/berth-agent.service'\n",
	} {
		if !strings.Contains(script.data, want) {
			t.Errorf("the script lacks %q:\n%s", want, script.data)
		}
	}

	var said []string
	for _, m := range ui.SayMessages {
		said = append(said, m.Message)
	}
	wantSaid := fmt.Sprintf("kubelet: 15 B, sha256 %s… → /mnt/image/usr/bin/kubelet", sum(contents["kubelet"])[:12])
	if !slices.Contains(said, wantSaid) {
		t.Errorf("the output lacks %q: %q", wantSaid, said)
	}
}

func TestProvisionRootPrefixEnablesPlainly(t *testing.T) {
	p, _ := prepared(t, nil)
	comm := &recorder{}
	if err := p.Provision(context.Background(), &packersdk.MockUi{}, comm, nil); err != nil {
		t.Fatal(err)
	}
	script := comm.uploads[len(comm.uploads)-1].data
	for _, want := range []string{"\tsystemctl enable berth-agent.service\n", "install -D -m 0750 '04-kubelet' '/usr/bin/kubelet'\n"} {
		if !strings.Contains(script, want) {
			t.Errorf("the script lacks %q:\n%s", want, script)
		}
	}
	if got := comm.commands[len(comm.commands)-1]; got != "sh '/tmp/berth-provision/install.sh'" {
		t.Errorf("the script ran as %q", got)
	}
}

func TestProvisionRefusesMismatchBeforeUpload(t *testing.T) {
	p, src := prepared(t, nil)
	// The kubelet changes after Prepare: only Provision's hash can notice.
	if err := os.WriteFile(src["kubelet"], []byte("another kubelet\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	comm := &recorder{}
	err := p.Provision(context.Background(), &packersdk.MockUi{}, comm, nil)
	if err == nil {
		t.Fatal("Provision installed a kubelet whose hash differs from its pin")
	}
	for _, want := range []string{"files[0]", src["kubelet"], "SHA-256 " + sum("another kubelet\n"), "expected " + sum(contents["kubelet"])} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %q", err, want)
		}
	}
	if comm.UploadCalled || comm.StartCalled {
		t.Errorf("something reached the machine: uploads %v, commands %v", comm.uploads, comm.commands)
	}
}

func TestProvisionWithoutCommunicator(t *testing.T) {
	p, _ := prepared(t, nil)
	err := p.Provision(context.Background(), &packersdk.MockUi{}, nil, nil)
	if err == nil || !strings.Contains(err.Error(), "no communicator") {
		t.Fatalf("Provision without a communicator = %v, want the reason", err)
	}
}

func TestProvisionScriptFailure(t *testing.T) {
	p, _ := prepared(t, nil)
	comm := &recorder{fail: "install.sh"}
	comm.StartStderr = "install: cannot create regular file '/usr/bin/kubelet': Permission denied\n"
	err := p.Provision(context.Background(), &packersdk.MockUi{}, comm, nil)
	if err == nil {
		t.Fatal("a failing install script did not fail the build")
	}
	for _, want := range []string{"the install script", "exited with status 1", "Permission denied"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q lacks %q", err, want)
		}
	}
}

func TestProvisionStagingFailure(t *testing.T) {
	p, _ := prepared(t, nil)
	comm := &recorder{fail: "mkdir"}
	comm.StartStderr = "mkdir: cannot create directory '/tmp/berth-provision': Read-only file system\n"
	err := p.Provision(context.Background(), &packersdk.MockUi{}, comm, nil)
	if err == nil || !strings.Contains(err.Error(), "creating the staging directory") || !strings.Contains(err.Error(), "Read-only file system") {
		t.Fatalf("Provision = %v, want the staging directory's failure with its output", err)
	}
	if comm.UploadCalled {
		t.Error("files were uploaded without a staging directory")
	}
}

func TestProvisionCancelledBetweenSteps(t *testing.T) {
	p, _ := prepared(t, nil)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	comm := &recorder{afterUpload: cancel}
	err := p.Provision(ctx, &packersdk.MockUi{}, comm, nil)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Provision = %v, want context.Canceled", err)
	}
	if len(comm.uploads) != 1 || len(comm.commands) != 1 {
		t.Errorf("after the cancellation: uploads %v, commands %v; want the first upload after mkdir only", comm.uploads, comm.commands)
	}

	comm = &recorder{}
	if err := p.Provision(ctx, &packersdk.MockUi{}, comm, nil); !errors.Is(err, context.Canceled) || comm.UploadCalled || comm.StartCalled {
		t.Errorf("Provision with a cancelled context = %v, uploads %v, commands %v", err, comm.uploads, comm.commands)
	}
}

// TestDocsListEveryOption keeps the hand-written documentation in step with Config and File: every option
// of the HCL2 specs that packer-sdc generates is documented, and nothing else is. Options of the files
// blocks are listed under the heading that names `files`.
func TestDocsListEveryOption(t *testing.T) {
	const page = "packer/docs/provisioners/agent.mdx"
	doc, err := os.ReadFile("../../docs/provisioners/agent.mdx")
	if err != nil {
		t.Fatal(err)
	}
	documented := map[string]map[string]bool{"": {}, "files": {}}
	inReference, scope := false, ""
	for _, line := range strings.Split(string(doc), "\n") {
		switch {
		case strings.HasPrefix(line, "## "):
			inReference, scope = line == "## Configuration Reference", ""
		case strings.HasPrefix(line, "### "):
			scope = ""
			if strings.Contains(line, "`files`") {
				scope = "files"
			}
		case inReference && strings.HasPrefix(line, "- `"):
			name, _, _ := strings.Cut(strings.TrimPrefix(line, "- `"), "`")
			documented[scope][name] = true
		}
	}
	specs := map[string]map[string]bool{"": {}, "files": {}}
	for name := range (&Provisioner{}).ConfigSpec() {
		if !strings.HasPrefix(name, "packer_") {
			specs[""][name] = true
		}
	}
	for name := range (&File{}).FlatMapstructure().HCL2Spec() {
		specs["files"][name] = true
	}
	for scope, names := range specs {
		for name := range names {
			if !documented[scope][name] {
				t.Errorf("option %q (files block: %v) is not documented in %s", name, scope == "files", page)
			}
		}
		for name := range documented[scope] {
			if !names[name] {
				t.Errorf("%s documents %q (files block: %v), which is no option", page, name, scope == "files")
			}
		}
	}
}

// TestUnitStartsAgentBoot ties the unit to where the provisioner installs the agent and its configuration.
func TestUnitStartsAgentBoot(t *testing.T) {
	want := "\nExecStart=" + AgentPath + " boot --config " + AgentConfigPath + "\n"
	if !strings.Contains(string(unit), want) {
		t.Errorf("%s lacks %q:\n%s", UnitName, want, unit)
	}
}
