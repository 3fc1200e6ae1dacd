// Package ebsnvme names the EBS volumes of a Nitro instance as its block device mapping did. EC2 attaches
// every EBS volume as an NVMe controller, and the kernel names it (nvme1n1) in the order it finds it, which
// may differ from one boot or instance type to the next; the mapping's device name (sdb, or /dev/sdb) is
// in the controller's Identify Controller data, in the vendor-specific area, where Amazon's own tools read
// it. A udev rule that runs `berth-agent ebs-name` gives each volume a stable link by that name.
package ebsnvme

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Model is the model number every EBS volume's NVMe controller reports.
const Model = "Amazon Elastic Block Store"

// PageSize is the size of the Identify Controller data structure.
const PageSize = 4096

// Offsets into the Identify Controller data (NVMe base specification, figure "Identify Controller Data
// Structure"), and of the device name Amazon puts at the start of the vendor-specific area.
const (
	serialStart, serialEnd = 4, 24
	modelStart, modelEnd   = 24, 64
	vendorStart            = 3072
	deviceNameLen          = 32
)

// Identity is what an EBS volume's controller says of itself.
type Identity struct {
	// VolumeID is the volume's id, vol-0123456789abcdef0.
	VolumeID string
	// DeviceName is the block device mapping's name without /dev/: sdb, xvdf.
	DeviceName string
}

// Parse reads an EBS volume's identity from its controller's Identify Controller data.
func Parse(page []byte) (Identity, error) {
	if len(page) < PageSize {
		return Identity{}, fmt.Errorf("identify data is %d bytes, want %d", len(page), PageSize)
	}
	if model := field(page[modelStart:modelEnd]); model != Model {
		return Identity{}, fmt.Errorf("not an EBS volume: the controller's model is %q", model)
	}
	id := Identity{VolumeID: field(page[serialStart:serialEnd])}
	if rest, ok := strings.CutPrefix(id.VolumeID, "vol"); ok && !strings.HasPrefix(rest, "-") {
		id.VolumeID = "vol-" + rest
	}
	id.DeviceName = strings.TrimPrefix(field(page[vendorStart:vendorStart+deviceNameLen]), "/dev/")
	if id.DeviceName == "" {
		return Identity{}, fmt.Errorf("EBS volume %s reports no device name", id.VolumeID)
	}
	if strings.ContainsAny(id.DeviceName, "/ \x00") {
		return Identity{}, fmt.Errorf("EBS volume %s reports the device name %q, which names no device", id.VolumeID, id.DeviceName)
	}
	return id, nil
}

// field is an ASCII field of identify data: padded with spaces, or ended by NULs.
func field(b []byte) string {
	if i := bytes.IndexByte(b, 0); i >= 0 {
		b = b[:i]
	}
	return strings.TrimSpace(string(b))
}

// passthru is the kernel's struct nvme_passthru_cmd (linux/nvme_ioctl.h).
type passthru struct {
	opcode      uint8
	flags       uint8
	rsvd1       uint16
	nsid        uint32
	cdw2        uint32
	cdw3        uint32
	metadata    uint64
	addr        uint64
	metadataLen uint32
	dataLen     uint32
	cdw10       uint32
	cdw11       uint32
	cdw12       uint32
	cdw13       uint32
	cdw14       uint32
	cdw15       uint32
	timeoutMS   uint32
	result      uint32
}

// nvmeIoctlAdminCmd is NVME_IOCTL_ADMIN_CMD, _IOWR('N', 0x41, struct nvme_passthru_cmd).
const nvmeIoctlAdminCmd = 3<<30 | uint(unsafe.Sizeof(passthru{}))<<16 | 'N'<<8 | 0x41

// Identify reads the Identify Controller data of an NVMe device (a namespace such as /dev/nvme1n1, or a
// controller), as root.
func Identify(device string) ([]byte, error) {
	f, err := os.Open(device)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	page := make([]byte, PageSize)
	cmd := passthru{
		opcode:  0x06, // Identify
		addr:    uint64(uintptr(unsafe.Pointer(&page[0]))),
		dataLen: PageSize,
		cdw10:   1, // CNS 1: the controller
	}
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), uintptr(nvmeIoctlAdminCmd), uintptr(unsafe.Pointer(&cmd)))
	runtime.KeepAlive(page)
	if errno != 0 {
		if errors.Is(errno, unix.ENOTTY) || errors.Is(errno, unix.EINVAL) {
			return nil, fmt.Errorf("%s is not an NVMe device: %w", device, errno)
		}
		return nil, fmt.Errorf("identifying the NVMe controller of %s: %w", device, errno)
	}
	if cmd.result != 0 {
		return nil, fmt.Errorf("identifying the NVMe controller of %s: status %#x", device, cmd.result)
	}
	return page, nil
}
