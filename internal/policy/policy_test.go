package policy

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/metadata"
)

// pcr returns a distinct SHA-256 value for a label, standing in for a measurement.
func pcr(label string) []byte {
	d := sha256.Sum256([]byte(label))
	return d[:]
}

func hx(label string) string { return hex.EncodeToString(pcr(label)) }

func TestParseAccepts(t *testing.T) {
	expires := time.Date(2026, 12, 31, 0, 0, 0, 0, time.UTC)
	tests := []struct {
		name  string
		input string
		want  *Policy
	}{
		{
			name: "yaml with quoted keys and expiry",
			input: `images:
- name: berth-2026-11-01
  roles: [control-plane, worker]
  pcrs:
    "4": "` + hx("4") + `"
    "11": "` + hx("11") + `"
  expires: "2026-12-31T00:00:00Z"
`,
			want: &Policy{Images: []Image{{
				Name:    "berth-2026-11-01",
				Roles:   []metadata.Role{metadata.RoleControlPlane, metadata.RoleWorker},
				PCRs:    map[int][]byte{4: pcr("4"), 11: pcr("11")},
				Expires: &expires,
			}}},
		},
		{
			name: "unquoted keys, uppercase hex, unquoted timestamp with offset",
			input: `images:
- name: w.1
  roles: [worker]
  pcrs:
    9: ` + strings.ToUpper(hx("9")) + `
  expires: 2026-12-31T02:00:00+02:00
`,
			want: &Policy{Images: []Image{{
				Name:    "w.1",
				Roles:   []metadata.Role{metadata.RoleWorker},
				PCRs:    map[int][]byte{9: pcr("9")},
				Expires: &expires,
			}}},
		},
		{
			name:  "json with a Kubernetes version",
			input: `{"images":[{"name":"cp","roles":["control-plane"],"pcrs":{"0":"` + hx("0") + `","23":"` + hx("23") + `"},"kubernetesVersion":"v1.36.3"}]}`,
			want: &Policy{Images: []Image{{
				Name:              "cp",
				Roles:             []metadata.Role{metadata.RoleControlPlane},
				PCRs:              map[int][]byte{0: pcr("0"), 23: pcr("23")},
				KubernetesVersion: "v1.36.3",
			}}},
		},
		{name: "explicit empty list", input: "images: []\n", want: &Policy{Images: []Image{}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Parse([]byte(tt.input))
			if err != nil {
				t.Fatalf("Parse: %v", err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("Parse = %s\nwant %s", dump(got), dump(tt.want))
			}
		})
	}
}

func TestParseRefuses(t *testing.T) {
	image := func(name, roles, pcrs, extra string) string {
		return fmt.Sprintf("- name: %s\n  roles: %s\n  pcrs: %s\n%s", name, roles, pcrs, extra)
	}
	goodPCRs := `{"4": "` + hx("4") + `"}`
	many := "images:\n"
	for i := range MaxImages + 1 {
		many += image(fmt.Sprintf("img-%d", i), "[worker]", goodPCRs, "")
	}
	tests := []struct {
		name    string
		input   string
		wantErr string
	}{
		{name: "too large", input: "images: []\n" + strings.Repeat("#", MaxSize), wantErr: "more than the limit of 1048576"},
		{name: "empty document", input: "", wantErr: `no "images" list`},
		{name: "null images", input: "images:\n", wantErr: `no "images" list`},
		{name: "misspelt top-level field", input: "image: []\n", wantErr: `unknown field "image"`},
		{name: "unknown image field", input: "images:\n" + image("a", "[worker]", goodPCRs, "  kernel: x\n"), wantErr: `unknown field "kernel"`},
		{name: "duplicate key", input: "images:\n" + image("a", "[worker]", goodPCRs, "  name: b\n"), wantErr: `"name" already set`},
		{name: "not yaml", input: "images: [\n", wantErr: "decoding join policy"},
		{name: "images not a list", input: "images: {}\n", wantErr: "decoding join policy"},
		{name: "too many images", input: many, wantErr: "257 images, more than the limit of 256"},
		{name: "empty name", input: "images:\n" + image(`""`, "[worker]", goodPCRs, ""), wantErr: "image 0: name is empty"},
		{name: "uppercase name", input: "images:\n" + image("Berth", "[worker]", goodPCRs, ""), wantErr: `name has 'B' at position 0`},
		{name: "name with slash", input: "images:\n" + image("a/b", "[worker]", goodPCRs, ""), wantErr: `name has '/' at position 1`},
		{name: "name too long", input: "images:\n" + image(strings.Repeat("a", 254), "[worker]", goodPCRs, ""), wantErr: "name is 254 characters, more than 253"},
		{name: "duplicate names", input: "images:\n" + image("a", "[worker]", goodPCRs, "") + image("a", "[control-plane]", goodPCRs, ""), wantErr: `images 0 and 1 are both named "a"`},
		{name: "no roles", input: "images:\n" + image("a", "[]", goodPCRs, ""), wantErr: "roles is empty"},
		{name: "roles missing", input: "images:\n- name: a\n  pcrs: " + goodPCRs + "\n", wantErr: "roles is empty"},
		{name: "unknown role", input: "images:\n" + image("a", "[master]", goodPCRs, ""), wantErr: `role "master" is not "control-plane" or "worker"`},
		{name: "duplicate role", input: "images:\n" + image("a", "[worker, worker]", goodPCRs, ""), wantErr: `role "worker" is listed twice`},
		{name: "no pcrs", input: "images:\n" + image("a", "[worker]", "{}", ""), wantErr: "pcrs is empty"},
		{name: "pcr index too big", input: "images:\n" + image("a", "[worker]", `{"24": "`+hx("x")+`"}`, ""), wantErr: "PCR index 24 is outside 0..23"},
		{name: "pcr index negative", input: "images:\n" + image("a", "[worker]", `{"-1": "`+hx("x")+`"}`, ""), wantErr: "PCR index -1 is outside 0..23"},
		{name: "pcr index leading zero", input: "images:\n" + image("a", "[worker]", `{"04": "`+hx("x")+`"}`, ""), wantErr: `PCR index "04" is not a decimal number`},
		{name: "pcr index word", input: "images:\n" + image("a", "[worker]", `{"kernel": "`+hx("x")+`"}`, ""), wantErr: `PCR index "kernel" is not a decimal number`},
		{name: "pcr value short", input: "images:\n" + image("a", "[worker]", `{"4": "`+hx("x")[:40]+`"}`, ""), wantErr: "PCR 4: value has 40 characters, want 64 hex"},
		{name: "pcr value sha384", input: "images:\n" + image("a", "[worker]", `{"4": "`+strings.Repeat("ab", 48)+`"}`, ""), wantErr: "PCR 4: value has 96 characters"},
		{name: "pcr value not hex", input: "images:\n" + image("a", "[worker]", `{"4": "`+strings.Repeat("zz", 32)+`"}`, ""), wantErr: "PCR 4: value is not hex"},
		{name: "expires date only", input: "images:\n" + image("a", "[worker]", goodPCRs, "  expires: \"2026-12-31\"\n"), wantErr: `expires "2026-12-31" is not an RFC 3339 time`},
		{name: "expires empty", input: "images:\n" + image("a", "[worker]", goodPCRs, "  expires: \"\"\n"), wantErr: `expires "" is not an RFC 3339 time`},
		{name: "kubernetes version without v", input: "images:\n" + image("a", "[worker]", goodPCRs, "  kubernetesVersion: 1.36.3\n"), wantErr: `kubernetesVersion "1.36.3" is not a Kubernetes release`},
		{name: "kubernetes minor only", input: "images:\n" + image("a", "[worker]", goodPCRs, "  kubernetesVersion: v1.36\n"), wantErr: `kubernetesVersion "v1.36" is not a Kubernetes release`},
		{name: "error names the image", input: "images:\n" + image("good", "[worker]", goodPCRs, "") + image("bad", "[worker]", "{}", ""), wantErr: `image 1 ("bad"): pcrs is empty`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := Parse([]byte(tt.input))
			if err == nil {
				t.Fatalf("Parse accepted it: %s", dump(p))
			}
			if !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("error %q does not contain %q", err, tt.wantErr)
			}
		})
	}
}

func TestMarshalRoundTrip(t *testing.T) {
	expires := time.Date(2027, 1, 2, 3, 4, 5, 600, time.FixedZone("x", 3600))
	p := &Policy{Images: []Image{
		{Name: "a", Roles: []metadata.Role{metadata.RoleWorker, metadata.RoleControlPlane}, PCRs: map[int][]byte{4: pcr("4"), 11: pcr("11"), 9: pcr("9")}, Expires: &expires},
		{Name: "b", Roles: []metadata.Role{metadata.RoleWorker}, PCRs: map[int][]byte{0: pcr("0")}, KubernetesVersion: "v1.37.0-rc.1"},
	}}
	out, err := p.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	again, err := Parse(out)
	if err != nil {
		t.Fatalf("Parse(Marshal()) failed: %v\n%s", err, out)
	}
	if !equalPolicies(p, again) {
		t.Fatalf("round trip changed the policy:\n%s\nbecame %s", dump(p), dump(again))
	}
	out2, err := again.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(out, out2) {
		t.Errorf("Marshal is not canonical:\n%s\nthen\n%s", out, out2)
	}
	if !bytes.Contains(out, []byte(hx("9"))) || !bytes.Contains(out, []byte("2027-01-02T02:04:05.0000006Z")) {
		t.Errorf("Marshal output lacks lowercase hex or UTC time:\n%s", out)
	}

	empty, err := (&Policy{}).Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if p, err := Parse(empty); err != nil || len(p.Images) != 0 {
		t.Errorf("empty policy marshals to %q, which parses to %v, %v", empty, p, err)
	}
}

func TestMarshalRefusesInvalidPolicy(t *testing.T) {
	tests := []struct {
		name    string
		image   Image
		wantErr string
	}{
		{name: "short digest", image: Image{Name: "a", Roles: []metadata.Role{metadata.RoleWorker}, PCRs: map[int][]byte{4: {1, 2}}}, wantErr: "PCR 4: value has 2 bytes"},
		{name: "index out of range", image: Image{Name: "a", Roles: []metadata.Role{metadata.RoleWorker}, PCRs: map[int][]byte{30: pcr("x")}}, wantErr: "PCR index 30"},
		{name: "no roles", image: Image{Name: "a", PCRs: map[int][]byte{4: pcr("x")}}, wantErr: "roles is empty"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := (&Policy{Images: []Image{tt.image}}).Marshal()
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("error %v, want one containing %q", err, tt.wantErr)
			}
		})
	}
}

func TestPCRIndexes(t *testing.T) {
	p := &Policy{Images: []Image{
		{PCRs: map[int][]byte{11: nil, 4: nil}},
		{PCRs: map[int][]byte{9: nil, 4: nil, 0: nil}},
	}}
	if got, want := p.PCRIndexes(), []int{0, 4, 9, 11}; !reflect.DeepEqual(got, want) {
		t.Errorf("PCRIndexes() = %v, want %v", got, want)
	}
	if got := (&Policy{}).PCRIndexes(); len(got) != 0 {
		t.Errorf("PCRIndexes() of an empty policy = %v", got)
	}
}

func TestCheck(t *testing.T) {
	expiry := time.Date(2026, 12, 31, 0, 0, 0, 0, time.UTC)
	before, after := expiry.Add(-time.Hour), expiry.Add(time.Second)
	both := []metadata.Role{metadata.RoleControlPlane, metadata.RoleWorker}
	full := &Policy{Images: []Image{
		{Name: "berth-1", Roles: both, PCRs: map[int][]byte{4: pcr("a4"), 9: pcr("a9"), 11: pcr("a11")}, KubernetesVersion: "v1.36.3"},
		{Name: "berth-2", Roles: []metadata.Role{metadata.RoleWorker}, PCRs: map[int][]byte{4: pcr("b4"), 9: pcr("b9"), 11: pcr("b11")}, Expires: &expiry},
		{Name: "cp-only", Roles: []metadata.Role{metadata.RoleControlPlane}, PCRs: map[int][]byte{4: pcr("c4"), 9: pcr("c9")}},
	}}
	cpOnly := &Policy{Images: full.Images[2:]}
	quoteA := map[int][]byte{4: pcr("a4"), 9: pcr("a9"), 11: pcr("a11")}
	quoteB := map[int][]byte{4: pcr("b4"), 9: pcr("b9"), 11: pcr("b11")}
	quoteC := map[int][]byte{4: pcr("c4"), 9: pcr("c9"), 11: pcr("whatever")}
	with := func(q map[int][]byte, idx int, v []byte) map[int][]byte {
		c := make(map[int][]byte, len(q))
		for k, val := range q {
			c[k] = val
		}
		if v == nil {
			delete(c, idx)
		} else {
			c[idx] = v
		}
		return c
	}

	tests := []struct {
		name      string
		policy    *Policy
		role      metadata.Role
		quote     map[int][]byte
		now       time.Time
		wantImage string
		want      *MismatchError
		wantMsg   string
	}{
		{name: "match as worker", policy: full, role: metadata.RoleWorker, quote: quoteA, now: before, wantImage: "berth-1"},
		{name: "match as control plane", policy: full, role: metadata.RoleControlPlane, quote: quoteA, now: after, wantImage: "berth-1"},
		{name: "second of several images matches", policy: full, role: metadata.RoleWorker, quote: quoteB, now: before, wantImage: "berth-2"},
		{name: "at the expiry instant", policy: full, role: metadata.RoleWorker, quote: quoteB, now: expiry, wantImage: "berth-2"},
		{name: "extra quoted PCRs are ignored", policy: full, role: metadata.RoleWorker, quote: with(quoteA, 7, pcr("x")), now: before, wantImage: "berth-1"},
		{
			name: "PCR differs", policy: full, role: metadata.RoleWorker, quote: with(quoteA, 9, pcr("evil")), now: before,
			want:    &MismatchError{Role: metadata.RoleWorker, Image: "berth-1", PCR: 9, Expected: pcr("a9"), Got: pcr("evil")},
			wantMsg: `closest image "berth-1": PCR 9: expected ` + hx("a9") + `, got ` + hx("evil"),
		},
		{
			name: "lowest differing PCR is reported", policy: full, role: metadata.RoleWorker, quote: with(with(quoteA, 11, pcr("x")), 4, pcr("y")), now: before,
			want: &MismatchError{Role: metadata.RoleWorker, Image: "berth-1", PCR: 4, Expected: pcr("a4"), Got: pcr("y")},
		},
		{
			name: "PCR missing from quote", policy: full, role: metadata.RoleWorker, quote: with(quoteA, 11, nil), now: before,
			want:    &MismatchError{Role: metadata.RoleWorker, Image: "berth-1", PCR: 11, Expected: pcr("a11")},
			wantMsg: `PCR 11: expected ` + hx("a11") + `, got nothing (PCR not quoted)`,
		},
		{
			name: "closest is the image with most matching PCRs", policy: full, role: metadata.RoleWorker, quote: with(quoteB, 11, pcr("x")), now: before,
			want: &MismatchError{Role: metadata.RoleWorker, Image: "berth-2", PCR: 11, Expected: pcr("b11"), Got: pcr("x")},
		},
		{
			name: "expired", policy: full, role: metadata.RoleWorker, quote: quoteB, now: after,
			want:    &MismatchError{Role: metadata.RoleWorker, Image: "berth-2", PCR: -1, Expired: &expiry},
			wantMsg: `closest image "berth-2": expired at 2026-12-31T00:00:00Z`,
		},
		{
			name: "image for another role only", policy: cpOnly, role: metadata.RoleWorker, quote: quoteC, now: before,
			want:    &MismatchError{Role: metadata.RoleWorker, Image: "cp-only", PCR: -1, RoleNotAllowed: true},
			wantMsg: `closest image "cp-only": not allowed for role worker`,
		},
		{
			// A worker quoting the control-plane image is compared with the worker images:
			// the images it could join as are what the operator needs to see.
			name: "images allowed for the role are preferred", policy: full, role: metadata.RoleWorker, quote: quoteC, now: before,
			want: &MismatchError{Role: metadata.RoleWorker, Image: "berth-1", PCR: 4, Expected: pcr("a4"), Got: pcr("c4")},
		},
		{
			name: "control plane quoting a worker-only image", policy: full, role: metadata.RoleControlPlane, quote: quoteB, now: before,
			want: &MismatchError{Role: metadata.RoleControlPlane, Image: "berth-1", PCR: 4, Expected: pcr("a4"), Got: pcr("b4")},
		},
		{
			name: "empty policy", policy: &Policy{}, role: metadata.RoleWorker, quote: quoteA, now: before,
			want:    &MismatchError{Role: metadata.RoleWorker, PCR: -1, NoImages: true},
			wantMsg: "join policy is empty: no image may join as worker",
		},
		{
			name: "nil policy", policy: nil, role: metadata.RoleControlPlane, quote: quoteA, now: before,
			want: &MismatchError{Role: metadata.RoleControlPlane, PCR: -1, NoImages: true},
		},
		{
			name: "empty quote", policy: full, role: metadata.RoleWorker, quote: nil, now: before,
			want: &MismatchError{Role: metadata.RoleWorker, Image: "berth-1", PCR: 4, Expected: pcr("a4")},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			img, err := tt.policy.Check(tt.role, tt.quote, tt.now)
			if tt.want == nil {
				if err != nil {
					t.Fatalf("Check: %v", err)
				}
				if img.Name != tt.wantImage {
					t.Fatalf("Check = %q, want %q", img.Name, tt.wantImage)
				}
				i := slices.IndexFunc(tt.policy.Images, func(im Image) bool { return im.Name == img.Name })
				if !reflect.DeepEqual(img, tt.policy.Images[i]) {
					t.Fatalf("Check = %s, not the policy's image %s", dump(&Policy{Images: []Image{img}}), dump(&Policy{Images: tt.policy.Images[i : i+1]}))
				}
				return
			}
			if img.Name != "" {
				t.Errorf("Check returned image %q with an error", img.Name)
			}
			var got *MismatchError
			if !errors.As(err, &got) {
				t.Fatalf("error %v (%T) is not a *MismatchError", err, err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("MismatchError = %+v\nwant %+v", got, tt.want)
			}
			if !strings.Contains(err.Error(), tt.wantMsg) {
				t.Errorf("message %q does not contain %q", err, tt.wantMsg)
			}
		})
	}
}

func TestMismatchErrorCombinesReasons(t *testing.T) {
	expiry := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	e := &MismatchError{Role: metadata.RoleWorker, Image: "old", PCR: 9, Expected: pcr("a"), Got: []byte{}, Expired: &expiry}
	want := `measurements not allowed for role worker: closest image "old": PCR 9: expected ` + hx("a") + `, got an empty value; expired at 2026-01-01T00:00:00Z`
	if e.Error() != want {
		t.Errorf("Error() = %q\nwant %q", e.Error(), want)
	}
}

func TestCheckDoesNotAliasPolicy(t *testing.T) {
	p := &Policy{Images: []Image{{Name: "a", Roles: []metadata.Role{metadata.RoleWorker}, PCRs: map[int][]byte{4: pcr("a")}}}}
	_, err := p.Check(metadata.RoleWorker, map[int][]byte{4: pcr("b")}, time.Now())
	var me *MismatchError
	if !errors.As(err, &me) {
		t.Fatalf("error %v is not a *MismatchError", err)
	}
	me.Expected[0] ^= 0xff
	if !bytes.Equal(p.Images[0].PCRs[4], pcr("a")) {
		t.Error("changing the error's Expected changed the policy")
	}
}

func equalPolicies(a, b *Policy) bool {
	if len(a.Images) != len(b.Images) {
		return false
	}
	for i := range a.Images {
		x, y := a.Images[i], b.Images[i]
		if x.Name != y.Name || !reflect.DeepEqual(x.Roles, y.Roles) || len(x.PCRs) != len(y.PCRs) || x.KubernetesVersion != y.KubernetesVersion {
			return false
		}
		for idx, v := range x.PCRs {
			if !bytes.Equal(v, y.PCRs[idx]) {
				return false
			}
		}
		if (x.Expires == nil) != (y.Expires == nil) || (x.Expires != nil && !x.Expires.Equal(*y.Expires)) {
			return false
		}
	}
	return true
}

func dump(p *Policy) string {
	if p == nil {
		return "<nil>"
	}
	var b strings.Builder
	for _, img := range p.Images {
		fmt.Fprintf(&b, "{%s %v", img.Name, img.Roles)
		for _, idx := range (&Policy{Images: []Image{img}}).PCRIndexes() {
			fmt.Fprintf(&b, " %d=%x", idx, img.PCRs[idx])
		}
		if img.Expires != nil {
			fmt.Fprintf(&b, " expires=%s", img.Expires.Format(time.RFC3339Nano))
		}
		b.WriteString("} ")
	}
	return b.String()
}

func TestForRole(t *testing.T) {
	now := time.Date(2026, 11, 25, 12, 0, 0, 0, time.UTC)
	past, future := now.Add(-time.Hour), now.Add(time.Hour)
	digest := func(b byte) map[int][]byte { return map[int][]byte{11: bytes.Repeat([]byte{b}, 32)} }
	p := &Policy{Images: []Image{
		{Name: "both", Roles: []metadata.Role{metadata.RoleControlPlane, metadata.RoleWorker}, PCRs: digest(1)},
		{Name: "workers", Roles: []metadata.Role{metadata.RoleWorker}, PCRs: digest(2)},
		{Name: "expired", Roles: []metadata.Role{metadata.RoleWorker}, PCRs: digest(3), Expires: &past},
		{Name: "expiring", Roles: []metadata.Role{metadata.RoleWorker}, PCRs: digest(4), Expires: &future},
	}}
	names := func(p *Policy) []string {
		var out []string
		for _, img := range p.Images {
			out = append(out, img.Name)
		}
		return out
	}
	if got := names(p.ForRole(metadata.RoleWorker, now)); !slices.Equal(got, []string{"both", "workers", "expiring"}) {
		t.Errorf("ForRole(worker) = %v", got)
	}
	if got := names(p.ForRole(metadata.RoleControlPlane, now)); !slices.Equal(got, []string{"both"}) {
		t.Errorf("ForRole(control-plane) = %v", got)
	}
	cut := p.ForRole(metadata.RoleControlPlane, now)
	data, err := cut.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	back, err := Parse(data)
	if err != nil || !slices.Equal(names(back), []string{"both"}) {
		t.Errorf("the cut policy does not round-trip: %v, %v", names(back), err)
	}
	var none *Policy
	data, err = none.ForRole(metadata.RoleWorker, now).Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if back, err := Parse(data); err != nil || len(back.Images) != 0 {
		t.Errorf("the cut of no policy = %q (%v), want an empty list that parses", data, err)
	}
}
