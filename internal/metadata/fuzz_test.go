package metadata

import (
	"bytes"
	"encoding/json"
	"testing"
)

// FuzzParseDocument feeds arbitrary bytes to the parser of the metadata service's document. It must never
// panic, and a document it accepts must survive being written out and read back: the service serves what
// it parsed as JSON, and nodes parse that again.
func FuzzParseDocument(f *testing.F) {
	f.Fuzz(func(t *testing.T, data []byte) {
		doc, err := ParseDocument(data)
		if err != nil {
			if doc != nil {
				t.Fatalf("ParseDocument returned a document with the error %v", err)
			}
			return
		}
		if err := doc.Validate(); err != nil {
			t.Fatalf("parsed document does not validate: %v", err)
		}
		out, err := json.Marshal(doc)
		if err != nil {
			t.Fatalf("marshalling a parsed document: %v", err)
		}
		again, err := ParseDocument(out)
		if err != nil {
			t.Fatalf("document %s no longer parses after a JSON round trip: %v", out, err)
		}
		out2, err := json.Marshal(again)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(out, out2) {
			t.Fatalf("round trip changed the document:\n%s\n%s", out, out2)
		}
	})
}
