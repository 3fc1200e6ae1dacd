package manifest

import (
	"encoding/json"
	"reflect"
	"testing"
)

// FuzzParse checks that Parse never panics on arbitrary bytes and that a manifest it accepts survives being
// written out and read back unchanged: the Packer plugin writes what Terraform reads.
func FuzzParse(f *testing.F) {
	f.Fuzz(func(t *testing.T, data []byte) {
		m, err := Parse(data)
		if err != nil {
			if m != nil {
				t.Fatalf("Parse returned a manifest with the error %v", err)
			}
			return
		}
		if err := m.Validate(); err != nil {
			t.Fatalf("parsed manifest does not validate: %v", err)
		}
		out, err := json.Marshal(m)
		if err != nil {
			t.Fatalf("marshalling a parsed manifest: %v", err)
		}
		again, err := Parse(out)
		if err != nil {
			t.Fatalf("manifest %s no longer parses after a JSON round trip: %v", out, err)
		}
		if !reflect.DeepEqual(m, again) {
			t.Fatalf("round trip changed the manifest:\n%+v\n%+v", m, again)
		}
	})
}
