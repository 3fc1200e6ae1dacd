package lab

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"slices"
	"strconv"
	"testing"

	gattest "github.com/google/go-attestation/attest"

	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/manifest"
	"github.com/berthlabs/berth/internal/repotest"
	"github.com/berthlabs/berth/test/swtpm/swtpmtest"
)

// TestMeasureImageMatchesPrediction measures an image into a real swtpm as a lab node's firmware does and
// checks that every quoted PCR then holds what the manifest predicts for that image, and not the other's.
func TestMeasureImageMatchesPrediction(t *testing.T) {
	tpm := swtpmtest.NewCA(t).NewTPM(t)
	if err := measureImage(tpm.Socket, "berthlab-b"); err != nil {
		t.Fatal(err)
	}
	got := readPCRs(t, tpm.Device())
	want, other := PredictedPCRs("berthlab-b"), PredictedPCRs("berthlab-a")
	for _, i := range QuotedPCRs {
		if !bytes.Equal(got[i], want[i]) {
			t.Errorf("PCR %d is %x, the prediction for berthlab-b is %x", i, got[i], want[i])
		}
	}
	if bytes.Equal(want[imagePCR], other[imagePCR]) || bytes.Equal(want[imagePCR], make([]byte, 32)) {
		t.Errorf("PCR %d does not tell the images apart: %x", imagePCR, want[imagePCR])
	}
}

func readPCRs(t *testing.T, device string) map[int][]byte {
	t.Helper()
	tpm, err := attest.OpenTPM(device)
	if err != nil {
		t.Fatal(err)
	}
	defer tpm.Close()
	pcrs, err := tpm.PCRs(gattest.HashSHA256)
	if err != nil {
		t.Fatal(err)
	}
	out := map[int][]byte{}
	for _, p := range pcrs {
		out[p.Index] = p.Digest
	}
	return out
}

// TestImageManifest checks that the lab's berth-image.json is one Terraform's berth_image accepts, with
// both images and their predicted PCRs, and in a lab with upgrades' binaries an image of each upgrade's release.
func TestImageManifest(t *testing.T) {
	data, err := json.Marshal(imageManifest(repotest.KubernetesVersion, nil))
	if err != nil {
		t.Fatal(err)
	}
	m, err := manifest.Parse(data)
	if err != nil {
		t.Fatalf("the lab's manifest does not parse: %v\n%s", err, data)
	}
	checkManifest(t, m, repotest.KubernetesVersion)

	upgrades := []string{"v1.99.0", "v1.99.1"}
	if data, err = json.Marshal(imageManifest(repotest.KubernetesVersion, upgrades)); err != nil {
		t.Fatal(err)
	}
	if m, err = manifest.Parse(data); err != nil {
		t.Fatalf("the manifest of a lab with upgrades does not parse: %v\n%s", err, data)
	}
	for i, release := range upgrades {
		name := UpgradeImage(i)
		img, ok := m.Image(name)
		if !ok || img.Components["kubernetes"] != release || img.PCRs["11"] != hex.EncodeToString(PredictedPCRs(name)[11]) {
			t.Errorf("image %s: %+v (found %t), want release %s and its predicted PCR 11", name, img, ok, release)
		}
	}
	if img, _ := m.Image(ImageNames[0]); img.Components["kubernetes"] != repotest.KubernetesVersion {
		t.Errorf("image %s carries %s beside upgrades, want the lab's %s", ImageNames[0], img.Components["kubernetes"], repotest.KubernetesVersion)
	}
}

// checkManifest checks a parsed manifest against ImageNames and PredictedPCRs, its images carrying
// Kubernetes release.
func checkManifest(t *testing.T, m *manifest.Manifest, release string) {
	t.Helper()
	if !slices.Equal(m.Names(), ImageNames) {
		t.Fatalf("manifest images %v, want %v", m.Names(), ImageNames)
	}
	for _, name := range ImageNames {
		img, _ := m.Image(name)
		if img.ArtifactID != name || img.Builder != "lab" || img.Region != "local" || img.Components["kubernetes"] != release {
			t.Errorf("image %s: %+v", name, img)
		}
		want := PredictedPCRs(name)
		if len(img.PCRs) != len(want) {
			t.Errorf("image %s has PCRs %v, want %d of them", name, img.PCRs, len(want))
		}
		for i, v := range want {
			if img.PCRs[strconv.Itoa(i)] != hex.EncodeToString(v) {
				t.Errorf("image %s PCR %d: manifest %s, predicted %x", name, i, img.PCRs[strconv.Itoa(i)], v)
			}
		}
	}
}
