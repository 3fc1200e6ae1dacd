package manifest

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	packersdk "github.com/hashicorp/packer-plugin-sdk/packer"

	imagemanifest "github.com/berthlabs/berth/internal/manifest"
	"github.com/berthlabs/berth/test/packertest"
)

func image(name, pcr11 string) imagemanifest.Image {
	return imagemanifest.Image{Name: name, Builder: "qemu", ArtifactID: name + ".qcow2", PCRs: map[string]string{"11": pcr11}}
}

func TestUpdate(t *testing.T) {
	path := filepath.Join(t.TempDir(), "berth-image.json")
	a, b := strings.Repeat("aa", 32), strings.Repeat("bb", 32)
	for _, img := range []imagemanifest.Image{image("berth-1", a), image("berth-2", a), image("berth-1", b)} {
		if err := update(path, img); err != nil {
			t.Fatal(err)
		}
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	m, err := imagemanifest.Parse(data)
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(m.Names(), ","); got != "berth-1,berth-2" {
		t.Errorf("images %s, want berth-1 replaced in place and berth-2 kept", got)
	}
	if img, _ := m.Image("berth-1"); img.PCRs["11"] != b {
		t.Errorf("berth-1 was not replaced: %v", img.PCRs)
	}

	// A manifest that does not parse is not overwritten: it may be someone's hand edit.
	if err := os.WriteFile(path, []byte(`{"version":1,"images":[{"Name":"x"}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := update(path, image("berth-3", a)); err == nil || !strings.Contains(err.Error(), "left as it is") {
		t.Errorf("update of an invalid manifest: %v", err)
	}
	if data, _ := os.ReadFile(path); !strings.Contains(string(data), `"Name":"x"`) {
		t.Error("the invalid manifest was overwritten")
	}
}

type artifact struct {
	packersdk.Artifact
	files []string
}

func (a artifact) Files() []string { return a.files }

func TestFindUKI(t *testing.T) {
	for _, tc := range []struct {
		name, uki string
		files     []string
		want, err string
	}{
		{name: "configured", uki: "/boot/x.efi", files: []string{"a.efi", "b.efi"}, want: "/boot/x.efi"},
		{name: "one efi file", files: []string{"disk.raw", "out/uki.efi"}, want: "out/uki.efi"},
		{name: "none", files: []string{"disk.raw"}, err: "has no .efi file"},
		{name: "two", files: []string{"a.efi", "b.efi"}, err: "several .efi files"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := &PostProcessor{config: Config{UKI: tc.uki}}
			got, err := p.findUKI(artifact{files: tc.files})
			if got != tc.want || (err == nil) != (tc.err == "") || (err != nil && !strings.Contains(err.Error(), tc.err)) {
				t.Errorf("findUKI = %q, %v; want %q, error containing %q", got, err, tc.want, tc.err)
			}
		})
	}
}

func TestConfigure(t *testing.T) {
	for _, tc := range []struct {
		raw  map[string]any
		want string
	}{
		{map[string]any{}, "image_name is required"},
		{map[string]any{"image_name": "Berth"}, `image_name: name "Berth" has 'B' at position 0`},
		{map[string]any{"image_name": "berth-2026-11-22"}, ""},
	} {
		p := &PostProcessor{}
		err := p.Configure(tc.raw)
		if (err == nil) != (tc.want == "") || (err != nil && !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("Configure(%v) = %v, want %q", tc.raw, err, tc.want)
		}
		if err == nil && p.config.Output != DefaultOutput {
			t.Errorf("output defaults to %q", p.config.Output)
		}
	}
}

// TestDocsListEveryOption keeps the hand-written documentation in step with Config: every option of the
// HCL2 spec that packer-sdc generates is documented, and nothing else is.
func TestDocsListEveryOption(t *testing.T) {
	packertest.DocumentsEveryOption(t, "packer/docs/post-processors/manifest.mdx", (&PostProcessor{}).ConfigSpec())
}

func TestArtifact(t *testing.T) {
	a := &Artifact{path: "out/berth-image.json", images: []imagemanifest.Image{{Name: "berth-node", PCRs: map[string]string{"12": "00", "4": "aa", "11": "bb", "9": "cc"}}}}
	if a.Id() != "berth-node" || len(a.Files()) != 1 || a.Files()[0] != "out/berth-image.json" || a.BuilderId() != BuilderID {
		t.Errorf("artifact id %q, files %v, builder %q", a.Id(), a.Files(), a.BuilderId())
	}
	if want := "image berth-node in out/berth-image.json, with the predicted PCR 4, 9, 11, 12"; a.String() != want {
		t.Errorf("String() = %q, want %q", a.String(), want)
	}
}
