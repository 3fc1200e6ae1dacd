package manifest

import (
	"cmp"
	"fmt"
	"maps"
	"regexp"
	"slices"
	"strings"

	imagemanifest "github.com/berthlabs/berth/internal/manifest"
)

// amazonAMI is one part of an Amazon builder's artifact id (amazon-ebs and its siblings): the region and
// the AMI registered there.
var amazonAMI = regexp.MustCompile(`^([a-z]{2}(?:-[a-z]+)+-[0-9]+):(ami-[0-9a-f]+)$`)

// amazonAMIs splits an Amazon builder's artifact id, "region:ami-id" parts joined by commas (one per
// region the AMI was registered or copied to), into AMI ids by region. ok is false for any other id.
func amazonAMIs(id string) (amis map[string]string, ok bool) {
	amis = map[string]string{}
	for part := range strings.SplitSeq(id, ",") {
		m := amazonAMI.FindStringSubmatch(part)
		if m == nil {
			return nil, false
		}
		if _, dup := amis[m[1]]; dup {
			return nil, false
		}
		amis[m[1]] = m[2]
	}
	return amis, true
}

// entries are the manifest entries of the build: one, unless the artifact is AMIs in several regions.
// An AMI id means nothing outside its region, so each region gets its own entry with the same
// predictions. The manifest names images uniquely, so the entry of the region the region option names
// keeps image_name and the others are called <image_name>-<region>.
func (p *PostProcessor) entries(artifactID string, base imagemanifest.Image) ([]imagemanifest.Image, error) {
	amis, ok := amazonAMIs(artifactID)
	if p.config.ArtifactID != "" || !ok {
		base.ArtifactID = cmp.Or(p.config.ArtifactID, artifactID)
		base.Region = p.config.Region
		return []imagemanifest.Image{base}, nil
	}
	regions := slices.Sorted(maps.Keys(amis))
	home := p.config.Region
	switch {
	case home == "" && len(regions) == 1:
		home = regions[0]
	case home == "":
		return nil, fmt.Errorf("the artifact is AMIs in %d regions (%s): set region to the one whose entry is called %s; the others are called %s-<region>",
			len(regions), strings.Join(regions, ", "), base.Name, base.Name)
	case amis[home] == "":
		return nil, fmt.Errorf("region is %s, but the artifact has AMIs only in %s", home, strings.Join(regions, ", "))
	}
	images := make([]imagemanifest.Image, 0, len(regions))
	for _, r := range append([]string{home}, slices.DeleteFunc(regions, func(r string) bool { return r == home })...) {
		img := base
		img.ArtifactID, img.Region = amis[r], r
		if r != home {
			img.Name = base.Name + "-" + r
		}
		images = append(images, img)
	}
	return images, nil
}
