package manifest

import (
	"fmt"
	"maps"
	"slices"
	"strings"

	imagemanifest "github.com/berthlabs/berth/internal/manifest"
)

// BuilderID identifies the post-processor's artifacts.
const BuilderID = "berthlabs.manifest"

// Artifact is an image's entries in berth-image.json: one, or one per region for AMIs in several.
type Artifact struct {
	path   string
	images []imagemanifest.Image
}

func (a *Artifact) BuilderId() string { return BuilderID }

func (a *Artifact) Files() []string { return []string{a.path} }

// Id is the image's name, as join policies admit it: image_name, the first entry's.
func (a *Artifact) Id() string { return a.images[0].Name }

func (a *Artifact) String() string {
	names := make([]string, len(a.images))
	for i, img := range a.images {
		names[i] = img.Name
	}
	what := "image"
	if len(names) > 1 {
		what = "images"
	}
	return fmt.Sprintf("%s %s in %s, with the predicted PCR %s", what, strings.Join(names, ", "), a.path,
		strings.Join(slices.SortedFunc(maps.Keys(a.images[0].PCRs), byIndex), ", "))
}

func (a *Artifact) State(string) any { return nil }

// Destroy leaves the manifest alone: it holds other images' entries too.
func (a *Artifact) Destroy() error { return nil }
