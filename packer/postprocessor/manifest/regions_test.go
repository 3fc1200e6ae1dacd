package manifest

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	packersdk "github.com/hashicorp/packer-plugin-sdk/packer"

	imagemanifest "github.com/berthlabs/berth/internal/manifest"
)

func TestAmazonAMIs(t *testing.T) {
	for _, tc := range []struct {
		id   string
		want map[string]string
	}{
		{"eu-central-1:ami-0123456789abcdef0", map[string]string{"eu-central-1": "ami-0123456789abcdef0"}},
		{"eu-central-1:ami-0a,us-gov-west-1:ami-0b", map[string]string{"eu-central-1": "ami-0a", "us-gov-west-1": "ami-0b"}},
		{"output/berth.raw", nil},
		{"ami-0123", nil},
		{"eu-central-1:ami-0a,eu-central-1:ami-0b", nil},
		{"eu-central-1:ami-0a,", nil},
		{"eu-central-1:snap-0a", nil},
	} {
		got, ok := amazonAMIs(tc.id)
		if ok != (tc.want != nil) || len(got) != len(tc.want) {
			t.Errorf("amazonAMIs(%q) = %v, %v; want %v", tc.id, got, ok, tc.want)
			continue
		}
		for r, ami := range tc.want {
			if got[r] != ami {
				t.Errorf("amazonAMIs(%q)[%s] = %q, want %q", tc.id, r, got[r], ami)
			}
		}
	}
}

func TestEntries(t *testing.T) {
	const two = "us-east-1:ami-0b,eu-central-1:ami-0a"
	for _, tc := range []struct {
		name                   string
		artifactID, region, id string
		want                   []string // name artifact_id region
		err                    string
	}{
		{name: "one region", id: "eu-central-1:ami-0a", want: []string{"berth-aws ami-0a eu-central-1"}},
		{name: "one region, named", id: "eu-central-1:ami-0a", region: "eu-central-1", want: []string{"berth-aws ami-0a eu-central-1"}},
		{name: "one region, another named", id: "eu-central-1:ami-0a", region: "us-east-1", err: "region is us-east-1, but the artifact has AMIs only in eu-central-1"},
		{name: "two regions", id: two, region: "us-east-1", want: []string{"berth-aws ami-0b us-east-1", "berth-aws-eu-central-1 ami-0a eu-central-1"}},
		{name: "two regions, none named", id: two, err: "AMIs in 2 regions (eu-central-1, us-east-1): set region"},
		{name: "a disk image", id: "output/berth.raw", want: []string{"berth-aws output/berth.raw "}},
		{name: "artifact_id set", artifactID: "ami-0c", region: "eu-west-1", id: two, want: []string{"berth-aws ami-0c eu-west-1"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := &PostProcessor{config: Config{ArtifactID: tc.artifactID, Region: tc.region}}
			images, err := p.entries(tc.id, imagemanifest.Image{Name: "berth-aws"})
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("entries = %v, %v; want an error containing %q", images, err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, img := range images {
				got = append(got, img.Name+" "+img.ArtifactID+" "+img.Region)
			}
			if strings.Join(got, "|") != strings.Join(tc.want, "|") {
				t.Errorf("entries = %q, want %q", got, tc.want)
			}
		})
	}
}

// amazonArtifact is what amazon-ebs hands post-processors: no files, and an id naming AMIs by region.
type amazonArtifact struct {
	packersdk.Artifact
	id string
}

func (a amazonArtifact) BuilderId() string { return "mitchellh.amazonebs" }
func (a amazonArtifact) Id() string        { return a.id }
func (a amazonArtifact) Files() []string   { return nil }

// TestPostProcessAMIs writes the entries of AMIs in two regions, predicted from the configured uki, into a
// manifest that Parse accepts.
func TestPostProcessAMIs(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "berth-image.json")
	uki := filepath.Join(dir, "berth.efi")
	pcr := make([]byte, 32)
	pcr[0] = 0xab
	p := &PostProcessor{predict: func(path string) (map[int][]byte, error) {
		if path != uki {
			t.Errorf("predicted %s, want the configured uki %s", path, uki)
		}
		return map[int][]byte{4: pcr, 12: make([]byte, 32)}, nil
	}}
	if err := p.Configure(map[string]any{"image_name": "berth-node-aws", "output": out, "uki": uki, "region": "eu-central-1",
		"packer_builder_type": "amazon-ebs"}); err != nil {
		t.Fatal(err)
	}
	art, keep, forceOverride, err := p.PostProcess(context.Background(), packersdk.TestUi(t),
		amazonArtifact{id: "eu-central-1:ami-0a1,eu-west-1:ami-0b2"})
	if err != nil {
		t.Fatal(err)
	}
	if !keep || forceOverride || art.Id() != "berth-node-aws" {
		t.Errorf("PostProcess = %v (id %s), keep %v, force %v", art, art.Id(), keep, forceOverride)
	}
	data, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	m, err := imagemanifest.Parse(data)
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]string{"berth-node-aws": "ami-0a1 eu-central-1", "berth-node-aws-eu-west-1": "ami-0b2 eu-west-1"} {
		img, ok := m.Image(name)
		if !ok {
			t.Fatalf("manifest images %v, no %s", m.Names(), name)
		}
		if got := img.ArtifactID + " " + img.Region; got != want || img.Builder != "amazon-ebs" || img.PCRs["4"] != "ab"+strings.Repeat("00", 31) {
			t.Errorf("%s: %+v, want %s", name, img, want)
		}
	}
}
