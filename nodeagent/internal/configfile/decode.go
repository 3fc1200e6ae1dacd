package configfile

import (
	"encoding/json"
	"fmt"
	"reflect"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

// decode decodes a configuration file's YAML into out (a pointer to a struct whose fields are named by
// their json tags), matching every key exactly and reporting every problem of the file at once, each with
// its line and the field's path. sigs.k8s.io/yaml's UnmarshalStrict cannot do this: it converts YAML to
// JSON for encoding/json, which matches keys case-insensitively (`statedisk:` set stateDisk), stops at the
// first problem and names neither the line nor, for a json.Unmarshaler such as Duration, the field. The
// values still end up in out through encoding/json, so that the json tags and UnmarshalJSON methods the
// rest of Berth uses stay the only definition of the format.
// It returns the line of each field the file sets, by its path ("aws.ec2Endpoint"), for the problems that
// Load's check finds in their values.
func decode(data []byte, out any) (map[string]int, error) {
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, err
	}
	if len(doc.Content) == 0 {
		// An empty file (or one of comments only) sets nothing; Validate says what is missing.
		return nil, nil
	}
	d := &decoder{lines: map[string]int{}}
	v := d.value(doc.Content[0], reflect.TypeOf(out).Elem(), "")
	if len(d.problems) > 0 {
		return nil, &problems{list: d.problems}
	}
	j, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	return d.lines, json.Unmarshal(j, out)
}

// problems is every problem found in one file, one per line of the message.
type problems struct{ list []error }

func (p *problems) Error() string {
	msgs := make([]string, len(p.list))
	for i, e := range p.list {
		msgs[i] = e.Error()
	}
	return strings.Join(msgs, "\n")
}

func (p *problems) Unwrap() []error { return p.list }

// decoder walks a YAML node tree beside the Go type it is decoded into, and builds the value encoding/json
// decodes: maps, slices, strings, numbers and bools, with a json.RawMessage for each json.Unmarshaler.
type decoder struct {
	problems []error
	lines    map[string]int
}

var jsonUnmarshaler = reflect.TypeFor[json.Unmarshaler]()

func (d *decoder) addf(n *yaml.Node, format string, args ...any) {
	d.problems = append(d.problems, fmt.Errorf("line %d: %s", n.Line, fmt.Sprintf(format, args...)))
}

// mismatch reports a value of the wrong shape: what the field wants, and what it got.
func (d *decoder) mismatch(n *yaml.Node, path, want string) {
	if path == "" {
		path = "top level"
	}
	d.addf(n, "%s: %s, not %s", path, want, shown(n))
}

// value is n decoded as t, at path (such as "aws.autoscalingGroups"; "" at the top), or nil after a
// problem.
func (d *decoder) value(n *yaml.Node, t reflect.Type, path string) any {
	if n.Kind == yaml.AliasNode {
		n = n.Alias
	}
	if n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null" {
		return nil
	}
	if reflect.PointerTo(t).Implements(jsonUnmarshaler) {
		return d.unmarshaler(n, t, path)
	}
	switch t.Kind() {
	case reflect.Pointer:
		return d.value(n, t.Elem(), path)
	case reflect.Struct:
		return d.structValue(n, t, path)
	case reflect.Map:
		return d.mapValue(n, t, path)
	case reflect.Slice:
		if n.Kind != yaml.SequenceNode {
			d.mismatch(n, path, "a list")
			return nil
		}
		list := make([]any, len(n.Content))
		for i, item := range n.Content {
			list[i] = d.value(item, t.Elem(), fmt.Sprintf("%s[%d]", path, i))
		}
		return list
	case reflect.String:
		// Any scalar is text here, as with sigs.k8s.io/yaml: `max-pods: 110` in kubelet.extraArgs is "110".
		if n.Kind != yaml.ScalarNode {
			d.mismatch(n, path, "a string")
			return nil
		}
		return n.Value
	default:
		// Booleans and numbers: yaml.v3 checks the literal against the type (range, YAML 1.1's yes and no
		// for a bool).
		v := reflect.New(t)
		if n.Kind != yaml.ScalarNode || n.Decode(v.Interface()) != nil {
			d.mismatch(n, path, describe(t))
			return nil
		}
		return v.Elem().Interface()
	}
}

// unmarshaler checks n with the UnmarshalJSON of t, whose error says what the field wants.
func (d *decoder) unmarshaler(n *yaml.Node, t reflect.Type, path string) any {
	var plain any
	if err := n.Decode(&plain); err != nil {
		d.addf(n, "%s: %v", path, err)
		return nil
	}
	j, err := json.Marshal(plain)
	if err != nil {
		d.addf(n, "%s: %v", path, err)
		return nil
	}
	if err := reflect.New(t).Interface().(json.Unmarshaler).UnmarshalJSON(j); err != nil {
		d.addf(n, "%s: %v", path, err)
		return nil
	}
	return json.RawMessage(j)
}

func (d *decoder) structValue(n *yaml.Node, t reflect.Type, path string) any {
	if n.Kind != yaml.MappingNode {
		d.mismatch(n, path, "a mapping of fields")
		return nil
	}
	fields := make(map[string]reflect.Type)
	for i := range t.NumField() {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if !f.IsExported() || name == "-" {
			continue
		}
		if name == "" {
			name = f.Name
		}
		fields[name] = f.Type
	}
	obj := make(map[string]any)
	d.pairs(n, path, func(key, val *yaml.Node) {
		ft, ok := fields[key.Value]
		if !ok {
			d.unknownField(key, path, fields)
			return
		}
		d.lines[join(path, key.Value)] = key.Line
		// A field set to null is a field left out: encoding/json would hand a Duration's UnmarshalJSON
		// "null" to parse.
		if v := d.value(val, ft, join(path, key.Value)); v != nil {
			obj[key.Value] = v
		}
	})
	return obj
}

func (d *decoder) mapValue(n *yaml.Node, t reflect.Type, path string) any {
	if n.Kind != yaml.MappingNode {
		d.mismatch(n, path, "a mapping")
		return nil
	}
	obj := make(map[string]any)
	d.pairs(n, path, func(key, val *yaml.Node) {
		obj[key.Value] = d.value(val, t.Elem(), path+"["+strconv.Quote(key.Value)+"]")
	})
	return obj
}

// pairs calls f with each key and value of the mapping n, refusing keys that are not scalars or that
// appear twice (YAML forbids it; sigs.k8s.io/yaml kept one of them silently).
func (d *decoder) pairs(n *yaml.Node, path string, f func(key, val *yaml.Node)) {
	seen := make(map[string]int)
	for i := 0; i+1 < len(n.Content); i += 2 {
		key, val := n.Content[i], n.Content[i+1]
		if key.Kind != yaml.ScalarNode {
			d.mismatch(key, path, "a key")
			continue
		}
		if first, ok := seen[key.Value]; ok {
			d.addf(key, "%s: set twice (first on line %d)", join(path, key.Value), first)
			continue
		}
		seen[key.Value] = key.Line
		f(key, val)
	}
}

// unknownField reports a key that names no field, with the field it differs from only in case: keys are
// matched exactly, and `statedisk:` is the likeliest way to get one wrong.
func (d *decoder) unknownField(key *yaml.Node, path string, fields map[string]reflect.Type) {
	where := ""
	if path != "" {
		where = path + ": "
	}
	for name := range fields {
		if strings.EqualFold(name, key.Value) {
			d.addf(key, "%sunknown field %q (keys are case-sensitive: did you mean %q?)", where, key.Value, name)
			return
		}
	}
	d.addf(key, "%sunknown field %q", where, key.Value)
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

// describe says what a value of the scalar type t is written as.
func describe(t reflect.Type) string {
	switch t.Kind() {
	case reflect.Bool:
		return "true or false"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return "an integer"
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "a non-negative integer"
	case reflect.Float32, reflect.Float64:
		return "a number"
	default:
		return "a " + t.String()
	}
}

// shown is n as a message quotes it.
func shown(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	}
	if n.ShortTag() == "!!str" {
		return strconv.Quote(n.Value)
	}
	return n.Value
}
