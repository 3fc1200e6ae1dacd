package uki

import (
	"context"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"regexp"
	"strconv"
	"strings"
	"time"

	packersdk "github.com/hashicorp/packer-plugin-sdk/packer"

	"github.com/berthlabs/berth/packer/internal/chroot"
	"github.com/berthlabs/berth/packer/internal/remote"
	"github.com/berthlabs/berth/packer/internal/verity"
)

// rootPartition is a verified root ready for the disk: image holds the erofs file system followed by its
// hash tree, uuid is the GPT partition's UUID and record the berth.verity= value that names it.
type rootPartition struct {
	image  string
	uuid   string
	record string
}

// What the root needs for verified_root, each with the Debian package that has it: the initrd is rebuilt
// there, with veritysetup in it, for the kernel the root's /vmlinuz names.
var rootNeeds = [][2]string{
	{"usr/sbin/update-initramfs", "initramfs-tools"},
	{"usr/sbin/veritysetup", "cryptsetup-bin"},
	{"vmlinuz", "a kernel package such as linux-image-cloud-amd64"},
	{"initrd.img", "a kernel package such as linux-image-cloud-amd64"},
}

// chrootModules is shell that keeps initramfs-tools' MODULES=dep out of a chroot's initrd: dep picks the
// drivers of the machine it runs on, which in a chroot is the build machine, not the image's. Such a root
// gets MODULES=most, the drivers of any machine, as Debian's own images have.
const chrootModules = `if grep -qs '^MODULES=dep' /etc/initramfs-tools/initramfs.conf /etc/initramfs-tools/conf.d/*; then
	echo "berth-uki: MODULES=dep would pick the build machine's drivers: the image's initrd gets MODULES=most (/etc/initramfs-tools/conf.d/zz-berth-modules)"
	echo MODULES=most >/etc/initramfs-tools/conf.d/zz-berth-modules
fi
`

// verityScript is where the build puts verity.InitrdScript in the root while it runs; /tmp's contents stay
// out of the root's image.
const verityScript = "/tmp/berth-verity.sh"

// prepareVerifiedRoot teaches the root at dir to open itself as a verified root (verity.InitrdScript, in a
// chroot) and returns its kernel and rebuilt initrd, which the UKI embeds.
func prepareVerifiedRoot(ctx context.Context, ui packersdk.Ui, dir string) (kernel, initrd []byte, err error) {
	root, err := os.OpenRoot(dir)
	if err != nil {
		return nil, nil, err
	}
	defer root.Close()
	var missing []string
	for _, n := range rootNeeds {
		if _, err := root.Stat(n[0]); err != nil {
			missing = append(missing, fmt.Sprintf("/%s (%s)", n[0], n[1]))
		}
	}
	if len(missing) > 0 {
		return nil, nil, fmt.Errorf("verified_root: the provisioned root has no %s: install them in root_directory or with a provisioner", strings.Join(missing, ", "))
	}

	start := time.Now()
	ui.Say("Teaching the root's initramfs-tools to open the verified root, and rebuilding its initrd")
	comm := &chroot.Communicator{Root: dir}
	script := "#!/bin/sh\n# Written by the berth-uki builder of packer-plugin-berth.\nset -eu\n" + chrootModules + verity.InitrdScript("/boot/efi")
	if err := comm.Upload(verityScript, strings.NewReader(script), nil); err != nil {
		return nil, nil, fmt.Errorf("preparing the verified root: %w", err)
	}
	err = remote.Run(ctx, ui, comm, "sh "+verityScript)
	if rmErr := root.Remove(strings.TrimPrefix(verityScript, "/")); rmErr != nil && err == nil {
		err = rmErr
	}
	if err != nil {
		return nil, nil, fmt.Errorf("preparing the verified root: %w", err)
	}
	// The links point into /boot; os.Root follows them only inside the root.
	if kernel, err = root.ReadFile("vmlinuz"); err != nil {
		return nil, nil, fmt.Errorf("reading the root's kernel /vmlinuz: %w", err)
	}
	if initrd, err = root.ReadFile("initrd.img"); err != nil {
		return nil, nil, fmt.Errorf("reading the root's initrd /initrd.img: %w", err)
	}
	ui.Say(fmt.Sprintf("Rebuilt the root's initrd (%s) in %.1fs; the UKI boots it with the root's kernel (%s)",
		mib(int64(len(initrd))), time.Since(start).Seconds(), mib(int64(len(kernel)))))
	return kernel, initrd, nil
}

// verityBlockSize is the data block size the verified root's initrd assumes (veritysetup's default).
const verityBlockSize = 4096

// sealRoot writes the root file system at dir to image as erofs (lz4), followed by its dm-verity hash
// tree, with no verity superblock: every parameter goes on the command line. The partition's UUID is
// derived from the root hash, so the same root gives the same disk.
func sealRoot(ctx context.Context, ui packersdk.Ui, dir, image string) (*rootPartition, error) {
	start := time.Now()
	ui.Say("Making the verified root: the provisioned root as erofs (lz4)...")
	// What the build left in /tmp is only the build's.
	if _, err := run(ctx, nil, "mkfs.erofs", "--quiet", "-zlz4", "--exclude-regex=^(tmp|var/tmp)/.", image, dir); err != nil {
		return nil, fmt.Errorf("making the verified root's erofs: %w", err)
	}
	blocks, err := erofsBlocks(image)
	if err != nil {
		return nil, err
	}
	offset := blocks * verityBlockSize
	ui.Say(fmt.Sprintf("Made %s of erofs in %.1fs; hashing it...", mib(offset), time.Since(start).Seconds()))
	start = time.Now()
	out, err := run(ctx, nil, "veritysetup", "format", image, image, "--no-superblock",
		"--data-blocks="+strconv.FormatInt(blocks, 10), "--hash-offset="+strconv.FormatInt(offset, 10))
	if err != nil {
		return nil, fmt.Errorf("making the verified root's hash tree: %w", err)
	}
	rootHash, salt := formatField(out, "Root hash"), formatField(out, "Salt")
	sum, err := hex.DecodeString(rootHash)
	if err != nil || len(sum) != 32 || len(salt) != 64 {
		return nil, fmt.Errorf("veritysetup format gave no sha256 root hash and salt:\n%s", out)
	}
	uuid := guid(sum[:16])
	p := &rootPartition{image: image, uuid: uuid, record: verity.Record(uuid, blocks, offset, rootHash, salt)}
	fi, err := os.Stat(image)
	if err != nil {
		return nil, err
	}
	ui.Say(fmt.Sprintf("Hashed the verified root in %.1fs: %s with its hash tree, root hash %s",
		time.Since(start).Seconds(), mib(fi.Size()), rootHash))
	return p, nil
}

// formatField is the value of "name: value" in veritysetup format's output.
func formatField(out []byte, name string) string {
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + `:\s*([0-9a-f]+)\s*$`).FindSubmatch(out)
	if m == nil {
		return ""
	}
	return string(m[1])
}

// The erofs superblock: at byte 1024 of the file system, its magic, the block size's log2 at 12 and the
// file system's size in blocks at 36.
const (
	erofsSuperblock = 1024
	erofsMagic      = 0xE0F5E1E2
)

// erofsBlocks is the size in 4 KiB blocks of the erofs file system at the start of image, from its
// superblock; a file system of another block size is refused, as the initrd would not open it.
func erofsBlocks(image string) (int64, error) {
	f, err := os.Open(image)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sb := make([]byte, 40)
	if _, err := f.ReadAt(sb, erofsSuperblock); err != nil {
		if errors.Is(err, io.EOF) {
			err = fs.ErrInvalid
		}
		return 0, fmt.Errorf("reading the erofs superblock of %s: %w", image, err)
	}
	if binary.LittleEndian.Uint32(sb[0:]) != erofsMagic {
		return 0, fmt.Errorf("%s has no erofs superblock after mkfs.erofs", image)
	}
	if size := 1 << sb[12]; size != verityBlockSize {
		return 0, fmt.Errorf("mkfs.erofs made %d-byte blocks: the verified root needs %d", size, verityBlockSize)
	}
	blocks := int64(binary.LittleEndian.Uint32(sb[36:]))
	if blocks == 0 {
		return 0, fmt.Errorf("the erofs superblock of %s counts no blocks", image)
	}
	return blocks, nil
}
