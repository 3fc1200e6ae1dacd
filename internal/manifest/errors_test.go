package manifest

import (
	"fmt"
	"strings"
	"testing"
)

// TestErrorsShowTheValue checks that a refused manifest names the place and the bad value itself, so that
// the operator sees what to fix without opening the file at an offset.
func TestErrorsShowTheValue(t *testing.T) {
	pcr := func(k, v string) string { return fmt.Sprintf(`,"pcrs":{%q:%q}`, k, v) }
	second := func(img string) string {
		return fmt.Sprintf(`{"version":1,"images":[{%s%s},{%s}]}`, base, pcr("4", digest), img)
	}
	tests := []struct {
		name, data, want string
	}{
		{"PCR value", doc(base + pcr("4", "ABC")), `PCR 4: value "ABC" is not 64 lowercase hex digits`},
		{"PCR value number", doc(base + `,"pcrs":{"4":1}`), `decoding image manifest: images[0].pcrs."4" is the number 1, want a string`},
		{"version as string", `{"version":"1","images":[]}`, `decoding image manifest: version is the string "1", want a number`},
		{"images as object", `{"version":1,"images":{}}`, `images is an object, want an array`},
		{"name in second image", second(`"name":"Berth_2","builder":"qemu","artifact_id":"x"` + pcr("4", digest)),
			`image manifest image 1: name "Berth_2" has 'B' at position 0`},
		{"builder as boolean", second(`"name":"b","builder":true,"artifact_id":"x"` + pcr("4", digest)),
			`images[1].builder is true, want a string`},
		{"control character", doc(`"name":"a","builder":"qemu","artifact_id":"x\ny"` + pcr("4", digest)),
			`artifact_id "x\ny" contains control characters`},
		{"component version", doc(base + pcr("4", digest) + `,"components":{"kubernetes":["v1.36.3"]}`),
			`images[0].components."kubernetes" is an array, want a string`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Parse([]byte(tt.data))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Parse: %v\nwant an error containing %s", err, tt.want)
			}
		})
	}
}

// TestErrorsCutLongValues checks that a huge bad value is shown only in part.
func TestErrorsCutLongValues(t *testing.T) {
	long := strings.Repeat("A", 4096)
	_, err := Parse([]byte(doc(base + fmt.Sprintf(`,"pcrs":{"4":%q}`, long))))
	if err == nil || !strings.Contains(err.Error(), `... (4096 bytes) is not 64 lowercase hex digits`) || strings.Contains(err.Error(), long[:100]) {
		t.Fatalf("Parse of a 4096-byte PCR value: %v", err)
	}
}
