package uki

import (
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
	const oneMiB = 1 << 20
	n := ukiSize + ukiSize/10 + 4*oneMiB
	return (n + oneMiB - 1) / oneMiB * oneMiB
}

// makeDisk writes a raw disk image of size bytes at path: a GPT with one EFI system partition from 1 MiB to
// the end, a FAT file system on it, and the UKI at EFI/BOOT/BOOTX64.EFI, the path UEFI firmware boots from
// a disk without boot entries. Everything runs on plain files, with no loop device and no root.
func makeDisk(ctx context.Context, path, uki string, size int64) error {
	fi, err := os.Stat(uki)
	if err != nil {
		return err
	}
	if size < minDiskSize(fi.Size()) {
		return fmt.Errorf("disk_size %s is too small for the UKI of %s: give at least %s", mib(size), mib(fi.Size()), mib(minDiskSize(fi.Size())))
	}
	if size%512 != 0 {
		return fmt.Errorf("disk_size %d is not a whole number of 512-byte sectors", size)
	}
	if err := os.WriteFile(path, nil, 0o644); err != nil {
		return err
	}
	if err := os.Truncate(path, size); err != nil {
		return err
	}
	diskID, partID, err := diskGUIDs(uki)
	if err != nil {
		return err
	}
	table := fmt.Sprintf("label: gpt\nlabel-id: %s\nstart=2048, type=%s, uuid=%s, name=\"EFI system partition\"\n",
		diskID, espType, partID)
	if _, err := run(ctx, strings.NewReader(table), "sfdisk", "--quiet", path); err != nil {
		return fmt.Errorf("writing the partition table: %w", err)
	}
	start, sectors, err := espExtent(ctx, path)
	if err != nil {
		return err
	}

	// The file system is made in a file of its own and copied into place: mkfs.vfat and mtools then need
	// no offsets, and a failure leaves nothing half-written in the disk.
	esp := path + ".esp"
	defer os.Remove(esp)
	if _, err := run(ctx, nil, "mkfs.vfat", "-C", "-n", "BERTH-ESP", "-h", strconv.FormatInt(start, 10),
		"--invariant", esp, strconv.FormatInt(sectors/2, 10)); err != nil {
		return fmt.Errorf("making the FAT file system: %w", err)
	}
	if _, err := run(ctx, nil, "mmd", "-i", esp, "::/EFI", "::/EFI/BOOT"); err != nil {
		return fmt.Errorf("making EFI/BOOT: %w", err)
	}
	if _, err := run(ctx, nil, "mcopy", "-i", esp, uki, "::/EFI/BOOT/BOOTX64.EFI"); err != nil {
		return fmt.Errorf("copying the UKI to EFI/BOOT/BOOTX64.EFI: %w", err)
	}
	return copyAt(esp, path, start*512)
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

// espExtent reads the partition's first sector and length back from the table sfdisk wrote, which aligns
// the end as it sees fit.
func espExtent(ctx context.Context, path string) (start, sectors int64, err error) {
	out, err := run(ctx, nil, "sfdisk", "--json", path)
	if err != nil {
		return 0, 0, fmt.Errorf("reading the partition table: %w", err)
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
		return 0, 0, fmt.Errorf("reading sfdisk's table: %w", err)
	}
	pt := table.PartitionTable
	if len(pt.Partitions) != 1 || pt.Partitions[0].Type != espType || (pt.SectorSize != 0 && pt.SectorSize != 512) {
		return 0, 0, fmt.Errorf("sfdisk wrote an unexpected table: %s", out)
	}
	return pt.Partitions[0].Start, pt.Partitions[0].Size, nil
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
		return fmt.Errorf("copying the EFI system partition into the disk: %w", err)
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
