//go:generate packer-sdc mapstructure-to-hcl2 -type Config

// Package manifest is the post-processor berth-manifest: it predicts the TPM measurements the built image's
// boot will produce, from its unified kernel image, and records them with the builder's artifact id in
// berth-image.json, the manifest Terraform's data.berth_image reads to admit the image in a join policy.
package manifest

import (
	"cmp"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/hcl/v2/hcldec"
	"github.com/hashicorp/packer-plugin-sdk/common"
	packersdk "github.com/hashicorp/packer-plugin-sdk/packer"
	"github.com/hashicorp/packer-plugin-sdk/template/config"
	"github.com/hashicorp/packer-plugin-sdk/template/interpolate"

	imagemanifest "github.com/berthlabs/berth/internal/manifest"
)

// DefaultOutput is where the manifest goes unless output says otherwise.
const DefaultOutput = "berth-image.json"

// Config is the post-processor's configuration.
type Config struct {
	common.PackerConfig `mapstructure:",squash"`

	// Name of the image in the manifest, and so in join policies: lowercase letters, digits, '-' and '.',
	// such as `berth-2026-11-22`.
	ImageName string `mapstructure:"image_name" required:"true"`
	// The manifest to write. An existing manifest is updated: an image of the same name is replaced, the
	// others are kept. Defaults to `berth-image.json`.
	Output string `mapstructure:"output"`
	// The unified kernel image (UKI) the image boots, whose measurements are predicted. Defaults to the
	// one artifact file whose name ends in `.efi`.
	UKI string `mapstructure:"uki"`
	// What the image is launched by: defaults to the builder's artifact id; an Amazon builder's
	// (`region:ami-id`, one per region) becomes one entry per region with that region's AMI id, and
	// googlecompute's (the image's name) the image's self-link. Set it where the builder's id says little,
	// such as the disk image's path for qemu.
	ArtifactID string `mapstructure:"artifact_id"`
	// Region of the artifact. For an Amazon builder's AMIs in several regions, the region whose entry is
	// called image_name (the others are called `<image_name>-<region>`); taken from the artifact when it
	// has one region. Empty otherwise.
	Region string `mapstructure:"region"`
	// Versions of the components baked in, such as `{ kubernetes = "v1.36.3" }`.
	Components map[string]string `mapstructure:"components"`

	ctx interpolate.Context
}

// PostProcessor is berth-manifest.
type PostProcessor struct {
	config Config
	// predict returns the PCR values a boot of the UKI at path produces.
	predict func(path string) (map[int][]byte, error)
}

func (p *PostProcessor) ConfigSpec() hcldec.ObjectSpec { return p.config.FlatMapstructure().HCL2Spec() }

func (p *PostProcessor) Configure(raws ...any) error {
	err := config.Decode(&p.config, &config.DecodeOpts{
		PluginType:         "berth-manifest",
		Interpolate:        true,
		InterpolateContext: &p.config.ctx,
	}, raws...)
	if err != nil {
		return err
	}
	if p.config.Output == "" {
		p.config.Output = DefaultOutput
	}
	if p.predict == nil {
		p.predict = predictUKI
	}
	var errs []error
	if p.config.ImageName == "" {
		errs = append(errs, errors.New("image_name is required: the name join policies admit the image by, such as berth-2026-11-22"))
	} else if err := imagemanifest.ValidateName(p.config.ImageName); err != nil {
		errs = append(errs, fmt.Errorf("image_name: %w", err))
	}
	return errors.Join(errs...)
}

func (p *PostProcessor) PostProcess(ctx context.Context, ui packersdk.Ui, artifact packersdk.Artifact) (packersdk.Artifact, bool, bool, error) {
	uki, err := p.findUKI(artifact)
	if err != nil {
		return nil, false, false, err
	}
	ui.Say(fmt.Sprintf("Predicting the TPM measurements of %s", uki))
	start := time.Now()
	pcrs, err := p.predict(uki)
	if err != nil {
		return nil, false, false, fmt.Errorf("predicting the measurements of %s: %w", uki, err)
	}
	base := imagemanifest.Image{
		Name:       p.config.ImageName,
		Builder:    p.config.PackerBuilderType,
		PCRs:       make(map[string]string, len(pcrs)),
		Components: p.config.Components,
	}
	for _, i := range slices.Sorted(maps.Keys(pcrs)) {
		base.PCRs[strconv.Itoa(i)] = hex.EncodeToString(pcrs[i])
		ui.Message(fmt.Sprintf("PCR %2d = %x", i, pcrs[i]))
	}
	ui.Message(fmt.Sprintf("predicted in %.2fs", time.Since(start).Seconds()))
	id := artifact.Id()
	if p.config.ArtifactID == "" && artifact.BuilderId() == googleComputeBuilderID {
		if id, err = gceSelfLink(artifact); err != nil {
			return nil, false, false, err
		}
	}
	images, err := p.entries(id, base)
	if err != nil {
		return nil, false, false, err
	}
	for _, img := range images {
		if err := img.Validate(); err != nil {
			return nil, false, false, fmt.Errorf("the image's manifest entry %s: %w", img.Name, err)
		}
	}
	if err := update(p.config.Output, images...); err != nil {
		return nil, false, false, err
	}
	for _, img := range images {
		where := img.ArtifactID
		if img.Region != "" {
			where += " in " + img.Region
		}
		ui.Say(fmt.Sprintf("Wrote image %s (%s) to %s", img.Name, where, p.config.Output))
	}
	// The build's artifact stays what it is; this one is its entries in the manifest.
	return &Artifact{path: p.config.Output, images: images}, true, false, nil
}

// byIndex orders PCR indexes ("4", "11") as numbers.
func byIndex(a, b string) int {
	x, _ := strconv.Atoi(a)
	y, _ := strconv.Atoi(b)
	return cmp.Compare(x, y)
}

// findUKI is the configured UKI, or the artifact's one .efi file.
func (p *PostProcessor) findUKI(artifact packersdk.Artifact) (string, error) {
	if p.config.UKI != "" {
		return p.config.UKI, nil
	}
	var efi []string
	for _, f := range artifact.Files() {
		if strings.HasSuffix(f, ".efi") {
			efi = append(efi, f)
		}
	}
	switch len(efi) {
	case 1:
		return efi[0], nil
	case 0:
		return "", fmt.Errorf("the artifact of %s has no .efi file (files: %v): set uki to the image's unified kernel image",
			p.config.PackerBuilderType, artifact.Files())
	default:
		return "", fmt.Errorf("the artifact has several .efi files (%v): set uki to the one the image boots", efi)
	}
}

// update writes images into the manifest at path, each replacing an image of the same name, atomically.
func update(path string, images ...imagemanifest.Image) error {
	m := &imagemanifest.Manifest{Version: imagemanifest.Version}
	data, err := os.ReadFile(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return fmt.Errorf("reading the manifest: %w", err)
	default:
		if m, err = imagemanifest.Parse(data); err != nil {
			return fmt.Errorf("the manifest %s exists but is not valid, so it is left as it is: %w", path, err)
		}
	}
	for _, img := range images {
		if i := slices.IndexFunc(m.Images, func(x imagemanifest.Image) bool { return x.Name == img.Name }); i >= 0 {
			m.Images[i] = img
		} else {
			m.Images = append(m.Images, img)
		}
	}
	if err := m.Validate(); err != nil {
		return fmt.Errorf("the updated manifest: %w", err)
	}
	out, err := m.Marshal()
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".berth-image-*.json")
	if err != nil {
		return fmt.Errorf("writing the manifest: %w", err)
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(out); err != nil {
		tmp.Close()
		return fmt.Errorf("writing the manifest: %w", err)
	}
	if err := tmp.Chmod(0o644); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("writing the manifest: %w", err)
	}
	return os.Rename(tmp.Name(), path)
}
