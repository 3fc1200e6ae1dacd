// Package cloudinit renders the #cloud-config document a Berth node boots with: it writes the user-data
// JSON berth-agent reads and, for machines named by their PXE profile, sets the hostname. The document is
// marshalled, never templated, so no value can break out of its YAML. Parse reads such a document back, for
// labs that play cloud-init's part.
package cloudinit

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	"k8s.io/apimachinery/pkg/util/validation"
	"sigs.k8s.io/yaml"

	"github.com/berthlabs/berth/internal/metadata"
)

const (
	// MaxSize is AWS EC2's limit on user-data before base64 encoding, the smallest of the clouds'.
	MaxSize = 16 * 1024
	// UserDataPath is where cloud-init writes the user-data for berth-agent.
	UserDataPath = "/etc/berth/user-data.json"
	// MaxHostname is the longest hostname Linux takes (sethostname(2), systemd's hostname checks). cloud-init
	// checks nothing itself and passes the name on, so a longer one would fail on the node rather than here.
	MaxHostname = 64
)

// ValidateHostname checks that name can be both the machine's hostname and its Kubernetes node name.
func ValidateHostname(name string) error {
	if name == "" {
		return errors.New("hostname is empty; leave it unset to keep the machine's own hostname")
	}
	if i := strings.IndexFunc(name, notNodeNameChar); i >= 0 {
		r, _ := utf8.DecodeRuneInString(name[i:])
		return fmt.Errorf("hostname %q: %q at byte %d is not a lowercase letter, digit, '-' or '.', the only "+
			"characters of a Kubernetes node name", name, r, i)
	}
	if msgs := validation.IsDNS1123Subdomain(name); len(msgs) > 0 {
		return fmt.Errorf("hostname %q is not a Kubernetes node name: %s", name, strings.Join(msgs, "; "))
	}
	if len(name) > MaxHostname {
		return fmt.Errorf("hostname %q has %d characters; Linux takes at most %d, so the node would not get "+
			"this name", name, len(name), MaxHostname)
	}
	return nil
}

func notNodeNameChar(r rune) bool {
	return (r < 'a' || r > 'z') && (r < '0' || r > '9') && r != '-' && r != '.'
}

// Config is the part of cloud-init's #cloud-config that Berth uses.
type Config struct {
	Hostname         string      `json:"hostname,omitempty"`
	FQDN             string      `json:"fqdn,omitempty"`
	PreserveHostname *bool       `json:"preserve_hostname,omitempty"`
	WriteFiles       []WriteFile `json:"write_files"`
}

type WriteFile struct {
	Path        string `json:"path"`
	Content     string `json:"content"`
	Owner       string `json:"owner"`
	Permissions string `json:"permissions"`
}

// Render returns the user-data as JSON and as a #cloud-config document that writes that JSON to
// UserDataPath and, unless hostname is empty, sets the machine's hostname. The document is marshalled, not
// templated, so no value can break out of its YAML string.
func Render(u metadata.UserData, hostname string) (doc, cloudInit string, err error) {
	if err := u.Validate(); err != nil {
		return "", "", err
	}
	data, err := json.Marshal(u)
	if err != nil {
		return "", "", fmt.Errorf("encoding user-data: %w", err)
	}
	cc := Config{WriteFiles: []WriteFile{{
		Path: UserDataPath, Content: string(data), Owner: "root:root", Permissions: "0644",
	}}}
	if hostname != "" {
		if err := ValidateHostname(hostname); err != nil {
			return "", "", err
		}
		// cloud-init sets the short name or the FQDN depending on the distribution; both the same name makes
		// the hostname that name everywhere.
		preserve := false
		cc.Hostname, cc.FQDN, cc.PreserveHostname = hostname, hostname, &preserve
	}
	body, err := yaml.Marshal(cc)
	if err != nil {
		return "", "", fmt.Errorf("encoding cloud-init document: %w", err)
	}
	cloudInit = "#cloud-config\n" + string(body)
	if len(cloudInit) > MaxSize {
		return "", "", fmt.Errorf("the cloud-init user-data is %d bytes, more than the %d bytes (16 KiB) AWS EC2 "+
			"accepts; list fewer join_endpoints", len(cloudInit), MaxSize)
	}
	return string(data), cloudInit, nil
}

// Parse reads a #cloud-config document as Render writes it.
func Parse(doc string) (*Config, error) {
	body, ok := strings.CutPrefix(doc, "#cloud-config\n")
	if !ok {
		return nil, errors.New("not a #cloud-config document")
	}
	var c Config
	if err := yaml.UnmarshalStrict([]byte(body), &c); err != nil {
		return nil, fmt.Errorf("parsing cloud-config: %w", err)
	}
	return &c, nil
}
