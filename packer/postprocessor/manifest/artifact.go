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

// Artifact is an image's entry in berth-image.json.
type Artifact struct {
	path  string
	image imagemanifest.Image
}

func (a *Artifact) BuilderId() string { return BuilderID }

func (a *Artifact) Files() []string { return []string{a.path} }

// Id is the image's name, as join policies admit it.
func (a *Artifact) Id() string { return a.image.Name }

func (a *Artifact) String() string {
	return fmt.Sprintf("image %s in %s, with the predicted PCR %s", a.image.Name, a.path, strings.Join(slices.SortedFunc(maps.Keys(a.image.PCRs), byIndex), ", "))
}

func (a *Artifact) State(string) any { return nil }

// Destroy leaves the manifest alone: it holds other images' entries too.
func (a *Artifact) Destroy() error { return nil }
