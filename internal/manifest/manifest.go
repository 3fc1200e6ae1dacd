// Package manifest reads berth-image.json, the manifest the Packer plugin writes next to the images it
// builds: for each image its cloud artifact, the PCR values Berth predicted for it, and the versions of the
// components baked in.
//
// Terraform reads the manifest (data source berth_image) to launch nodes from an image and to admit that
// image's measurements in the join policy, so a manifest is checked as strictly as a policy: unknown or
// duplicate keys, keys in another case, PCR indexes outside the TPM's 0..23 and values that are not SHA-256
// digests are all refused rather than guessed at.
package manifest

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Limits on a manifest.
const (
	MaxSize     = 1 << 20
	MaxImages   = 64
	MaxPCRIndex = 23
	Version     = 1

	// DefaultFile is the manifest's name unless the post-processor berth-manifest's output says otherwise.
	DefaultFile = "berth-image.json"

	// Image names become join-policy image names, so they follow the policy's rule.
	maxNameLen       = 253
	maxBuilderLen    = 64
	maxArtifactLen   = 1024
	maxRegionLen     = 64
	maxComponents    = 64
	maxComponentKey  = 64
	maxComponentText = 256
	digestHexLen     = 64
)

// Manifest is a parsed berth-image.json.
type Manifest struct {
	Version int     `json:"version"`
	Images  []Image `json:"images"`
}

// Image is one image a Packer build made.
type Image struct {
	Name string `json:"name"`
	// Builder is the Packer builder that made it ("qemu", "amazon-ebs", ...).
	Builder string `json:"builder"`
	// ArtifactID is what the cloud knows the image by: an AMI id, a GCE image URL, a disk file path.
	ArtifactID string `json:"artifact_id"`
	Region     string `json:"region"`
	// PCRs maps a PCR index ("4") to the SHA-256 value predicted for it, in lowercase hex.
	PCRs map[string]string `json:"pcrs"`
	// Components maps a component ("kubernetes") to its version.
	Components map[string]string `json:"components"`
}

// structKeys are the exact keys of the objects that are structs; encoding/json would also accept them in
// any case ("Name"), which a strict format refuses.
var structKeys = map[string][]string{
	"":         {"version", "images"},
	"images[]": {"name", "builder", "artifact_id", "region", "pcrs", "components"},
}

// Parse reads and validates a manifest.
func Parse(data []byte) (*Manifest, error) {
	if len(data) > MaxSize {
		return nil, fmt.Errorf("image manifest is %d bytes, more than the limit of %d", len(data), MaxSize)
	}
	if err := checkKeys(data); err != nil {
		return nil, fmt.Errorf("decoding image manifest: %w", err)
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var m Manifest
	if err := dec.Decode(&m); err != nil {
		return nil, fmt.Errorf("decoding image manifest: %w", err)
	}
	if err := m.Validate(); err != nil {
		return nil, err
	}
	return &m, nil
}

// Validate checks a manifest the way Parse does.
func (m *Manifest) Validate() error {
	if m.Version != Version {
		return fmt.Errorf("image manifest version is %d, want %d", m.Version, Version)
	}
	if len(m.Images) == 0 {
		return errors.New("image manifest lists no images")
	}
	if len(m.Images) > MaxImages {
		return fmt.Errorf("image manifest has %d images, more than the limit of %d", len(m.Images), MaxImages)
	}
	names := make(map[string]int, len(m.Images))
	for i, img := range m.Images {
		if err := img.Validate(); err != nil {
			return fmt.Errorf("image manifest image %d%s: %w", i, nameForError(img.Name), err)
		}
		if prev, ok := names[img.Name]; ok {
			return fmt.Errorf("image manifest images %d and %d are both named %q", prev, i, img.Name)
		}
		names[img.Name] = i
	}
	return nil
}

// Marshal is the manifest as berth-image.json, refused unless Parse would accept it.
func (m *Manifest) Marshal() ([]byte, error) {
	if err := m.Validate(); err != nil {
		return nil, err
	}
	data, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return nil, err
	}
	return append(data, '\n'), nil
}

// Image returns the image called name.
func (m *Manifest) Image(name string) (Image, bool) {
	for _, img := range m.Images {
		if img.Name == name {
			return img, true
		}
	}
	return Image{}, false
}

// Names lists the images' names in manifest order.
func (m *Manifest) Names() []string {
	names := make([]string, len(m.Images))
	for i, img := range m.Images {
		names[i] = img.Name
	}
	return names
}

// Validate checks one image.
func (img Image) Validate() error {
	if err := ValidateName(img.Name); err != nil {
		return err
	}
	if err := validateText("builder", img.Builder, maxBuilderLen, true); err != nil {
		return err
	}
	if err := validateText("artifact_id", img.ArtifactID, maxArtifactLen, true); err != nil {
		return err
	}
	if err := validateText("region", img.Region, maxRegionLen, false); err != nil {
		return err
	}
	if len(img.PCRs) == 0 {
		return errors.New("pcrs is empty: an image without predicted measurements cannot be admitted by a join policy")
	}
	for _, key := range slices.Sorted(maps.Keys(img.PCRs)) {
		idx, err := strconv.Atoi(key)
		if err != nil || strconv.Itoa(idx) != key || idx < 0 || idx > MaxPCRIndex {
			return fmt.Errorf("PCR index %s is not a decimal number from 0 to %d without sign or leading zeros", quote(key), MaxPCRIndex)
		}
		if v := img.PCRs[key]; !isLowerHex(v, digestHexLen) {
			return fmt.Errorf("PCR %d: value %s is not %d lowercase hex digits (a SHA-256 digest)", idx, quoteValue(v), digestHexLen)
		}
	}
	if len(img.Components) > maxComponents {
		return fmt.Errorf("components has %d entries, more than the limit of %d", len(img.Components), maxComponents)
	}
	for _, key := range slices.Sorted(maps.Keys(img.Components)) {
		if err := validateText("component name", key, maxComponentKey, true); err != nil {
			return err
		}
		if err := validateText(fmt.Sprintf("component %q", key), img.Components[key], maxComponentText, true); err != nil {
			return err
		}
	}
	return nil
}

// ValidateName checks an image name: it becomes a join policy's image name, so it follows the same rule.
func ValidateName(name string) error {
	if name == "" {
		return errors.New("name is empty")
	}
	if len(name) > maxNameLen {
		return fmt.Errorf("name is %d characters, more than %d", len(name), maxNameLen)
	}
	if i := strings.IndexFunc(name, func(r rune) bool {
		return (r < 'a' || r > 'z') && (r < '0' || r > '9') && r != '.' && r != '-'
	}); i >= 0 {
		r, _ := utf8.DecodeRuneInString(name[i:])
		return fmt.Errorf("name %s has %q at position %d: only a-z, 0-9, '.' and '-' are allowed (join policy image names)",
			quoteValue(name), r, i)
	}
	return nil
}

func validateText(what, s string, maxLen int, required bool) error {
	switch {
	case s == "" && required:
		return fmt.Errorf("%s is empty", what)
	case len(s) > maxLen:
		return fmt.Errorf("%s is %d bytes, more than %d", what, len(s), maxLen)
	case !utf8.ValidString(s):
		return fmt.Errorf("%s %s is not valid UTF-8", what, quoteValue(s))
	case strings.ContainsFunc(s, func(r rune) bool { return r < 0x20 || r == 0x7f }):
		return fmt.Errorf("%s %s contains control characters", what, quoteValue(s))
	}
	return nil
}

func isLowerHex(s string, n int) bool {
	if len(s) != n {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

// nameForError quotes a valid name for an error message; an invalid one is reported by Validate itself.
func nameForError(name string) string {
	if ValidateName(name) != nil {
		return ""
	}
	return fmt.Sprintf(" (%q)", name)
}

// quote quotes a refused key, cut short so that a large one is not echoed.
func quote(s string) string {
	return quoteCut(s, 16)
}

// quoteValue quotes a refused value: long enough to show a whole PCR value or image name as written, cut
// short beyond that.
func quoteValue(s string) string {
	return quoteCut(s, 80)
}

func quoteCut(s string, maxShown int) string {
	if len(s) > maxShown {
		return fmt.Sprintf("%q... (%d bytes)", s[:maxShown], len(s))
	}
	return fmt.Sprintf("%q", s)
}

// shapes is the JSON type of each value by its place (the form of structKeys, a map's entries under
// "<map>.*"), so that a value of the wrong type is named with the value itself; encoding/json would say
// only "cannot unmarshal number into Go struct field".
var shapes = map[string]string{
	"":                      "an object",
	"version":               "a number",
	"images":                "an array",
	"images[]":              "an object",
	"images[].name":         "a string",
	"images[].builder":      "a string",
	"images[].artifact_id":  "a string",
	"images[].region":       "a string",
	"images[].pcrs":         "an object",
	"images[].pcrs.*":       "a string",
	"images[].components":   "an object",
	"images[].components.*": "a string",
}

// checkKeys walks the JSON text and refuses a key that appears twice in one object (encoding/json keeps
// the last, so a second "4" would silently replace a PCR value), a struct key that is not spelt exactly, a
// value of the wrong type, and anything after the top-level value.
func checkKeys(data []byte) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	if err := walk(dec, "", ""); err != nil {
		return err
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return errors.New("trailing data after the JSON value")
	}
	return nil
}

// walk checks the value that comes next in dec. shape is its place in the form of structKeys and shapes;
// where names it for errors, with indexes and map keys ("images[0].pcrs.4").
func walk(dec *json.Decoder, shape, where string) error {
	tok, err := dec.Token()
	if err != nil {
		return err
	}
	if err := checkShape(tok, shape, where); err != nil {
		return err
	}
	delim, ok := tok.(json.Delim)
	if !ok {
		return nil
	}
	switch delim {
	case '[':
		for i := 0; dec.More(); i++ {
			if err := walk(dec, shape+"[]", fmt.Sprintf("%s[%d]", where, i)); err != nil {
				return err
			}
		}
	case '{':
		allowed, isStruct := structKeys[shape]
		seen := make(map[string]bool)
		for dec.More() {
			tok, err := dec.Token()
			if err != nil {
				return err
			}
			key, _ := tok.(string)
			if seen[key] {
				return fmt.Errorf("key %s appears twice in one object", quote(key))
			}
			seen[key] = true
			if isStruct && !slices.Contains(allowed, key) {
				return fmt.Errorf("unknown key %s (keys are lowercase: %s)", quote(key), strings.Join(allowed, ", "))
			}
			childShape, childWhere := key, key
			if !isStruct {
				childShape, childWhere = "*", quote(key)
			}
			if shape != "" {
				childShape, childWhere = shape+"."+childShape, where+"."+childWhere
			}
			if err := walk(dec, childShape, childWhere); err != nil {
				return err
			}
		}
	}
	// The closing delimiter.
	_, err = dec.Token()
	return err
}

// checkShape refuses tok, the start of the value at shape, when it is not of the type shapes wants there.
// A null is left to encoding/json, which takes it as the zero value, as it always has.
func checkShape(tok json.Token, shape, where string) error {
	want, ok := shapes[shape]
	if !ok || tok == nil {
		return nil
	}
	var got, shown string
	switch v := tok.(type) {
	case json.Delim:
		got = map[json.Delim]string{'{': "an object", '[': "an array"}[v]
		shown = got
	case string:
		got, shown = "a string", "the string "+quoteValue(v)
	case json.Number:
		n := v.String()
		if len(n) > 32 {
			n = n[:32] + "..."
		}
		got, shown = "a number", "the number "+n
	case bool:
		got, shown = "a boolean", fmt.Sprint(v)
	}
	if got == want {
		return nil
	}
	if where == "" {
		where = "the manifest"
	}
	return fmt.Errorf("%s is %s, want %s", where, shown, want)
}
