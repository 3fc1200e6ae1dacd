package manifest

import (
	"bytes"
	"fmt"
	"os"
	"strings"
	"testing"
)

var digest = strings.Repeat("ab", 32)

// doc returns a one-image manifest whose image object has the given JSON fields.
func doc(fields string) string {
	return `{"version":1,"images":[{` + fields + `}]}`
}

const base = `"name":"berth-1","builder":"qemu","artifact_id":"disk.qcow2","region":""`

func TestParseFixture(t *testing.T) {
	data, err := os.ReadFile("testdata/berth-image.json")
	if err != nil {
		t.Fatal(err)
	}
	m, err := Parse(data)
	if err != nil {
		t.Fatalf("Parse: %v", err)
	}
	if got := strings.Join(m.Names(), ","); got != "berth-2026-11-22,berth-2026-11-22-aws" {
		t.Errorf("names %s", got)
	}
	img, ok := m.Image("berth-2026-11-22-aws")
	if !ok {
		t.Fatal("image berth-2026-11-22-aws not found")
	}
	if img.Builder != "amazon-ebs" || img.ArtifactID != "ami-0123456789abcdef0" || img.Region != "eu-central-1" {
		t.Errorf("image %+v", img)
	}
	if img.PCRs["11"] != "9c1f2e3d4c5b6a798877665544332211ffeeddccbbaa99887766554433221100" || len(img.PCRs) != 2 {
		t.Errorf("pcrs %v", img.PCRs)
	}
	if img.Components["kubernetes"] != "v1.36.3" {
		t.Errorf("components %v", img.Components)
	}
	if _, ok := m.Image("nope"); ok {
		t.Error("found an image that is not in the manifest")
	}
}

func TestParseRefuses(t *testing.T) {
	pcr := func(k, v string) string { return fmt.Sprintf(`,"pcrs":{%q:%q}`, k, v) }
	manyImages := make([]string, MaxImages+1)
	for i := range manyImages {
		manyImages[i] = fmt.Sprintf(`{"name":"i%d","builder":"qemu","artifact_id":"x","pcrs":{"4":%q}}`, i, digest)
	}
	tests := []struct {
		name, data, want string
	}{
		{"not JSON", `{`, "decoding"},
		{"trailing data", doc(base+pcr("4", digest)) + `{}`, "trailing data"},
		{"version 2", `{"version":2,"images":[]}`, "version is 2, want 1"},
		{"no version", `{"images":[]}`, "version is 0"},
		{"no images", `{"version":1,"images":[]}`, "no images"},
		{"unknown top key", `{"version":1,"images":[],"extra":1}`, `unknown key "extra"`},
		{"unknown image key", doc(base + pcr("4", digest) + `,"roles":[]`), `unknown key "roles"`},
		{"key in another case", doc(`"Name":"a","builder":"qemu","artifact_id":"x"` + pcr("4", digest)), `unknown key "Name"`},
		{"duplicate PCR", doc(base + fmt.Sprintf(`,"pcrs":{"4":%q,"4":%q}`, digest, digest)), `key "4" appears twice`},
		{"duplicate image key", doc(base + `,"name":"b"` + pcr("4", digest)), `key "name" appears twice`},
		{"empty name", doc(`"name":"","builder":"qemu","artifact_id":"x"` + pcr("4", digest)), "name is empty"},
		{"name with uppercase", doc(`"name":"Berth","builder":"qemu","artifact_id":"x"` + pcr("4", digest)), "only a-z"},
		{"no builder", doc(`"name":"a","artifact_id":"x"` + pcr("4", digest)), "builder is empty"},
		{"no artifact", doc(`"name":"a","builder":"qemu"` + pcr("4", digest)), "artifact_id is empty"},
		{"control character", doc(`"name":"a","builder":"qemu","artifact_id":"x\ny"` + pcr("4", digest)), "control characters"},
		{"no PCRs", doc(base), "pcrs is empty"},
		{"PCR 24", doc(base + pcr("24", digest)), `PCR index "24"`},
		{"PCR -1", doc(base + pcr("-1", digest)), `PCR index "-1"`},
		{"PCR leading zero", doc(base + pcr("04", digest)), `PCR index "04"`},
		{"PCR not a number", doc(base + pcr("four", digest)), `PCR index "four"`},
		{"PCR uppercase hex", doc(base + pcr("4", strings.ToUpper(digest))), "lowercase hex"},
		{"PCR short", doc(base + pcr("4", digest[:62])), "lowercase hex"},
		{"PCR value number", doc(base + `,"pcrs":{"4":1}`), "decoding"},
		{"component empty version", doc(base + pcr("4", digest) + `,"components":{"kubernetes":""}`), `component "kubernetes" is empty`},
		{"duplicate names", `{"version":1,"images":[` +
			fmt.Sprintf(`{"name":"a","builder":"qemu","artifact_id":"x","pcrs":{"4":%q}},`, digest) +
			fmt.Sprintf(`{"name":"a","builder":"qemu","artifact_id":"y","pcrs":{"4":%q}}]}`, digest), "both named"},
		{"too many images", `{"version":1,"images":[` + strings.Join(manyImages, ",") + `]}`, "more than the limit of 64"},
		{"too large", `{"version":1,"images":[]}` + strings.Repeat(" ", MaxSize), "more than the limit"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m, err := Parse([]byte(tt.data))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Parse: %v, want an error containing %q", err, tt.want)
			}
			if m != nil {
				t.Error("Parse returned a manifest with its error")
			}
		})
	}
}

func TestParseAcceptsEdges(t *testing.T) {
	tests := []struct{ name, data string }{
		{"PCR 0 and 23", doc(base + fmt.Sprintf(`,"pcrs":{"0":%q,"23":%q}`, digest, digest))},
		{"no region, no components", doc(`"name":"a","builder":"qemu","artifact_id":"x"` + fmt.Sprintf(`,"pcrs":{"4":%q}`, digest))},
		{"same key in different objects", doc(base + fmt.Sprintf(`,"pcrs":{"4":%q},"components":{"4":"v1"}`, digest))},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := Parse([]byte(tt.data)); err != nil {
				t.Fatalf("Parse: %v", err)
			}
		})
	}
}

func TestErrorsDoNotEchoLongKeys(t *testing.T) {
	long := strings.Repeat("k", 4096)
	_, err := Parse([]byte(doc(base + fmt.Sprintf(`,"pcrs":{%q:%q}`, long, digest))))
	if err == nil || bytes.Contains([]byte(err.Error()), []byte(long[:64])) {
		t.Fatalf("error %v echoes the refused key at length", err)
	}
}

func TestMarshalRoundTrip(t *testing.T) {
	data, err := os.ReadFile("testdata/berth-image.json")
	if err != nil {
		t.Fatal(err)
	}
	m, err := Parse(data)
	if err != nil {
		t.Fatal(err)
	}
	out, err := m.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	again, err := Parse(out)
	if err != nil {
		t.Fatalf("Parse(Marshal()) = %v\n%s", err, out)
	}
	if fmt.Sprint(again) != fmt.Sprint(m) {
		t.Errorf("round trip changed the manifest:\n%v\n%v", m, again)
	}
	m.Images[0].PCRs["11"] = "XYZ"
	if _, err := m.Marshal(); err == nil {
		t.Error("Marshal wrote a manifest Parse refuses")
	}
}
