package ukiinstall

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hashicorp/hcl/v2"
	"github.com/hashicorp/hcl/v2/hclsyntax"
	"github.com/zclconf/go-cty/cty"

	"github.com/berthlabs/berth/internal/repotest"
)

// TestAWSTemplateImagesTheVerifiedRoot reads examples/packer/aws.pkr.hcl as HCL and checks what packer
// validate cannot, since only EC2 could show it: the AMI's root device is the volume berth-uki-install
// writes the verified root to (its /dev/disk/by-ebs-name link is the mapping's name), and every other volume
// of the build instance stays out of the AMI, so that the build's own writable, unmeasured root never
// reaches a node, not even as a second disk.
func TestAWSTemplateImagesTheVerifiedRoot(t *testing.T) {
	path, src, top := parseTemplate(t, "aws.pkr.hcl")

	source := onlyBlock(t, top, "source", "amazon-ebssurrogate", "node")
	rootSource := literal(t, onlyBlock(t, source.Body, "ami_root_device").Body, "source_device_name")
	var rootMapped bool
	for _, m := range source.Body.Blocks {
		if m.Type != "launch_block_device_mappings" {
			continue
		}
		name := literal(t, m.Body, "device_name")
		if name == rootSource {
			rootMapped = true
			continue
		}
		if _, ok := m.Body.Attributes["omit_from_artifact"]; !ok || literal(t, m.Body, "omit_from_artifact") != "true" {
			t.Errorf("launch volume %s is not omit_from_artifact: its snapshot would be part of every node", name)
		}
	}
	if !rootMapped {
		t.Errorf("ami_root_device's source %s is not a launch volume", rootSource)
	}

	device := templateRootDevice(t, top)
	if want := "/dev/disk/by-ebs-name/" + strings.TrimPrefix(rootSource, "/dev/"); device != want {
		t.Errorf("verified_root.device %s, want %s: the link of the volume the AMI is registered from", device, want)
	}
	rules, err := os.ReadFile(filepath.Join(filepath.Dir(path), "aws", "90-berth-ebs.rules"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(rules), `SYMLINK+="disk/by-ebs-name/%c"`) {
		t.Error("90-berth-ebs.rules no longer makes the /dev/disk/by-ebs-name links")
	}
	if !strings.Contains(string(src), `destination = "/etc/udev/rules.d/90-berth-ebs.rules"`) {
		t.Error("aws.pkr.hcl no longer installs 90-berth-ebs.rules, which makes verified_root.device")
	}
}

// TestGCPTemplateImagesTheVerifiedRoot reads examples/packer/gcp.pkr.hcl as HCL and checks that the image
// is made from the disk berth-uki-install writes the verified root to, found by the link Google's guest
// environment makes from its device name, and not from the boot disk the build ran on.
func TestGCPTemplateImagesTheVerifiedRoot(t *testing.T) {
	_, _, top := parseTemplate(t, "gcp.pkr.hcl")
	source := onlyBlock(t, top, "source", "googlecompute", "node")
	var imaged []string
	for _, d := range source.Body.Blocks {
		if d.Type != "disk_attachment" {
			continue
		}
		if _, ok := d.Body.Attributes["create_image"]; ok && literal(t, d.Body, "create_image") == "true" {
			imaged = append(imaged, literal(t, d.Body, "device_name"))
		}
	}
	if len(imaged) != 1 {
		t.Fatalf("disks with create_image: %v, want one: without it, the image is the build's own boot disk", imaged)
	}
	if device, want := templateRootDevice(t, top), "/dev/disk/by-id/google-"+imaged[0]; device != want {
		t.Errorf("verified_root.device %s, want %s: the link of the disk the image is made from", device, want)
	}
}

// parseTemplate reads and parses examples/packer/<name>.
func parseTemplate(t *testing.T, name string) (path string, src []byte, top *hclsyntax.Body) {
	t.Helper()
	path = filepath.Join(repotest.Root(t), "examples", "packer", name)
	src, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	file, diags := hclsyntax.ParseConfig(src, name, hcl.InitialPos)
	if diags.HasErrors() {
		t.Fatal(diags)
	}
	return path, src, file.Body.(*hclsyntax.Body)
}

// templateRootDevice is the device of berth-uki-install's verified_root in the template's build.
func templateRootDevice(t *testing.T, top *hclsyntax.Body) string {
	t.Helper()
	build := onlyBlock(t, top, "build")
	uki := onlyBlock(t, build.Body, "provisioner", "berth-uki-install")
	return literal(t, onlyBlock(t, uki.Body, "verified_root").Body, "device")
}

// onlyBlock is body's one block of that type and labels.
func onlyBlock(t *testing.T, body *hclsyntax.Body, typ string, labels ...string) *hclsyntax.Block {
	t.Helper()
	var found []*hclsyntax.Block
	for _, b := range body.Blocks {
		if b.Type == typ && strings.Join(b.Labels, " ") == strings.Join(labels, " ") {
			found = append(found, b)
		}
	}
	if len(found) != 1 {
		t.Fatalf("%d blocks %s %v, want 1", len(found), typ, labels)
	}
	return found[0]
}

// literal is the value of body's attribute, which must be a constant.
func literal(t *testing.T, body *hclsyntax.Body, name string) string {
	t.Helper()
	attr, ok := body.Attributes[name]
	if !ok {
		t.Fatalf("no attribute %s", name)
	}
	v, diags := attr.Expr.Value(nil)
	if diags.HasErrors() {
		t.Fatalf("%s is not a constant: %v", name, diags)
	}
	switch v.Type() {
	case cty.String:
		return v.AsString()
	case cty.Bool:
		if v.True() {
			return "true"
		}
		return "false"
	}
	t.Fatalf("%s is a %s", name, v.Type().FriendlyName())
	return ""
}
