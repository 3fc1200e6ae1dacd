package keys

import (
	"regexp"
	"strings"
	"testing"
)

var canonicalUUID = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)

// FuzzDiskLabel checks that DiskLabel accepts exactly the canonical UUIDs, never panics, and
// never yields a label that names anything but one disk.
func FuzzDiskLabel(f *testing.F) {
	f.Add("0f1e2d3c-4b5a-4978-8796-a5b4c3d2e1f0")
	f.Fuzz(func(t *testing.T, id string) {
		l, err := DiskLabel(id)
		want := canonicalUUID.MatchString(id) && id != "00000000-0000-0000-0000-000000000000"
		if want != (err == nil) {
			t.Fatalf("DiskLabel(%q) error = %v, want accepted = %v", id, err, want)
		}
		if err != nil {
			if l != (Label{}) {
				t.Fatalf("refused id %q returned label %v", id, l)
			}
			return
		}
		name := l.String()
		if name != "disk/"+id || strings.Count(name, "/") != 1 || strings.Contains(name, "..") {
			t.Fatalf("label for %q is %q", id, name)
		}
	})
}
