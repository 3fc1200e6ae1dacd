// Package metadata holds the instance records Berth nodes live by and a small
// instance-metadata service that serves them.
//
// A node reads its own record at boot (who it is, which role it has, where the
// control planes are, which join CA to pin); the join service looks up the
// record of a connecting node by its address, the way it would ask a cloud's
// API. Roles come from these records, never from what a node says about
// itself. The service here is the project's own, used where no cloud exists
// (labs, QEMU tests); its client is what nodes and the join service use.
package metadata

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"regexp"
	"strconv"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/berthlabs/berth/internal/clustername"
)

// MaxDocumentSize bounds a metadata document and every response the client reads.
const MaxDocumentSize = 1 << 20

// maxImageIDLen keeps an image id to what any cloud uses (AMI ids, GCE image
// URLs, file paths of QEMU images).
const maxImageIDLen = 1024

// maxInstanceIDLen is far above any cloud's instance ids (EC2's are 19 bytes, GCE's 20 digits).
const maxInstanceIDLen = 128

// Role is what a node is in the cluster.
type Role string

// The roles a node can have.
const (
	RoleControlPlane Role = "control-plane"
	RoleWorker       Role = "worker"
)

// Valid reports whether r is one of the known roles.
func (r Role) Valid() bool {
	return r == RoleControlPlane || r == RoleWorker
}

// Instance is the record of one node.
type Instance struct {
	// Name is the Kubernetes node name, a DNS-1123 subdomain.
	Name string `json:"name"`
	Role Role   `json:"role"`
	// Addresses are the node's IPs; the first is the primary one (the kubelet's node IP).
	Addresses []netip.Addr `json:"addresses"`
	ImageID   string       `json:"imageID,omitempty"`
	// ID is the cloud's id of the instance (an EC2 instance id), where a cloud vouches for the instance's
	// TPM by that id; empty elsewhere.
	ID string `json:"id,omitempty"`
}

// UserData is what a launch template gives every node. It holds nothing secret:
// the init secret appears only as its hash.
type UserData struct {
	ClusterName string `json:"clusterName"`
	// JoinEndpoints are host:port of a load balancer in front of the join service; optional.
	JoinEndpoints []string `json:"joinEndpoints,omitempty"`
	// JoinPort is the port of the join service on control-plane nodes.
	JoinPort uint16 `json:"joinPort"`
	// JoinCAPin is "sha256:<64 lowercase hex>" of the join CA's SubjectPublicKeyInfo.
	JoinCAPin string `json:"joinCAPin"`
	// InitSecretHash is the argon2id PHC string of the init secret.
	InitSecretHash string `json:"initSecretHash,omitempty"`
	// Role is the role of the nodes this user-data launches, where no metadata service names it (a launch
	// template per role on a cloud); empty means worker. The join service checks it against its own record.
	Role Role `json:"role,omitempty"`
	// AutoscalingGroups, in the user-data of control-plane nodes on EC2, maps the autoscaling groups whose
	// instances may join to their role; the join service reads it from its own node's user-data, which no
	// other node can write.
	AutoscalingGroups map[string]Role `json:"autoscalingGroups,omitempty"`
	// InstanceGroups, in the user-data of control-plane nodes on Compute Engine, maps the managed instance
	// groups whose instances may join to their role, each as "<region or zone>/<name>" (a regional group
	// "europe-west1/berth-workers", a zonal one "europe-west1-b/berth-workers").
	InstanceGroups map[string]Role `json:"instanceGroups,omitempty"`
}

// Self is what a node learns about itself.
type Self struct {
	Instance Instance `json:"instance"`
	UserData UserData `json:"userData"`
	// ProviderID is the node's spec.providerID, how its cloud's controller manager finds its instance
	// ("aws:///<zone>/<instance id>", "gce://<project>/<zone>/<name>"); empty where no cloud names it.
	ProviderID string `json:"providerID,omitempty"`
}

// Document is the whole state of the metadata service.
type Document struct {
	UserData  UserData   `json:"userData"`
	Instances []Instance `json:"instances"`
}

// Validate checks that i can be used as a node's identity.
func (i Instance) Validate() error {
	if i.Name == "" {
		return errors.New("instance name is empty")
	}
	if msgs := validation.IsDNS1123Subdomain(i.Name); len(msgs) > 0 {
		return fmt.Errorf("instance name %q is not a DNS-1123 subdomain: %s", i.Name, strings.Join(msgs, "; "))
	}
	if !i.Role.Valid() {
		return fmt.Errorf("instance %q: role %q is not %q or %q", i.Name, i.Role, RoleControlPlane, RoleWorker)
	}
	if len(i.Addresses) == 0 {
		return fmt.Errorf("instance %q has no addresses", i.Name)
	}
	seen := make(map[netip.Addr]bool, len(i.Addresses))
	for _, a := range i.Addresses {
		if err := validateAddress(a); err != nil {
			return fmt.Errorf("instance %q: %w", i.Name, err)
		}
		if seen[a] {
			return fmt.Errorf("instance %q lists address %s twice", i.Name, a)
		}
		seen[a] = true
	}
	if len(i.ImageID) > maxImageIDLen {
		return fmt.Errorf("instance %q: image id is longer than %d bytes", i.Name, maxImageIDLen)
	}
	if strings.ContainsFunc(i.ImageID, isControl) {
		return fmt.Errorf("instance %q: image id contains control characters", i.Name)
	}
	if len(i.ID) > maxInstanceIDLen || strings.ContainsFunc(i.ID, isControl) {
		return fmt.Errorf("instance %q: instance id is longer than %d bytes or contains control characters", i.Name, maxInstanceIDLen)
	}
	return nil
}

// validateAddress accepts only addresses in the one form the service looks
// them up by, so that a record never silently fails to match its node.
func validateAddress(a netip.Addr) error {
	switch {
	case !a.IsValid():
		return errors.New("address is empty or invalid")
	case a.Is4In6():
		return fmt.Errorf("address %s is IPv4-mapped IPv6: write it as %s", a, a.Unmap())
	case a.Zone() != "":
		return fmt.Errorf("address %s has a zone", a)
	case a.IsUnspecified():
		return fmt.Errorf("address %s is unspecified", a)
	case a.IsMulticast():
		return fmt.Errorf("address %s is multicast", a)
	}
	return nil
}

func isControl(r rune) bool {
	return r < 0x20 || r == 0x7f
}

// Validate checks that u is complete enough for a node to join.
func (u UserData) Validate() error {
	if err := clustername.Validate(u.ClusterName); err != nil {
		return err
	}
	seen := make(map[string]bool, len(u.JoinEndpoints))
	for _, ep := range u.JoinEndpoints {
		if err := ValidateEndpoint(ep); err != nil {
			return err
		}
		if seen[ep] {
			return fmt.Errorf("join endpoint %q is listed twice", ep)
		}
		seen[ep] = true
	}
	if u.JoinPort == 0 {
		return errors.New("join port is 0")
	}
	if err := ValidatePin(u.JoinCAPin); err != nil {
		return err
	}
	if u.InitSecretHash != "" {
		if err := ValidateArgon2idPHC(u.InitSecretHash); err != nil {
			return err
		}
	}
	if u.Role != "" && !u.Role.Valid() {
		return fmt.Errorf("role %q is not %q or %q", u.Role, RoleControlPlane, RoleWorker)
	}
	for group, role := range u.AutoscalingGroups {
		// EC2 Auto Scaling group names are 1 to 255 characters.
		if group == "" || len(group) > 255 || strings.ContainsFunc(group, isControl) {
			return fmt.Errorf("autoscaling group name %q is empty, longer than 255 bytes or has control characters", group)
		}
		if !role.Valid() {
			return fmt.Errorf("autoscaling group %q: role %q is not %q or %q", group, role, RoleControlPlane, RoleWorker)
		}
	}
	for group, role := range u.InstanceGroups {
		if err := ValidateInstanceGroup(group); err != nil {
			return err
		}
		if !role.Valid() {
			return fmt.Errorf("instance group %q: role %q is not %q or %q", group, role, RoleControlPlane, RoleWorker)
		}
	}
	return nil
}

// instanceGroupKey is "<region or zone>/<name>": Compute Engine names regions "<area>-<place><n>", zones
// "<region>-<letter>", and resources in RFC 1035 form of at most 63 characters.
var instanceGroupKey = regexp.MustCompile(`^[a-z]+-[a-z]+[0-9]+(-[a-z])?/[a-z]([-a-z0-9]{0,61}[a-z0-9])?$`)

// ValidateInstanceGroup checks a managed instance group's key as InstanceGroups holds it.
func ValidateInstanceGroup(key string) error {
	if !instanceGroupKey.MatchString(key) {
		return fmt.Errorf("instance group %q is not \"<region or zone>/<name>\" (a regional group \"europe-west1/berth-workers\", a zonal one \"europe-west1-b/berth-workers\")", key)
	}
	return nil
}

// ValidateEndpoint checks a join endpoint, host:port with a port from 1 to 65535.
func ValidateEndpoint(ep string) error {
	host, port, err := net.SplitHostPort(ep)
	if err != nil {
		return fmt.Errorf("join endpoint %q is not host:port: %w", ep, err)
	}
	if host == "" {
		return fmt.Errorf("join endpoint %q has no host", ep)
	}
	if strings.ContainsFunc(host, isControl) || strings.ContainsAny(host, " /") {
		return fmt.Errorf("join endpoint %q: host contains spaces, slashes or control characters", ep)
	}
	n, err := strconv.ParseUint(port, 10, 16)
	if err != nil || n == 0 || strconv.FormatUint(n, 10) != port {
		return fmt.Errorf("join endpoint %q: port %q is not a number from 1 to 65535", ep, port)
	}
	return nil
}

const pinPrefix = "sha256:"

// ValidatePin checks a join CA pin, "sha256:" and 64 lowercase hex digits.
func ValidatePin(pin string) error {
	if pin == "" {
		return errors.New("join CA pin is empty")
	}
	digest, ok := strings.CutPrefix(pin, pinPrefix)
	if !ok {
		return fmt.Errorf("join CA pin %q does not start with %q", pin, pinPrefix)
	}
	if len(digest) != 64 {
		return fmt.Errorf("join CA pin %q: digest has %d characters, want 64 hex", pin, len(digest))
	}
	if _, err := hex.DecodeString(digest); err != nil || strings.ToLower(digest) != digest {
		return fmt.Errorf("join CA pin %q: digest is not lowercase hex", pin)
	}
	return nil
}

// ValidateArgon2idPHC checks the shape of "$argon2id$v=19$m=…,t=…,p=…$salt$hash".
// The hash is not secret, but errors still leave it out: it is of no use to a
// reader and makes offline guessing of a weak init secret possible.
func ValidateArgon2idPHC(s string) error {
	parts := strings.Split(s, "$")
	if len(parts) != 6 || parts[0] != "" || parts[1] != "argon2id" {
		return errors.New("init secret hash is not an argon2id PHC string ($argon2id$v=19$m=…,t=…,p=…$salt$hash)")
	}
	if parts[2] != "v=19" {
		return errors.New("init secret hash: argon2id version is not v=19")
	}
	params := strings.Split(parts[3], ",")
	if len(params) != 3 {
		return errors.New("init secret hash: parameters are not m=…,t=…,p=…")
	}
	for i, key := range []string{"m=", "t=", "p="} {
		v, ok := strings.CutPrefix(params[i], key)
		if !ok {
			return errors.New("init secret hash: parameters are not m=…,t=…,p=…")
		}
		if n, err := strconv.ParseUint(v, 10, 32); err != nil || n == 0 {
			return fmt.Errorf("init secret hash: parameter %s is not a positive number", strings.TrimSuffix(key, "="))
		}
	}
	if parts[4] == "" || parts[5] == "" {
		return errors.New("init secret hash: salt or hash is empty")
	}
	return nil
}

// Validate checks the user-data and every instance, and that no two instances
// share a name or an address: a lookup by address must find one node.
func (d *Document) Validate() error {
	if err := d.UserData.Validate(); err != nil {
		return fmt.Errorf("user-data: %w", err)
	}
	names := make(map[string]int, len(d.Instances))
	owners := make(map[netip.Addr]string)
	for idx, inst := range d.Instances {
		if err := inst.Validate(); err != nil {
			return fmt.Errorf("instance %d: %w", idx, err)
		}
		if prev, ok := names[inst.Name]; ok {
			return fmt.Errorf("instances %d and %d are both named %q", prev, idx, inst.Name)
		}
		names[inst.Name] = idx
		for _, a := range inst.Addresses {
			if other, ok := owners[a]; ok {
				return fmt.Errorf("address %s belongs to both %q and %q", a, other, inst.Name)
			}
			owners[a] = inst.Name
		}
	}
	return nil
}

// ParseDocument reads a metadata document (JSON) and validates it. Unknown
// fields are refused so that a misspelt field never silently means "unset".
func ParseDocument(data []byte) (*Document, error) {
	if len(data) > MaxDocumentSize {
		return nil, fmt.Errorf("metadata document is %d bytes, more than the limit of %d", len(data), MaxDocumentSize)
	}
	var doc Document
	if err := decodeStrict(bytes.NewReader(data), &doc); err != nil {
		return nil, fmt.Errorf("decoding metadata document: %w", err)
	}
	if err := doc.Validate(); err != nil {
		return nil, fmt.Errorf("invalid metadata document: %w", err)
	}
	return &doc, nil
}

func decodeStrict(r io.Reader, v any) error {
	dec := json.NewDecoder(r)
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return errors.New("trailing data after the JSON value")
	}
	return nil
}

func (d *Document) clone() *Document {
	c := &Document{UserData: d.UserData, Instances: make([]Instance, len(d.Instances))}
	c.UserData.JoinEndpoints = append([]string(nil), d.UserData.JoinEndpoints...)
	for i, inst := range d.Instances {
		c.Instances[i] = inst.clone()
	}
	return c
}

func (i Instance) clone() Instance {
	i.Addresses = append([]netip.Addr(nil), i.Addresses...)
	return i
}
