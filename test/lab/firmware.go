package lab

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net"
	"slices"
	"strconv"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"

	"github.com/berthlabs/berth/internal/manifest"
)

// ImageNames are the lab's "images": nodes of different images differ only in what the lab's firmware
// measures into imagePCR, which is enough for join policies to tell them apart.
var ImageNames = []string{"berthlab-a", "berthlab-b"}

// UpgradeImage is the i-th upgrade's image of a lab given HostConfig.UpgradeKubeBins: its machines run
// those binaries, and carry the images of the release before too, as an image that cannot pull must
// (docs/kubernetes-upgrades.md).
func UpgradeImage(i int) string { return fmt.Sprintf("berthlab-up%d", i+1) }

// imageNames are the images the lab's machines may boot: ImageNames, and an upgrade's image for each of
// HostConfig.UpgradeKubeBins.
func (l *Lab) imageNames() []string {
	names := slices.Clone(ImageNames)
	for i := range l.cfg.UpgradeKubeBins {
		names = append(names, UpgradeImage(i))
	}
	return names
}

// release is what a machine of image runs: the Kubernetes binaries, the images of their release, and
// those of the release before, which it carries for the cluster it joins or rejoins before its upgrade.
func (l *Lab) release(image string) (kubeBin string, own, carried imageSet) {
	for i, bin := range l.cfg.UpgradeKubeBins {
		if image == UpgradeImage(i) {
			carried = l.images
			if i > 0 {
				carried = l.upgradeImages[i-1]
			}
			return bin, l.upgradeImages[i], carried
		}
	}
	return l.cfg.KubeBin, l.images, l.images
}

// imagePCR is the PCR the lab's firmware extends with the image's measurement; on real machines PCR 11
// holds the unified kernel image, which is what a Berth image changes.
const imagePCR = 11

// imageMeasurement is what the lab's firmware extends imagePCR with for image.
func imageMeasurement(image string) [sha256.Size]byte {
	return sha256.Sum256([]byte("berthlab image " + image))
}

// PredictedPCRs are the values a lab node of image quotes in QuotedPCRs: all zero on a fresh swtpm, except
// imagePCR, extended once with the image's measurement.
func PredictedPCRs(image string) map[int][]byte {
	pcrs := make(map[int][]byte, len(QuotedPCRs))
	for _, i := range QuotedPCRs {
		pcrs[i] = make([]byte, sha256.Size)
	}
	m := imageMeasurement(image)
	extended := sha256.Sum256(append(make([]byte, sha256.Size), m[:]...))
	pcrs[imagePCR] = extended[:]
	return pcrs
}

// imageManifest is berth-image.json for the lab's images of Kubernetes release, and an upgrade's image of
// each of upgrades, as the Packer plugin writes it for real ones.
func imageManifest(release string, upgrades []string) *manifest.Manifest {
	m := &manifest.Manifest{Version: manifest.Version}
	releases := map[string]string{}
	names := slices.Clone(ImageNames)
	for _, name := range names {
		releases[name] = release
	}
	for i, r := range upgrades {
		names = append(names, UpgradeImage(i))
		releases[UpgradeImage(i)] = r
	}
	for _, name := range names {
		release := releases[name]
		pcrs := map[string]string{}
		for i, v := range PredictedPCRs(name) {
			pcrs[strconv.Itoa(i)] = hex.EncodeToString(v)
		}
		m.Images = append(m.Images, manifest.Image{Name: name, Builder: "lab", ArtifactID: name, Region: "local",
			PCRs: pcrs, Components: map[string]string{"kubernetes": release}})
	}
	return m
}

// measureImage is the lab's firmware: it extends imagePCR with the image's measurement through the swtpm
// socket before anything of the node runs. swtpm runs with startup-clear, so the TPM is started already
// (a TPM2_Startup here would fail), and its PCRs are fresh on every power-on. The socket serves one
// connection at a time: this one is closed before the agent opens its own.
func measureImage(sock, image string) error {
	conn, err := net.Dial("unix", sock)
	if err != nil {
		return fmt.Errorf("measuring the image into PCR %d: %w", imagePCR, err)
	}
	defer conn.Close()
	m := imageMeasurement(image)
	_, err = tpm2.PCRExtend{
		PCRHandle: tpm2.AuthHandle{Handle: tpm2.TPMHandle(imagePCR), Auth: tpm2.PasswordAuth(nil)},
		Digests:   tpm2.TPMLDigestValues{Digests: []tpm2.TPMTHA{{HashAlg: tpm2.TPMAlgSHA256, Digest: m[:]}}},
	}.Execute(transport.FromReadWriter(conn))
	if err != nil {
		return fmt.Errorf("measuring the image into PCR %d: %w", imagePCR, err)
	}
	return nil
}
