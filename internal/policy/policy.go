// Package policy is the join policy: which images, known by their TPM
// measurements (PCR values), may join the cluster, and in which roles.
//
// The join service compares the PCR values a node quotes with this policy
// before it hands out anything. A node's role comes from its instance record,
// so the policy is what keeps a worker image from receiving control-plane
// material. When a node is refused, the error names the closest image and
// the first PCR that differs, so that operators see why.
package policy

import (
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"sigs.k8s.io/yaml"

	"github.com/berthlabs/berth/internal/kubeadm"
	"github.com/berthlabs/berth/internal/metadata"
)

// Limits on a policy document.
const (
	MaxSize     = 1 << 20
	MaxImages   = 256
	MaxPCRIndex = 23
	maxNameLen  = 253
	digestLen   = 32 // SHA-256
)

// Policy lists the images that may join. An empty policy lets nothing join.
// A Policy must not be changed once it is shared (for example through a Store).
type Policy struct {
	Images []Image
}

// Image is one allowed set of measurements.
type Image struct {
	Name  string
	Roles []metadata.Role
	// PCRs maps a PCR index to the SHA-256 value the node must quote.
	PCRs map[int][]byte
	// Expires, if set, is the instant after which the image no longer joins.
	Expires *time.Time
	// KubernetesVersion, if set, is the Kubernetes release the image carries (its manifest's
	// components.kubernetes). It is bound to the PCRs, so the join service learns a node's version from its
	// attestation and can hold back a node newer than the control plane.
	KubernetesVersion string
}

// document is the serialized form. Images is a pointer so that a document
// without an images list (often an empty or misnamed file) is told apart from
// an explicit empty list, which means "nothing joins".
type document struct {
	Images *[]imageDoc `json:"images"`
}

type imageDoc struct {
	Name              string            `json:"name"`
	Roles             []metadata.Role   `json:"roles"`
	PCRs              map[string]string `json:"pcrs"`
	Expires           *string           `json:"expires,omitempty"`
	KubernetesVersion string            `json:"kubernetesVersion,omitempty"`
}

// Parse reads a policy in YAML or JSON and validates it. Unknown fields are
// refused, so a misspelt field never silently loosens the policy.
func Parse(data []byte) (*Policy, error) {
	if len(data) > MaxSize {
		return nil, fmt.Errorf("join policy is %d bytes, more than the limit of %d", len(data), MaxSize)
	}
	var doc document
	if err := yaml.UnmarshalStrict(data, &doc); err != nil {
		return nil, fmt.Errorf("decoding join policy: %w", err)
	}
	if doc.Images == nil {
		return nil, errors.New(`join policy has no "images" list (write "images: []" to let nothing join)`)
	}
	if len(*doc.Images) > MaxImages {
		return nil, fmt.Errorf("join policy has %d images, more than the limit of %d", len(*doc.Images), MaxImages)
	}
	p := &Policy{Images: make([]Image, 0, len(*doc.Images))}
	for i, d := range *doc.Images {
		img, err := d.image()
		if err != nil {
			return nil, fmt.Errorf("join policy image %d%s: %w", i, nameForError(d.Name), err)
		}
		p.Images = append(p.Images, img)
	}
	if err := p.Validate(); err != nil {
		return nil, err
	}
	return p, nil
}

func (d imageDoc) image() (Image, error) {
	img := Image{Name: d.Name, Roles: d.Roles, PCRs: make(map[int][]byte, len(d.PCRs)), KubernetesVersion: d.KubernetesVersion}
	for _, key := range slices.Sorted(maps.Keys(d.PCRs)) {
		value := d.PCRs[key]
		idx, err := strconv.Atoi(key)
		if err != nil || strconv.Itoa(idx) != key {
			return Image{}, fmt.Errorf("PCR index %q is not a decimal number without sign or leading zeros", key)
		}
		if len(value) != 2*digestLen {
			return Image{}, fmt.Errorf("PCR %d: value has %d characters, want %d hex (SHA-256)", idx, len(value), 2*digestLen)
		}
		digest, err := hex.DecodeString(value)
		if err != nil {
			return Image{}, fmt.Errorf("PCR %d: value is not hex", idx)
		}
		img.PCRs[idx] = digest
	}
	if d.Expires != nil {
		t, err := time.Parse(time.RFC3339, *d.Expires)
		if err != nil {
			return Image{}, fmt.Errorf("expires %q is not an RFC 3339 time", *d.Expires)
		}
		t = t.UTC()
		img.Expires = &t
	}
	return img, nil
}

// Validate checks a policy built in code the same way Parse checks a document.
func (p *Policy) Validate() error {
	if len(p.Images) > MaxImages {
		return fmt.Errorf("join policy has %d images, more than the limit of %d", len(p.Images), MaxImages)
	}
	names := make(map[string]int, len(p.Images))
	for i, img := range p.Images {
		if err := img.validate(); err != nil {
			return fmt.Errorf("join policy image %d%s: %w", i, nameForError(img.Name), err)
		}
		if prev, ok := names[img.Name]; ok {
			return fmt.Errorf("join policy images %d and %d are both named %q", prev, i, img.Name)
		}
		names[img.Name] = i
	}
	return nil
}

// nameForError quotes a name for an error message unless it is too long to
// be one, which validate reports on its own.
func nameForError(name string) string {
	if name == "" || len(name) > maxNameLen {
		return ""
	}
	return fmt.Sprintf(" (%q)", name)
}

func (img Image) validate() error {
	if img.Name == "" {
		return errors.New("name is empty")
	}
	if len(img.Name) > maxNameLen {
		return fmt.Errorf("name is %d characters, more than %d", len(img.Name), maxNameLen)
	}
	if i := strings.IndexFunc(img.Name, func(r rune) bool {
		return (r < 'a' || r > 'z') && (r < '0' || r > '9') && r != '.' && r != '-'
	}); i >= 0 {
		r, _ := utf8.DecodeRuneInString(img.Name[i:])
		return fmt.Errorf("name has %q at position %d: only a-z, 0-9, '.' and '-' are allowed", r, i)
	}
	if len(img.Roles) == 0 {
		return errors.New("roles is empty: list control-plane, worker or both")
	}
	for i, r := range img.Roles {
		if !r.Valid() {
			return fmt.Errorf("role %q is not %q or %q", r, metadata.RoleControlPlane, metadata.RoleWorker)
		}
		if slices.Contains(img.Roles[:i], r) {
			return fmt.Errorf("role %q is listed twice", r)
		}
	}
	if len(img.PCRs) == 0 {
		return errors.New("pcrs is empty: an image without measurements would let anything join")
	}
	if img.KubernetesVersion != "" && !kubeadm.IsRelease(img.KubernetesVersion) {
		return fmt.Errorf("kubernetesVersion %q is not a Kubernetes release such as v1.36.3", img.KubernetesVersion)
	}
	for _, idx := range slices.Sorted(maps.Keys(img.PCRs)) {
		v := img.PCRs[idx]
		if idx < 0 || idx > MaxPCRIndex {
			return fmt.Errorf("PCR index %d is outside 0..%d", idx, MaxPCRIndex)
		}
		if len(v) != digestLen {
			return fmt.Errorf("PCR %d: value has %d bytes, want %d (SHA-256)", idx, len(v), digestLen)
		}
	}
	return nil
}

// Marshal returns the policy as canonical YAML (sorted keys, lowercase hex,
// times in UTC) that Parse reads back to an equal policy.
func (p *Policy) Marshal() ([]byte, error) {
	if err := p.Validate(); err != nil {
		return nil, fmt.Errorf("marshaling join policy: %w", err)
	}
	images := make([]imageDoc, 0, len(p.Images))
	for _, img := range p.Images {
		d := imageDoc{Name: img.Name, Roles: img.Roles, PCRs: make(map[string]string, len(img.PCRs)),
			KubernetesVersion: img.KubernetesVersion}
		for idx, v := range img.PCRs {
			d.PCRs[strconv.Itoa(idx)] = hex.EncodeToString(v)
		}
		if img.Expires != nil {
			s := img.Expires.UTC().Format(time.RFC3339Nano)
			d.Expires = &s
		}
		images = append(images, d)
	}
	out, err := yaml.Marshal(document{Images: &images})
	if err != nil {
		return nil, fmt.Errorf("marshaling join policy: %w", err)
	}
	return out, nil
}

// PCRIndexes returns, sorted, every PCR index some image needs: what a node
// must quote.
func (p *Policy) PCRIndexes() []int {
	var idx []int
	if p == nil {
		return idx
	}
	for _, img := range p.Images {
		for i := range img.PCRs {
			if !slices.Contains(idx, i) {
				idx = append(idx, i)
			}
		}
	}
	slices.Sort(idx)
	return idx
}

// ForRole is the part of the policy that admits role at now: its images that allow role and have not
// expired. It is what a node of that role may seal its disk key to.
func (p *Policy) ForRole(role metadata.Role, now time.Time) *Policy {
	out := &Policy{}
	if p == nil {
		return out
	}
	for _, img := range p.Images {
		c := evaluate(&img, role, nil, now)
		if c.roleAllowed && !c.expired {
			out.Images = append(out.Images, img)
		}
	}
	return out
}

// Check returns an image that is allowed for role, whose every PCR equals
// the quoted value and that has not expired at now; the caller must not
// change it. Otherwise it returns a *MismatchError about the closest image:
// one allowed for the role if there is any, and among those the one with the
// most matching PCRs.
func (p *Policy) Check(role metadata.Role, pcrs map[int][]byte, now time.Time) (Image, error) {
	if p == nil || len(p.Images) == 0 {
		return Image{}, &MismatchError{Role: role, PCR: -1, NoImages: true}
	}
	var best *candidate
	for i := range p.Images {
		c := evaluate(&p.Images[i], role, pcrs, now)
		if c.roleAllowed && !c.expired && c.mismatch < 0 {
			return *c.img, nil
		}
		if best == nil || c.closerThan(best) {
			best = &c
		}
	}
	e := &MismatchError{Role: role, Image: best.img.Name, PCR: best.mismatch, RoleNotAllowed: !best.roleAllowed}
	if best.mismatch >= 0 {
		e.Expected = bytes.Clone(best.img.PCRs[best.mismatch])
		e.Got = bytes.Clone(pcrs[best.mismatch])
	}
	if best.expired {
		t := *best.img.Expires
		e.Expired = &t
	}
	return Image{}, e
}

type candidate struct {
	img         *Image
	roleAllowed bool
	expired     bool
	matching    int
	mismatch    int // lowest PCR index that differs, -1 if none
}

func evaluate(img *Image, role metadata.Role, pcrs map[int][]byte, now time.Time) candidate {
	c := candidate{
		img:         img,
		roleAllowed: slices.Contains(img.Roles, role),
		expired:     img.Expires != nil && now.After(*img.Expires),
		mismatch:    -1,
	}
	for idx, want := range img.PCRs {
		got, ok := pcrs[idx]
		if ok && bytes.Equal(got, want) {
			c.matching++
			continue
		}
		if c.mismatch < 0 || idx < c.mismatch {
			c.mismatch = idx
		}
	}
	return c
}

// closerThan ranks candidates for the error report; on a tie the earlier
// image in the policy stays.
func (c *candidate) closerThan(o *candidate) bool {
	if c.roleAllowed != o.roleAllowed {
		return c.roleAllowed
	}
	if c.matching != o.matching {
		return c.matching > o.matching
	}
	return !c.expired && o.expired
}

// MismatchError says why a node's measurements were refused, naming the
// closest image of the policy. PCR values are not secret, so they are shown.
type MismatchError struct {
	Role  metadata.Role
	Image string
	// PCR is the lowest index whose value differs, or -1 when every PCR matched.
	PCR int
	// Expected is the policy's value of PCR; Got is the quoted one, nil if the quote lacks it.
	Expected, Got []byte
	// Expired is set when the image has expired.
	Expired *time.Time
	// RoleNotAllowed is set when no image allows Role and Image is the closest of the others.
	RoleNotAllowed bool
	// NoImages is set when the policy is empty.
	NoImages bool
}

func (e *MismatchError) Error() string {
	if e.NoImages {
		return fmt.Sprintf("join policy is empty: no image may join as %s", e.Role)
	}
	var reasons []string
	if e.RoleNotAllowed {
		reasons = append(reasons, fmt.Sprintf("not allowed for role %s", e.Role))
	}
	if e.PCR >= 0 {
		got := "nothing (PCR not quoted)"
		switch {
		case len(e.Got) > 0:
			got = hex.EncodeToString(e.Got)
		case e.Got != nil:
			got = "an empty value"
		}
		reasons = append(reasons, fmt.Sprintf("PCR %d: expected %s, got %s", e.PCR, hex.EncodeToString(e.Expected), got))
	}
	if e.Expired != nil {
		reasons = append(reasons, "expired at "+e.Expired.UTC().Format(time.RFC3339))
	}
	return fmt.Sprintf("measurements not allowed for role %s: closest image %q: %s", e.Role, e.Image, strings.Join(reasons, "; "))
}
