package policy

import (
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/metadata"
)

// FuzzParse checks that Parse never panics and that whatever it accepts
// survives Marshal and Parse unchanged, so a policy written by Terraform
// means the same once the join service reads it.
func FuzzParse(f *testing.F) {
	f.Add([]byte("images: []\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		p, err := Parse(data)
		if err != nil {
			return
		}
		out, err := p.Marshal()
		if err != nil {
			t.Fatalf("Marshal of a parsed policy failed: %v", err)
		}
		again, err := Parse(out)
		if err != nil {
			t.Fatalf("Parse(Marshal()) failed: %v\n%s", err, out)
		}
		if !equalPolicies(p, again) {
			t.Fatalf("round trip changed the policy:\n%s\nbecame %s", dump(p), dump(again))
		}
		if _, err := p.Check(metadata.RoleWorker, nil, time.Time{}); err == nil {
			t.Fatal("Check let an empty quote join")
		}
	})
}
