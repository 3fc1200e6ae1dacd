package uki

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
)

// fatEpoch is 1980-01-01T00:00:00Z, the earliest time FAT can store, as Unix seconds.
const fatEpoch = "315532800"

// espType is the GPT partition type of an EFI system partition.
const espType = "C12A7328-F81F-11D2-BA4B-00A0C93EC93B"

// minDiskSize is the smallest disk that holds a UKI of ukiSize bytes: the GPT before the partition (1 MiB,
// where the partition starts), the backup GPT after it, and the FAT's own tables (a tenth is generous),
// rounded up to whole MiB.
func minDiskSize(ukiSize int64) int64 {
	return roundMiB(ukiSize + ukiSize/10 + 4*oneMiB)
}

// rootType is the GPT partition type of a Linux x86-64 root, which the verified root's partition gets.
const rootType = "4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709"

const oneMiB = 1 << 20

// imageESPSize is the EFI system partition's size beside a verified root: room for a UKI with a Debian
// initrd, as berth-uki-install makes it, unless the UKI needs more.
const imageESPSize = 64 * oneMiB

// layout is where makeDisk puts what: the disk's size, and with a verified root, the EFI system
// partition's size and the root's partition.
type layout struct {
	size    int64
	espSize int64 // 0: the ESP takes the whole disk
	root    *rootPartition
}

// newLayout lays out a disk of size bytes (0: the default) for a UKI of ukiSize bytes and, if not nil,
// the verified root. Without one, the ESP takes the whole disk, by default DefaultDiskSize unless the UKI
// needs more; with one, the ESP has imageESPSize unless the UKI needs more, the root's partition follows in
// whole MiB, and the default disk is just large enough for both and the GPT's two copies.
func newLayout(ukiSize int64, root *rootPartition, size int64) (layout, error) {
	l := layout{size: size, root: root}
	least, what := minDiskSize(ukiSize), "the UKI of "+mib(ukiSize)
	if root == nil {
		if l.size == 0 {
			l.size = max(DefaultDiskSize, least)
		}
	} else {
		fi, err := os.Stat(root.image)
		if err != nil {
			return layout{}, err
		}
		l.espSize = max(imageESPSize, least)
		least, what = oneMiB+l.espSize+roundMiB(fi.Size())+oneMiB, what+" and the verified root of "+mib(fi.Size())
		l.size = cmp.Or(l.size, least)
	}
	if l.size < least {
		return layout{}, fmt.Errorf("disk_size %s is too small for %s: give at least %s", mib(l.size), what, mib(least))
	}
	if l.size%512 != 0 {
		return layout{}, fmt.Errorf("disk_size %d is not a whole number of 512-byte sectors", l.size)
	}
	return l, nil
}

func roundMiB(n int64) int64 { return (n + oneMiB - 1) / oneMiB * oneMiB }

// makeDisk writes a raw disk image at path as l (from newLayout) lays it out: a GPT with an EFI system partition from 1 MiB,
// a FAT file system on it with the UKI at EFI/BOOT/BOOTX64.EFI, the path UEFI firmware boots from a disk
// without boot entries, and with a verified root, its partition after the ESP with the root's image copied
// into it. Everything runs on plain files, with no loop device and no root.
func makeDisk(ctx context.Context, path, uki string, l layout) error {
	if err := os.WriteFile(path, nil, 0o644); err != nil {
		return err
	}
	if err := os.Truncate(path, l.size); err != nil {
		return err
	}
	diskID, partID, err := diskGUIDs(uki)
	if err != nil {
		return err
	}
	table := fmt.Sprintf("label: gpt\nlabel-id: %s\n", diskID)
	types := []string{espType}
	if l.root == nil {
		table += fmt.Sprintf("start=2048, type=%s, uuid=%s, name=\"EFI system partition\"\n", espType, partID)
	} else {
		fi, err := os.Stat(l.root.image)
		if err != nil {
			return err
		}
		table += fmt.Sprintf("start=2048, size=%d, type=%s, uuid=%s, name=\"EFI system partition\"\n", l.espSize/512, espType, partID)
		table += fmt.Sprintf("start=%d, size=%d, type=%s, uuid=%s, name=berth-root\n",
			2048+l.espSize/512, roundMiB(fi.Size())/512, rootType, l.root.uuid)
		types = append(types, rootType)
	}
	if _, err := run(ctx, strings.NewReader(table), "sfdisk", "--quiet", path); err != nil {
		return fmt.Errorf("writing the partition table: %w", err)
	}
	parts, err := partitions(ctx, path, types...)
	if err != nil {
		return err
	}

	// The file system is made in a file of its own and copied into place: mkfs.vfat and mtools then need
	// no offsets, and a failure leaves nothing half-written in the disk.
	esp := path + ".esp"
	defer os.Remove(esp)
	if _, err := run(ctx, nil, "mkfs.vfat", "-C", "-n", "BERTH-ESP", "-h", strconv.FormatInt(parts[0].start, 10),
		"--invariant", esp, strconv.FormatInt(parts[0].sectors/2, 10)); err != nil {
		return fmt.Errorf("making the FAT file system: %w", err)
	}
	if _, err := run(ctx, nil, "mmd", "-i", esp, "::/EFI", "::/EFI/BOOT"); err != nil {
		return fmt.Errorf("making EFI/BOOT: %w", err)
	}
	if _, err := run(ctx, nil, "mcopy", "-i", esp, uki, "::/EFI/BOOT/BOOTX64.EFI"); err != nil {
		return fmt.Errorf("copying the UKI to EFI/BOOT/BOOTX64.EFI: %w", err)
	}
	if err := copyAt(esp, path, parts[0].start*512); err != nil {
		return fmt.Errorf("copying the EFI system partition into the disk: %w", err)
	}
	if l.root != nil {
		if err := copyAt(l.root.image, path, parts[1].start*512); err != nil {
			return fmt.Errorf("copying the verified root into the disk: %w", err)
		}
	}
	return nil
}

// diskGUIDs are the disk's and the partition's GUIDs, derived from the UKI rather than drawn at random, so that
// the same UKI always gives the same disk, byte for byte.
func diskGUIDs(uki string) (disk, part string, err error) {
	f, err := os.Open(uki)
	if err != nil {
		return "", "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", "", fmt.Errorf("hashing the UKI: %w", err)
	}
	sum := h.Sum(nil)
	return guid(sum[:16]), guid(sum[16:]), nil
}

// guid formats 16 bytes as an RFC 4122 UUID of version 4 and the RFC variant, the form GPT tools expect.
func guid(b []byte) string {
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%X-%X-%X-%X-%X", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// extent is a partition's first sector and length in sectors.
type extent struct{ start, sectors int64 }

// partitions reads back from the table sfdisk wrote, which aligns ends as it sees fit, where each partition
// lies; the table must have exactly the partitions of the types given, in that order.
func partitions(ctx context.Context, path string, types ...string) ([]extent, error) {
	out, err := run(ctx, nil, "sfdisk", "--json", path)
	if err != nil {
		return nil, fmt.Errorf("reading the partition table: %w", err)
	}
	var table struct {
		PartitionTable struct {
			SectorSize int64 `json:"sectorsize"`
			Partitions []struct {
				Start int64  `json:"start"`
				Size  int64  `json:"size"`
				Type  string `json:"type"`
			} `json:"partitions"`
		} `json:"partitiontable"`
	}
	if err := json.Unmarshal(out, &table); err != nil {
		return nil, fmt.Errorf("reading sfdisk's table: %w", err)
	}
	pt := table.PartitionTable
	if len(pt.Partitions) != len(types) || (pt.SectorSize != 0 && pt.SectorSize != 512) {
		return nil, fmt.Errorf("sfdisk wrote an unexpected table: %s", out)
	}
	var extents []extent
	for i, p := range pt.Partitions {
		if p.Type != types[i] {
			return nil, fmt.Errorf("sfdisk wrote an unexpected table: %s", out)
		}
		extents = append(extents, extent{p.Start, p.Size})
	}
	return extents, nil
}

func copyAt(src, dst string, offset int64) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	if _, err := io.Copy(io.NewOffsetWriter(out, offset), in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// run runs a tool and returns its standard output; an error carries what it wrote to standard error.
func run(ctx context.Context, stdin io.Reader, name string, args ...string) ([]byte, error) {
	path, err := lookTool(name)
	if err != nil {
		return nil, err
	}
	cmd := exec.CommandContext(ctx, path, args...)
	cmd.Stdin = stdin
	// mtools refuses images whose geometry it finds odd unless told not to check. It stamps files and
	// directories with SOURCE_DATE_EPOCH when set (else the time of the build): the start of FAT time keeps
	// the file system the same from build to build.
	cmd.Env = append(os.Environ(), "MTOOLS_SKIP_CHECK=1")
	if os.Getenv("SOURCE_DATE_EPOCH") == "" {
		cmd.Env = append(cmd.Env, "SOURCE_DATE_EPOCH="+fatEpoch)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return out, nil
}
