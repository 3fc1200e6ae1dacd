package manifest

import (
	"errors"
	"fmt"
	"regexp"

	packersdk "github.com/hashicorp/packer-plugin-sdk/packer"
	registryimage "github.com/hashicorp/packer-plugin-sdk/packer/registry/image"
)

// googleComputeBuilderID is the builder id of packer-plugin-googlecompute's googlecompute builder
// (builder/googlecompute.BuilderId in v1.1.6).
const googleComputeBuilderID = "packer.googlecompute"

// gceImageLinkPrefix starts the self-link of every Compute Engine image.
const gceImageLinkPrefix = "https://www.googleapis.com/compute/v1/projects/"

var (
	// gceImageName is Compute Engine's rule for an image's name (RFC 1035, at most 63 characters).
	gceImageName = regexp.MustCompile(`^[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?$`)
	// gceProject is a project id: 6 to 30 lowercase letters, digits and '-', from a letter to no '-';
	// older projects may be scoped by a domain ("example.com:my-project").
	gceProject = regexp.MustCompile(`^(?:[a-z0-9](?:[-a-z0-9.]{0,61}[a-z0-9])?:)?[a-z][-a-z0-9]{4,28}[a-z0-9]$`)
	// gceImageLink is an image's self-link: its project and name.
	gceImageLink = regexp.MustCompile(`^` + regexp.QuoteMeta(gceImageLinkPrefix) + `([^/]+)/global/images/([^/]+)$`)
	// gceArtifactString is what googlecompute v1.1.6's artifact says of itself: the image's project
	// (image_project_id, which defaults to project_id) and its name.
	gceArtifactString = regexp.MustCompile(`^A disk image was created in the '([^']*)' project: (.*)$`)
)

// gceSelfLink is the self-link of the image a googlecompute artifact names,
// https://www.googleapis.com/compute/v1/projects/<project>/global/images/<name>: images are global, so the
// link names one image whatever the zone of the build.
//
// The artifact reaches a post-processor over Packer's RPC (msgpack), where only Id, String and State work,
// and State's structs arrive as maps. The link is the one Compute Engine returned for the new image, which
// the artifact's registry metadata (State "par.artifact.metadata") carries as the label self_link. Where
// that is missing, it is made from the image's name, Id(), and the project String() names (the image's
// project, image_project_id), or else State("ProjectId"), the build's project_id. Either way it must be
// the link of an image called Id() in a well-formed project.
func gceSelfLink(a packersdk.Artifact) (string, error) {
	name := a.Id()
	if !gceImageName.MatchString(name) {
		return "", fmt.Errorf("the googlecompute artifact's id %q is not a Compute Engine image name: set artifact_id to the image's self-link", name)
	}
	if link, ok := registrySelfLink(a.State(registryimage.ArtifactStateURI)); ok {
		m := gceImageLink.FindStringSubmatch(link)
		switch {
		case m == nil || m[2] != name:
			return "", fmt.Errorf("the googlecompute artifact is image %q, but its self-link is %q: set artifact_id to the image's self-link", name, link)
		case !gceProject.MatchString(m[1]):
			return "", fmt.Errorf("the googlecompute artifact's self-link %q names no Compute Engine project id: set artifact_id to the image's self-link", link)
		}
		return link, nil
	}
	var project string
	if m := gceArtifactString.FindStringSubmatch(a.String()); m != nil {
		if m[2] != name {
			return "", fmt.Errorf("the googlecompute artifact is image %q but says it made %q: set artifact_id to the image's self-link", name, m[2])
		}
		project = m[1]
	} else if p, ok := a.State("ProjectId").(string); ok {
		project = p
	}
	switch {
	case project == "":
		return "", errors.New("the googlecompute artifact names neither its image's self-link nor its project: set artifact_id to the image's self-link")
	case !gceProject.MatchString(project):
		return "", fmt.Errorf("the googlecompute artifact's project %q is not a Compute Engine project id: set artifact_id to the image's self-link", project)
	}
	return gceImageLinkPrefix + project + "/global/images/" + name, nil
}

// registrySelfLink is the self_link label of an artifact's registry metadata: a *registryimage.Image in
// the builder's process, a map of its fields after Packer's RPC.
func registrySelfLink(state any) (string, bool) {
	var labels any
	switch s := state.(type) {
	case *registryimage.Image:
		if s == nil {
			return "", false
		}
		labels = s.Labels
	case map[any]any:
		labels = s["Labels"]
	case map[string]any:
		labels = s["Labels"]
	default:
		return "", false
	}
	var link any
	switch l := labels.(type) {
	case map[string]string:
		link = l["self_link"]
	case map[any]any:
		link = l["self_link"]
	case map[string]any:
		link = l["self_link"]
	}
	switch v := link.(type) {
	case string:
		return v, v != ""
	case []byte:
		return string(v), len(v) > 0
	}
	return "", false
}
