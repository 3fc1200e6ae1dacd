package ebsnvme

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"unsafe"
)

// page is Identify Controller data as an EBS volume's controller returns it: fields padded with spaces, the
// device name at the start of the vendor-specific area.
func page(serial, model, device string) []byte {
	p := make([]byte, PageSize)
	pad := func(at, n int, s string) {
		copy(p[at:at+n], []byte(s+strings.Repeat(" ", n-len(s))))
	}
	pad(serialStart, serialEnd-serialStart, serial)
	pad(modelStart, modelEnd-modelStart, model)
	pad(vendorStart, deviceNameLen, device)
	return p
}

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		name    string
		page    []byte
		want    Identity
		wantErr string
	}{
		{name: "mapping name", page: page("vol0123456789abcdef0", Model, "sdb"), want: Identity{VolumeID: "vol-0123456789abcdef0", DeviceName: "sdb"}},
		{name: "with /dev/", page: page("vol0123456789abcdef0", Model, "/dev/xvdf"), want: Identity{VolumeID: "vol-0123456789abcdef0", DeviceName: "xvdf"}},
		{name: "root volume", page: page("vol0aaaaaaaaaaaaaaaa", Model, "/dev/xvda"), want: Identity{VolumeID: "vol-0aaaaaaaaaaaaaaaa", DeviceName: "xvda"}},
		{name: "instance store", page: page("AWS1234", "Amazon EC2 NVMe Instance Storage", ""), wantErr: `not an EBS volume: the controller's model is "Amazon EC2 NVMe Instance Storage"`},
		{name: "QEMU's controller", page: page("deadbeef", "QEMU NVMe Ctrl", ""), wantErr: "not an EBS volume"},
		{name: "no device name", page: page("vol0123456789abcdef0", Model, ""), wantErr: "EBS volume vol-0123456789abcdef0 reports no device name"},
		{name: "device name with a slash", page: page("vol0123456789abcdef0", Model, "../sda"), wantErr: "names no device"},
		{name: "short", page: make([]byte, 100), wantErr: "identify data is 100 bytes, want 4096"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Parse(tc.page)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("Parse = %+v, %v; want an error saying %q", got, err, tc.wantErr)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("Parse = %+v, %v; want %+v", got, err, tc.want)
			}
		})
	}
}

// TestPassthruLayout: the ioctl's argument is the kernel's 72-byte struct, so the request number is
// NVME_IOCTL_ADMIN_CMD as linux/nvme_ioctl.h defines it.
func TestPassthruLayout(t *testing.T) {
	if size := unsafe.Sizeof(passthru{}); size != 72 {
		t.Errorf("passthru is %d bytes, want 72", size)
	}
	if nvmeIoctlAdminCmd != 0xC0484E41 {
		t.Errorf("NVME_IOCTL_ADMIN_CMD = %#x, want 0xc0484e41", nvmeIoctlAdminCmd)
	}
}

// TestIdentifyRefusesOtherFiles: a file that is no NVMe device is named as such, not misread.
func TestIdentifyRefusesOtherFiles(t *testing.T) {
	f := filepath.Join(t.TempDir(), "disk.img")
	if err := os.WriteFile(f, make([]byte, 4096), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Identify(f); err == nil || !strings.Contains(err.Error(), "is not an NVMe device") {
		t.Errorf("Identify of a file = %v", err)
	}
	if _, err := Identify(filepath.Join(t.TempDir(), "absent")); err == nil {
		t.Error("Identify of a missing device succeeded")
	}
}
