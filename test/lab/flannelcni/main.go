// Command flannelcni is the lab's stand-in for Flannel's CNI plugin, the "flannel" plugin of
// github.com/flannel-io/cni-plugin: the Go module proxy refuses that module at every version, so the lab
// cannot build upstream's plugin from source. It does what upstream's does. On ADD it turns the node's lease,
// which flanneld writes to its subnet file, into the configuration of a delegate plugin (bridge with
// host-local IPAM unless configured otherwise), saves that configuration so that DEL still works once
// flanneld and its file are gone, and runs the delegate. It is written from the CNI specification with the
// standard library only. The lab ships it in berthlab.local/flannel-cni-plugin where upstream's manifest
// names ghcr.io/flannel-io/flannel-cni-plugin; clouds run upstream's plugin from that image, not this one.
package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// supportedVersions are the CNI versions of the configurations the plugin takes. It passes the delegate's
// result through unchanged, so these are the versions Debian's bridge and host-local (plugins 1.1.1) speak.
var supportedVersions = []string{"0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0"}

// Error codes of the CNI specification.
const (
	codeIncompatibleVersion = 1
	codeUnknownContainer    = 3
	codeInvalidEnv          = 4
	codeIO                  = 5
	codeDecode              = 6
	codeInvalidConfig       = 7
	codeTryAgainLater       = 11
	// codeInternal is what libcni's plugins report for failures the specification has no code for.
	codeInternal = 999
)

// cniError is a failure as the runtime reads it from the plugin's stdout.
type cniError struct {
	CNIVersion string `json:"cniVersion"`
	Code       int    `json:"code"`
	Msg        string `json:"msg"`
}

func (e *cniError) Error() string { return e.Msg }

func newError(code int, format string, args ...any) *cniError {
	return &cniError{Code: code, Msg: fmt.Sprintf(format, args...)}
}

// netConf is the plugin's network configuration; the delegate's fields stay as written.
type netConf struct {
	CNIVersion string         `json:"cniVersion"`
	Name       string         `json:"name"`
	SubnetFile string         `json:"subnetFile"`
	DataDir    string         `json:"dataDir"`
	Delegate   map[string]any `json:"delegate"`
	// PrevResult is ADD's result, which the runtime passes to CHECK.
	PrevResult json.RawMessage `json:"prevResult"`
}

// subnetEnv is the node's lease, as flanneld writes it to the subnet file.
type subnetEnv struct {
	network, subnet netip.Prefix
	mtu             int
	ipMasq          bool
}

func main() {
	os.Exit(run(os.Stdin, os.Stdout, os.Stderr))
}

// run carries out the command in CNI_COMMAND with the configuration on stdin and returns the exit status.
func run(stdin io.Reader, stdout, stderr io.Writer) int {
	command := os.Getenv("CNI_COMMAND")
	if command == "VERSION" {
		return writeJSON(stdout, map[string]any{"cniVersion": latestVersion(), "supportedVersions": supportedVersions})
	}
	var conf netConf
	data, err := io.ReadAll(stdin)
	if err != nil {
		err = newError(codeIO, "reading the network configuration: %v", err)
	} else if conf, err = parseConf(data); err == nil {
		var status int
		if status, err = execute(command, conf, stdout, stderr); err == nil {
			return status
		}
	}
	var cerr *cniError
	if !errors.As(err, &cerr) {
		cerr = &cniError{Code: codeInternal, Msg: err.Error()}
	}
	cerr.CNIVersion = conf.CNIVersion
	if !slices.Contains(supportedVersions, cerr.CNIVersion) {
		cerr.CNIVersion = latestVersion()
	}
	writeJSON(stdout, cerr)
	return 1
}

func latestVersion() string { return supportedVersions[len(supportedVersions)-1] }

// writeJSON writes v to w and returns the exit status that goes with it.
func writeJSON(w io.Writer, v any) int {
	if err := json.NewEncoder(w).Encode(v); err != nil {
		return 1
	}
	return 0
}

// parseConf decodes the network configuration, with upstream's defaults for the plugin's own fields.
func parseConf(data []byte) (netConf, error) {
	conf := netConf{SubnetFile: "/run/flannel/subnet.env", DataDir: "/var/lib/cni/flannel"}
	dec := json.NewDecoder(bytes.NewReader(data))
	// The delegate gets its numbers as they were written, not rounded through float64.
	dec.UseNumber()
	if err := dec.Decode(&conf); err != nil {
		return netConf{}, newError(codeDecode, "decoding the network configuration: %v", err)
	}
	if conf.CNIVersion != "" && !slices.Contains(supportedVersions, conf.CNIVersion) {
		return conf, newError(codeIncompatibleVersion, "CNI version %s is not supported; the plugin supports %s",
			conf.CNIVersion, strings.Join(supportedVersions, ", "))
	}
	return conf, nil
}

// execute runs command for the container in CNI_CONTAINERID and returns the exit status.
func execute(command string, conf netConf, stdout, stderr io.Writer) (int, error) {
	if !slices.Contains([]string{"ADD", "DEL", "CHECK"}, command) {
		return 0, newError(codeInvalidEnv, "CNI_COMMAND %q is none of ADD, DEL, CHECK and VERSION", command)
	}
	id := os.Getenv("CNI_CONTAINERID")
	if err := checkContainerID(id); err != nil {
		return 0, err
	}
	saved := filepath.Join(conf.DataDir, id)
	switch command {
	case "ADD":
		return add(conf, saved, stdout, stderr)
	case "DEL":
		return del(saved, stdout, stderr)
	default:
		return check(conf, saved, stdout, stderr)
	}
}

// checkContainerID refuses what the specification does not allow as a container ID: the ID names the file
// that keeps the delegate's configuration, so it must not reach outside the data directory.
func checkContainerID(id string) error {
	if id == "" {
		return newError(codeInvalidEnv, "CNI_CONTAINERID is not set")
	}
	for i, r := range id {
		alnum := 'a' <= r && r <= 'z' || 'A' <= r && r <= 'Z' || '0' <= r && r <= '9'
		if !alnum && (i == 0 || !strings.ContainsRune("_.-", r)) {
			return newError(codeInvalidEnv, "CNI_CONTAINERID %q is not a container ID: letters, digits, _ . - only, starting with a letter or digit", id)
		}
	}
	return nil
}

func add(conf netConf, saved string, stdout, stderr io.Writer) (int, error) {
	env, err := readSubnetEnv(conf.SubnetFile)
	if err != nil {
		return 0, err
	}
	d := delegateConf(conf, env)
	// Found before saving: DEL must be able to run what ADD saved.
	path, data, err := prepareDelegate(d)
	if err != nil {
		return 0, err
	}
	// Saved before the delegate runs: after a failed ADD the runtime calls DEL, which frees whatever the
	// delegate took with the same configuration, even when the lease has gone with flanneld by then.
	if err := save(saved, data); err != nil {
		return 0, newError(codeIO, "saving the delegate's configuration: %v", err)
	}
	return runDelegate(path, data, stdout, stderr)
}

func del(saved string, stdout, stderr io.Writer) (int, error) {
	d, err := loadSaved(saved)
	if errors.Is(err, fs.ErrNotExist) {
		// ADD never got as far as the delegate, or an earlier DEL finished: nothing is left to free.
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	status, err := runSaved(d, stdout, stderr)
	if err != nil || status != 0 {
		return status, err
	}
	// Removed only after the delegate succeeded, so that the runtime's retry of a failed DEL still has it.
	if err := os.Remove(saved); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return 0, newError(codeIO, "removing the delegate's configuration: %v", err)
	}
	return 0, nil
}

func check(conf netConf, saved string, stdout, stderr io.Writer) (int, error) {
	d, err := loadSaved(saved)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, newError(codeUnknownContainer, "no ADD of this container is recorded in %s", saved)
	}
	if err != nil {
		return 0, err
	}
	// The delegate checks the result of its own ADD, which the runtime hands to this plugin.
	if conf.PrevResult != nil {
		d["prevResult"] = conf.PrevResult
	}
	return runSaved(d, stdout, stderr)
}

// readSubnetEnv reads flanneld's subnet file: KEY=VALUE lines.
func readSubnetEnv(path string) (subnetEnv, error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return subnetEnv{}, newError(codeTryAgainLater, "%s does not exist: flanneld is not running on this node yet, or has no subnet lease yet", path)
	}
	if err != nil {
		return subnetEnv{}, newError(codeIO, "reading the subnet file: %v", err)
	}
	vars := map[string]string{}
	for line := range strings.Lines(string(data)) {
		if k, v, ok := strings.Cut(strings.TrimSpace(line), "="); ok {
			vars[k] = v
		}
	}
	var env subnetEnv
	var errs []error
	parse := func(key string, f func(string) error) {
		if v, ok := vars[key]; !ok {
			errs = append(errs, fmt.Errorf("no %s", key))
		} else if err := f(v); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", key, err))
		}
	}
	parse("FLANNEL_NETWORK", func(v string) (err error) { env.network, err = netip.ParsePrefix(v); return err })
	parse("FLANNEL_SUBNET", func(v string) (err error) { env.subnet, err = netip.ParsePrefix(v); return err })
	parse("FLANNEL_MTU", func(v string) (err error) { env.mtu, err = strconv.Atoi(v); return err })
	parse("FLANNEL_IPMASQ", func(v string) (err error) { env.ipMasq, err = strconv.ParseBool(v); return err })
	if err := errors.Join(errs...); err != nil {
		return subnetEnv{}, newError(codeInvalidConfig, "subnet file %s: %s", path, strings.ReplaceAll(err.Error(), "\n", "; "))
	}
	// flanneld writes the subnet with the gateway's address (10.244.1.1/24); host-local refuses host bits.
	env.network, env.subnet = env.network.Masked(), env.subnet.Masked()
	return env, nil
}

// delegateConf is the delegate's configuration for ADD: the configured delegate's fields, and what upstream's
// plugin fills in from the network configuration and the lease where the delegate leaves it out.
func delegateConf(conf netConf, env subnetEnv) map[string]any {
	d := maps.Clone(conf.Delegate)
	if d == nil {
		d = map[string]any{}
	}
	// Always the network's: the delegate answers in the runtime's version, and host-local keeps its
	// allocations under the network's name.
	d["name"] = conf.Name
	if conf.CNIVersion != "" {
		d["cniVersion"] = conf.CNIVersion
	}
	setDefault(d, "type", "bridge")
	setDefault(d, "mtu", env.mtu)
	// flanneld started with --ip-masq masquerades what leaves the pod network itself.
	setDefault(d, "ipMasq", !env.ipMasq)
	if d["type"] == "bridge" {
		setDefault(d, "isGateway", true)
	}
	setDefault(d, "ipam", map[string]any{
		"type":   "host-local",
		"ranges": [][]map[string]string{{{"subnet": env.subnet.String()}}},
		"routes": []map[string]string{{"dst": env.network.String()}},
	})
	return d
}

func setDefault(d map[string]any, key string, value any) {
	if _, ok := d[key]; !ok {
		d[key] = value
	}
}

// pluginPath finds the delegate's plugin in CNI_PATH's directories, as libcni finds plugins.
func pluginPath(d map[string]any) (string, error) {
	typ, _ := d["type"].(string)
	if typ == "" || strings.ContainsRune(typ, '/') || typ == "." || typ == ".." {
		return "", newError(codeInvalidConfig, "the delegate's type %v names no plugin", d["type"])
	}
	cniPath := os.Getenv("CNI_PATH")
	for _, dir := range filepath.SplitList(cniPath) {
		if dir == "" {
			continue
		}
		path := filepath.Join(dir, typ)
		if fi, err := os.Stat(path); err == nil && fi.Mode().IsRegular() {
			return path, nil
		}
	}
	return "", newError(codeInvalidEnv, "the delegate plugin %q is in no directory of CNI_PATH (%q)", typ, cniPath)
}

// save writes data to path through a temporary file, so that DEL never reads half a configuration.
func save(path string, data []byte) error {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	// A leading dot: no container ID starts with one, so the temporary file cannot take another's name.
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".*")
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), path)
	}
	if err != nil {
		os.Remove(f.Name())
	}
	return err
}

// loadSaved reads the delegate's configuration that ADD saved at path; the error wraps fs.ErrNotExist when
// there is none.
func loadSaved(path string) (map[string]any, error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	if err != nil {
		return nil, newError(codeIO, "reading the delegate's configuration: %v", err)
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var d map[string]any
	if err := dec.Decode(&d); err != nil {
		return nil, newError(codeDecode, "decoding the delegate's configuration %s: %v", path, err)
	}
	return d, nil
}

// runSaved runs the delegate with a configuration that ADD saved.
func runSaved(d map[string]any, stdout, stderr io.Writer) (int, error) {
	path, data, err := prepareDelegate(d)
	if err != nil {
		return 0, err
	}
	return runDelegate(path, data, stdout, stderr)
}

// prepareDelegate finds the plugin that the delegate's configuration d names, and encodes d for it.
func prepareDelegate(d map[string]any) (path string, conf []byte, err error) {
	if path, err = pluginPath(d); err != nil {
		return "", nil, err
	}
	if conf, err = json.Marshal(d); err != nil {
		return "", nil, newError(codeInternal, "encoding the delegate's configuration: %v", err)
	}
	return path, conf, nil
}

// runDelegate runs the plugin at path with conf on stdin and this plugin's environment, which carries the
// command and the container's details, passing its output through; it returns the delegate's exit status,
// which the runtime reads with that output.
func runDelegate(path string, conf []byte, stdout, stderr io.Writer) (int, error) {
	cmd := exec.Command(path)
	cmd.Stdin = bytes.NewReader(conf)
	cmd.Stdout = stdout
	cmd.Stderr = stderr
	err := cmd.Run()
	var exit *exec.ExitError
	if errors.As(err, &exit) && exit.Exited() {
		return exit.ExitCode(), nil
	}
	if err != nil {
		return 0, newError(codeInternal, "running the delegate %s: %v", path, err)
	}
	return 0, nil
}
