package manifest

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	packersdk "github.com/hashicorp/packer-plugin-sdk/packer"
	registryimage "github.com/hashicorp/packer-plugin-sdk/packer/registry/image"
	packerrpc "github.com/hashicorp/packer-plugin-sdk/rpc"

	imagemanifest "github.com/berthlabs/berth/internal/manifest"
)

// gceArtifact answers as packer-plugin-googlecompute v1.1.6's artifact (builder/googlecompute/artifact.go)
// does: its id is the image's name; String names the image's project (image_project_id, defaulting to
// project_id) and the name; State("ProjectId") is project_id; State("par.artifact.metadata") is the
// registry's *image.Image whose label self_link is the link Compute Engine returned for the image. describe
// overrides String, as older versions' artifacts say less ("A disk image was created: <name>" in v1.1.0);
// selfLink overrides the label, "-" leaving the metadata out.
type gceArtifact struct {
	name, project, imageProject, describe, selfLink string
}

func (a gceArtifact) BuilderId() string { return googleComputeBuilderID }
func (a gceArtifact) Files() []string   { return nil }
func (a gceArtifact) Id() string        { return a.name }
func (a gceArtifact) Destroy() error    { return nil }

func (a gceArtifact) String() string {
	if a.describe != "" {
		return a.describe
	}
	return fmt.Sprintf("A disk image was created in the '%v' project: %v", a.imageProject, a.name)
}

func (a gceArtifact) State(name string) any {
	switch name {
	case registryimage.ArtifactStateURI:
		link := a.selfLink
		switch link {
		case "-":
			return nil
		case "":
			link = "https://www.googleapis.com/compute/v1/projects/" + a.imageProject + "/global/images/" + a.name
		}
		return &registryimage.Image{ImageID: a.name, ProviderName: "gce", ProviderRegion: "europe-west1-b",
			Labels: map[string]string{"self_link": link, "project_id": a.imageProject, "disk_size_gb": "10"}}
	case "ImageName":
		return a.name
	case "ProjectId":
		if a.project == "" {
			return nil
		}
		return a.project
	case "BuildZone":
		return "europe-west1-b"
	}
	return nil
}

func TestGCESelfLink(t *testing.T) {
	const link = "https://www.googleapis.com/compute/v1/projects/"
	for _, tc := range []struct {
		name      string
		artifact  gceArtifact
		want, err string
	}{
		{name: "image in the build's project", artifact: gceArtifact{name: "berth-node-gcp-20261125120000", project: "berth-build", imageProject: "berth-build"},
			want: link + "berth-build/global/images/berth-node-gcp-20261125120000"},
		{name: "image_project_id", artifact: gceArtifact{name: "berth-node-gcp-1", project: "berth-build", imageProject: "berth-images"},
			want: link + "berth-images/global/images/berth-node-gcp-1"},
		{name: "the returned link wins", artifact: gceArtifact{name: "berth-1", project: "berth-build", imageProject: "berth-build",
			selfLink: link + "berth-other/global/images/berth-1"},
			want: link + "berth-other/global/images/berth-1"},
		{name: "domain-scoped project", artifact: gceArtifact{name: "berth-1", project: "example.com:berth-build", imageProject: "example.com:berth-build"},
			want: link + "example.com:berth-build/global/images/berth-1"},
		{name: "no metadata: project from the description", artifact: gceArtifact{name: "berth-1", project: "berth-build", imageProject: "berth-images", selfLink: "-"},
			want: link + "berth-images/global/images/berth-1"},
		{name: "no metadata, older description: project from the state", artifact: gceArtifact{name: "berth-1", project: "berth-build",
			describe: "A disk image was created: berth-1", selfLink: "-"},
			want: link + "berth-build/global/images/berth-1"},
		{name: "older description, metadata", artifact: gceArtifact{name: "berth-1", imageProject: "berth-build", describe: "A disk image was created: berth-1"},
			want: link + "berth-build/global/images/berth-1"},
		{name: "no metadata, no project", artifact: gceArtifact{name: "berth-1", describe: "A disk image was created: berth-1", selfLink: "-"},
			err: "names neither its image's self-link nor its project"},
		{name: "link of another image", artifact: gceArtifact{name: "berth-1", imageProject: "berth-build", selfLink: link + "berth-build/global/images/berth-2"},
			err: `is image "berth-1", but its self-link is`},
		{name: "link elsewhere", artifact: gceArtifact{name: "berth-1", imageProject: "berth-build", selfLink: "https://compute.example/v1/projects/berth-build/global/images/berth-1"},
			err: `is image "berth-1", but its self-link is`},
		{name: "link of a zonal thing", artifact: gceArtifact{name: "berth-1", imageProject: "berth-build", selfLink: link + "berth-build/zones/europe-west1-b/disks/berth-1"},
			err: `is image "berth-1", but its self-link is`},
		{name: "link without a project id", artifact: gceArtifact{name: "berth-1", imageProject: "B", selfLink: link + "B/global/images/berth-1"},
			err: "names no Compute Engine project id"},
		{name: "not an image name", artifact: gceArtifact{name: "Berth_1", project: "berth-build", imageProject: "berth-build"},
			err: `id "Berth_1" is not a Compute Engine image name`},
		{name: "no id", artifact: gceArtifact{project: "berth-build", imageProject: "berth-build"},
			err: "is not a Compute Engine image name"},
		{name: "another image described", artifact: gceArtifact{name: "berth-1", project: "p-berth", describe: "A disk image was created in the 'p-berth' project: berth-2", selfLink: "-"},
			err: `is image "berth-1" but says it made "berth-2"`},
		{name: "not a project id", artifact: gceArtifact{name: "berth-1", project: "berth-build", imageProject: "x/../../y", selfLink: "-"},
			err: `project "x/../../y" is not a Compute Engine project id`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, via := range []struct {
				name string
				wrap func(packersdk.Artifact) packersdk.Artifact
			}{
				{"in process", func(a packersdk.Artifact) packersdk.Artifact { return a }},
				// The builder's plugin serves its artifact to Packer, which serves it to the post-processor's.
				{"over Packer's RPC", func(a packersdk.Artifact) packersdk.Artifact { return overRPC(t, overRPC(t, a)) }},
			} {
				got, err := gceSelfLink(via.wrap(tc.artifact))
				if tc.err != "" {
					if err == nil || !strings.Contains(err.Error(), tc.err) || !strings.Contains(err.Error(), "set artifact_id") {
						t.Errorf("%s: gceSelfLink = %q, %v; want an error containing %q that names artifact_id", via.name, got, err, tc.err)
					}
					continue
				}
				if err != nil || got != tc.want {
					t.Errorf("%s: gceSelfLink = %q, %v; want %q", via.name, got, err, tc.want)
				}
			}
		})
	}
}

// overRPC serves a over Packer's plugin RPC, as Packer hands a builder's artifact to a post-processor in
// another process, and returns the post-processor's side of it.
func overRPC(t *testing.T, a packersdk.Artifact) packersdk.Artifact {
	t.Helper()
	serverConn, clientConn := net.Pipe()
	server, err := packerrpc.NewServer(serverConn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { server.Close() })
	if err := server.RegisterArtifact(a); err != nil {
		t.Fatal(err)
	}
	go server.Serve()
	client, err := packerrpc.NewClient(clientConn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	return client.Artifact()
}

// TestPostProcessGCE writes a googlecompute image's entry, its artifact coming over Packer's RPC as it does
// from the builder's plugin through Packer to this one: one entry, named image_name, whose artifact_id is the
// image's self-link in the image's project, with no region (images are global).
func TestPostProcessGCE(t *testing.T) {
	for _, tc := range []struct {
		name             string
		artifact         gceArtifact
		config           map[string]any
		wantID, wantZone string
	}{
		{name: "self-link", artifact: gceArtifact{name: "berth-node-gcp-20261125120000", project: "berth-build", imageProject: "berth-images"},
			wantID: "https://www.googleapis.com/compute/v1/projects/berth-images/global/images/berth-node-gcp-20261125120000"},
		// Only the registry metadata names the project: it crossed both RPC hops.
		{name: "self-link from the metadata alone", artifact: gceArtifact{name: "berth-node-gcp-2", imageProject: "berth-images",
			describe: "A disk image was created: berth-node-gcp-2"},
			wantID: "https://www.googleapis.com/compute/v1/projects/berth-images/global/images/berth-node-gcp-2"},
		{name: "artifact_id set", artifact: gceArtifact{name: "berth-node-gcp-1", project: "berth-build", imageProject: "berth-build"},
			config: map[string]any{"artifact_id": "projects/berth-build/global/images/berth-node-gcp-1", "region": "global"},
			wantID: "projects/berth-build/global/images/berth-node-gcp-1", wantZone: "global"},
		// With artifact_id set, nothing is asked of the artifact but its id: a name that is none is no error.
		{name: "artifact_id set, odd artifact", artifact: gceArtifact{name: "Odd_Name"},
			config: map[string]any{"artifact_id": "projects/p-berth/global/images/berth-2"},
			wantID: "projects/p-berth/global/images/berth-2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			out := filepath.Join(dir, "berth-image.json")
			p := &PostProcessor{predict: func(string) (map[int][]byte, error) {
				return map[int][]byte{4: make([]byte, 32), 11: make([]byte, 32)}, nil
			}}
			raw := map[string]any{"image_name": "berth-node-gcp", "output": out, "uki": filepath.Join(dir, "berth.efi"),
				"packer_builder_type": "googlecompute"}
			for k, v := range tc.config {
				raw[k] = v
			}
			if err := p.Configure(raw); err != nil {
				t.Fatal(err)
			}
			art, keep, _, err := p.PostProcess(context.Background(), packersdk.TestUi(t), overRPC(t, overRPC(t, tc.artifact)))
			if err != nil {
				t.Fatal(err)
			}
			if !keep || art.Id() != "berth-node-gcp" {
				t.Errorf("PostProcess = %v (id %s), keep %v", art, art.Id(), keep)
			}
			data, err := os.ReadFile(out)
			if err != nil {
				t.Fatal(err)
			}
			m, err := imagemanifest.Parse(data)
			if err != nil {
				t.Fatal(err)
			}
			if got := m.Names(); len(got) != 1 || got[0] != "berth-node-gcp" {
				t.Fatalf("manifest images %v, want berth-node-gcp alone", got)
			}
			img, _ := m.Image("berth-node-gcp")
			if img.ArtifactID != tc.wantID || img.Region != tc.wantZone || img.Builder != "googlecompute" {
				t.Errorf("entry %+v, want artifact_id %s, region %q, builder googlecompute", img, tc.wantID, tc.wantZone)
			}
		})
	}
}

// TestPostProcessGCEFails: an artifact whose image cannot be linked fails the build, naming artifact_id, and
// leaves the manifest unwritten.
func TestPostProcessGCEFails(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "berth-image.json")
	p := &PostProcessor{predict: func(string) (map[int][]byte, error) { return map[int][]byte{4: make([]byte, 32)}, nil }}
	if err := p.Configure(map[string]any{"image_name": "berth-node-gcp", "output": out, "uki": filepath.Join(dir, "berth.efi")}); err != nil {
		t.Fatal(err)
	}
	_, _, _, err := p.PostProcess(context.Background(), packersdk.TestUi(t),
		overRPC(t, gceArtifact{name: "berth-1", describe: "A disk image was created: berth-1", selfLink: "-"}))
	if err == nil || !strings.Contains(err.Error(), "set artifact_id") {
		t.Fatalf("PostProcess of an artifact without project: %v", err)
	}
	if _, err := os.Stat(out); !os.IsNotExist(err) {
		t.Errorf("the manifest was written: %v", err)
	}
}

// TestRegistrySelfLink reads the label self_link from the registry metadata as the builder's process has it
// and as Packer's RPC delivers it.
func TestRegistrySelfLink(t *testing.T) {
	const link = "https://www.googleapis.com/compute/v1/projects/p-berth/global/images/berth-1"
	for i, tc := range []struct {
		state any
		want  string
	}{
		{&registryimage.Image{Labels: map[string]string{"self_link": link}}, link},
		{map[any]any{"Labels": map[any]any{"self_link": link}}, link},
		{map[any]any{"Labels": map[any]any{"self_link": []byte(link)}}, link},
		{map[string]any{"Labels": map[string]any{"self_link": link}}, link},
		{(*registryimage.Image)(nil), ""},
		{&registryimage.Image{}, ""},
		{map[any]any{"Labels": map[any]any{"self_link": ""}}, ""},
		{map[any]any{"Labels": map[any]any{"self_link": 7}}, ""},
		{map[any]any{"Labels": "self_link"}, ""},
		{map[any]any{"ImageID": "berth-1"}, ""},
		{"berth-1", ""},
		{nil, ""},
	} {
		if got, ok := registrySelfLink(tc.state); got != tc.want || ok != (tc.want != "") {
			t.Errorf("%d: registrySelfLink(%#v) = %q, %v; want %q", i, tc.state, got, ok, tc.want)
		}
	}
}

// TestOtherBuildersKeepTheirID: only googlecompute's id becomes a self-link; another builder's id that looks
// like an image name stays as it is.
func TestOtherBuildersKeepTheirID(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "berth-image.json")
	p := &PostProcessor{predict: func(string) (map[int][]byte, error) { return map[int][]byte{4: make([]byte, 32)}, nil }}
	if err := p.Configure(map[string]any{"image_name": "berth-1", "output": out, "uki": filepath.Join(dir, "berth.efi"),
		"packer_builder_type": "file"}); err != nil {
		t.Fatal(err)
	}
	if _, _, _, err := p.PostProcess(context.Background(), packersdk.TestUi(t), overRPC(t, otherArtifact("berth-image-1"))); err != nil {
		t.Fatal(err)
	}
	data, _ := os.ReadFile(out)
	m, err := imagemanifest.Parse(data)
	if err != nil {
		t.Fatal(err)
	}
	if img, _ := m.Image("berth-1"); img.ArtifactID != "berth-image-1" {
		t.Errorf("artifact_id %q, want the builder's id berth-image-1", img.ArtifactID)
	}
}

type otherArtifact string

func (a otherArtifact) BuilderId() string { return "packer.file" }
func (a otherArtifact) Files() []string   { return nil }
func (a otherArtifact) Id() string        { return string(a) }
func (a otherArtifact) String() string {
	return "A disk image was created in the 'berth-build' project: " + string(a)
}
func (a otherArtifact) State(string) any { return "berth-build" }
func (a otherArtifact) Destroy() error   { return nil }
