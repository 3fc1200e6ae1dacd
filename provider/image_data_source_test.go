package provider

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
)

var (
	pcr4  = strings.Repeat("4a", 32)
	pcr11 = strings.Repeat("b1", 32)
)

func writeManifest(t *testing.T) string {
	t.Helper()
	doc := fmt.Sprintf(`{
  "version": 1,
  "images": [
    {"name": "berth-2026-11-22", "builder": "qemu", "artifact_id": "output/berth.qcow2", "region": "",
     "pcrs": {"4": %q, "11": %q}, "components": {"kubernetes": "v1.36.3", "berth-agent": "v0.1.0"}},
    {"name": "berth-2026-11-22-aws", "builder": "amazon-ebs", "artifact_id": "ami-0123456789abcdef0",
     "region": "eu-central-1", "pcrs": {"4": %q}}
  ]
}`, pcr4, pcr11, pcr11)
	name := filepath.Join(t.TempDir(), "berth-image.json")
	if err := os.WriteFile(name, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	return name
}

func TestImageDataSource(t *testing.T) {
	t.Parallel()
	name := writeManifest(t)
	resource.UnitTest(t, resource.TestCase{
		ProtoV6ProviderFactories: providers,
		Steps: []resource.TestStep{
			{
				Config: fmt.Sprintf(`
data "berth_image" "all" {
  path = %q
}

data "berth_image" "qemu" {
  path = %q
  name = "berth-2026-11-22"
}`, name, name),
				Check: resource.ComposeTestCheckFunc(
					resource.TestCheckResourceAttr("data.berth_image.all", "images.#", "2"),
					resource.TestCheckResourceAttr("data.berth_image.all", "images.0.name", "berth-2026-11-22"),
					resource.TestCheckResourceAttr("data.berth_image.all", "images.0.builder", "qemu"),
					resource.TestCheckResourceAttr("data.berth_image.all", "images.0.pcrs.%", "2"),
					resource.TestCheckResourceAttr("data.berth_image.all", "images.0.pcrs.11", pcr11),
					resource.TestCheckResourceAttr("data.berth_image.all", "images.0.components.kubernetes", "v1.36.3"),
					resource.TestCheckResourceAttr("data.berth_image.all", "images.1.artifact_id", "ami-0123456789abcdef0"),
					resource.TestCheckResourceAttr("data.berth_image.all", "images.1.region", "eu-central-1"),
					resource.TestCheckResourceAttr("data.berth_image.all", "images.1.components.%", "0"),
					resource.TestCheckNoResourceAttr("data.berth_image.all", "pcrs.%"),
					resource.TestCheckNoResourceAttr("data.berth_image.all", "components.%"),
					resource.TestCheckResourceAttr("data.berth_image.qemu", "components.kubernetes", "v1.36.3"),
					resource.TestCheckResourceAttr("data.berth_image.qemu", "pcrs.%", "2"),
					resource.TestCheckResourceAttr("data.berth_image.qemu", "pcrs.4", pcr4),
					resource.TestCheckResourceAttr("data.berth_image.qemu", "pcrs.11", pcr11),
				),
			},
			{
				Config: fmt.Sprintf(`
data "berth_image" "x" {
  path = %q
  name = "berth-1999-01-01"
}`, name),
				ExpectError: phrase(`has no image named "berth-1999-01-01"; it lists: berth-2026-11-22, berth-2026-11-22-aws`),
			},
			{
				Config:      fmt.Sprintf(`data "berth_image" "x" { path = %q }`, filepath.Join(filepath.Dir(name), "missing.json")),
				ExpectError: phrase("Cannot read the image manifest"),
			},
		},
	})
}

func TestReadManifestRefusesHugeFile(t *testing.T) {
	t.Parallel()
	name := filepath.Join(t.TempDir(), "huge.json")
	if err := os.WriteFile(name, make([]byte, 2<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := readManifest(name); err == nil || !strings.Contains(err.Error(), "more than the limit") {
		t.Fatalf("readManifest of a 2 MiB file: %v", err)
	}
}
