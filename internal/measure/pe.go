package measure

import (
	"bytes"
	"cmp"
	"crypto/sha256"
	"debug/pe"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"io"
	"slices"
)

// Sizes of the optional header up to and including NumberOfRvaAndSizes, and of one section header.
const (
	optionalHeader32Fixed = 96
	optionalHeader64Fixed = 112
	sectionHeaderSize     = 40
	// Both optional header layouts keep CheckSum at the same offset.
	checksumOffset = 64
	// The PE specification's data directory has at most 16 entries; EDK2 refuses images that claim more.
	maxDataDirectories = 16
)

// peImage is what the measurements need from a PE/COFF image's headers. The headers are read here rather
// than with pe.NewFile: NewFile also reads the COFF symbol table and every section's relocations, and
// allocates them from header counts before reading, so a crafted file of a few megabytes can make it ask
// for tens of gigabytes. Only the header bytes read here are ever allocated.
type peImage struct {
	size int64
	// optionalHeader is the file offset of the optional header; fixedSize the size of its part before the
	// data directories (96 for PE32, 112 for PE32+).
	optionalHeader int64
	fixedSize      int64
	sizeOfHeaders  uint32
	numDirs        uint32
	certDir        pe.DataDirectory
	sections       []pe.SectionHeader32
}

// readPE parses the headers of the PE/COFF image in r[0:size].
func readPE(r io.ReaderAt, size int64) (*peImage, error) {
	var dos [64]byte
	if err := readFull(r, dos[:], 0, size); err != nil {
		return nil, fmt.Errorf("reading the DOS header: %w", err)
	}
	if dos[0] != 'M' || dos[1] != 'Z' {
		return nil, errors.New("not a PE image: no MZ signature")
	}
	peOff := int64(binary.LittleEndian.Uint32(dos[0x3c:]))
	var hdr [4 + 20]byte
	if err := readFull(r, hdr[:], peOff, size); err != nil {
		return nil, fmt.Errorf("reading the PE header at %#x: %w", peOff, err)
	}
	if !bytes.Equal(hdr[:4], []byte("PE\x00\x00")) {
		return nil, fmt.Errorf("not a PE image: no PE signature at %#x", peOff)
	}
	var fh pe.FileHeader
	if _, err := binary.Decode(hdr[4:], binary.LittleEndian, &fh); err != nil {
		return nil, fmt.Errorf("decoding the COFF file header: %w", err)
	}
	img := &peImage{size: size, optionalHeader: peOff + int64(len(hdr))}

	if fh.SizeOfOptionalHeader < 2 {
		return nil, fmt.Errorf("optional header of %d bytes: an executable image has one", fh.SizeOfOptionalHeader)
	}
	// Zero-filled up to the largest layout, so both decode whole; the directory count says what is real.
	opt := make([]byte, max(int(fh.SizeOfOptionalHeader), binary.Size(pe.OptionalHeader64{})))
	if err := readFull(r, opt[:fh.SizeOfOptionalHeader], img.optionalHeader, size); err != nil {
		return nil, fmt.Errorf("reading the optional header: %w", err)
	}
	var dirs []pe.DataDirectory
	switch magic := binary.LittleEndian.Uint16(opt); magic {
	case 0x10b:
		var oh pe.OptionalHeader32
		if _, err := binary.Decode(opt, binary.LittleEndian, &oh); err != nil {
			return nil, fmt.Errorf("decoding the PE32 optional header: %w", err)
		}
		img.fixedSize, img.sizeOfHeaders, img.numDirs, dirs = optionalHeader32Fixed, oh.SizeOfHeaders, oh.NumberOfRvaAndSizes, oh.DataDirectory[:]
	case 0x20b:
		var oh pe.OptionalHeader64
		if _, err := binary.Decode(opt, binary.LittleEndian, &oh); err != nil {
			return nil, fmt.Errorf("decoding the PE32+ optional header: %w", err)
		}
		img.fixedSize, img.sizeOfHeaders, img.numDirs, dirs = optionalHeader64Fixed, oh.SizeOfHeaders, oh.NumberOfRvaAndSizes, oh.DataDirectory[:]
	default:
		return nil, fmt.Errorf("optional header magic %#x is neither PE32 (0x10b) nor PE32+ (0x20b)", magic)
	}
	if img.numDirs > maxDataDirectories {
		return nil, fmt.Errorf("%d data directories, more than the %d a PE image can have", img.numDirs, maxDataDirectories)
	}
	if want := img.fixedSize + 8*int64(img.numDirs); int64(fh.SizeOfOptionalHeader) != want {
		return nil, fmt.Errorf("optional header is %d bytes, but %d data directories make it %d", fh.SizeOfOptionalHeader, img.numDirs, want)
	}
	if img.numDirs > pe.IMAGE_DIRECTORY_ENTRY_SECURITY {
		img.certDir = dirs[pe.IMAGE_DIRECTORY_ENTRY_SECURITY]
	}

	tableOff := img.optionalHeader + int64(fh.SizeOfOptionalHeader)
	tableEnd := tableOff + sectionHeaderSize*int64(fh.NumberOfSections)
	// The firmware's loader takes the section table from the headers it maps, so it must lie within them.
	if tableEnd > int64(img.sizeOfHeaders) {
		return nil, fmt.Errorf("section table ends at %#x, beyond SizeOfHeaders %#x", tableEnd, img.sizeOfHeaders)
	}
	if int64(img.sizeOfHeaders) > size {
		return nil, fmt.Errorf("SizeOfHeaders %#x is beyond the end of the %d-byte image", img.sizeOfHeaders, size)
	}
	table := make([]byte, tableEnd-tableOff)
	if err := readFull(r, table, tableOff, size); err != nil {
		return nil, fmt.Errorf("reading the section table: %w", err)
	}
	img.sections = make([]pe.SectionHeader32, fh.NumberOfSections)
	if _, err := binary.Decode(table, binary.LittleEndian, img.sections); err != nil {
		return nil, fmt.Errorf("decoding the section table: %w", err)
	}
	return img, nil
}

// authenticode returns the Authenticode (PE/COFF image) SHA-256 of the image in r[0:size], computed the way
// EDK2 measures an image it loads (SecurityPkg's Tcg2Dxe, MeasureBootPeCoff.c, after the PE/COFF
// specification's appendix): the headers without the checksum and the certificate table's directory entry,
// the sections' raw data in file order, then the bytes after the last hashed byte up to the end of the
// image less the certificate table's size. Like EDK2, the trailing data starts where the hashed bytes add
// up to (SizeOfHeaders plus every SizeOfRawData), not at the last section's end; both agree for images
// whose sections follow one another, as linkers and objcopy write them.
func authenticode(r io.ReaderAt, size int64) (Digest, error) {
	img, err := readPE(r, size)
	if err != nil {
		return Digest{}, err
	}
	return img.authenticode(r)
}

func (img *peImage) authenticode(r io.ReaderAt) (Digest, error) {
	h := sha256.New()
	checksum := img.optionalHeader + checksumOffset
	headerEnd := int64(img.sizeOfHeaders)
	regions := [][2]int64{{0, checksum}}
	if img.numDirs <= pe.IMAGE_DIRECTORY_ENTRY_SECURITY {
		regions = append(regions, [2]int64{checksum + 4, headerEnd})
	} else {
		certEntry := img.optionalHeader + img.fixedSize + 8*pe.IMAGE_DIRECTORY_ENTRY_SECURITY
		regions = append(regions, [2]int64{checksum + 4, certEntry}, [2]int64{certEntry + 8, headerEnd})
	}
	for _, reg := range regions {
		if reg[1] < reg[0] {
			return Digest{}, fmt.Errorf("SizeOfHeaders %#x ends inside the optional header", img.sizeOfHeaders)
		}
		if err := hashRange(h, r, reg[0], reg[1]-reg[0], img.size); err != nil {
			return Digest{}, fmt.Errorf("hashing the headers: %w", err)
		}
	}

	sections := slices.Clone(img.sections)
	slices.SortStableFunc(sections, func(a, b pe.SectionHeader32) int {
		return cmp.Compare(a.PointerToRawData, b.PointerToRawData)
	})
	hashed := headerEnd
	for _, s := range sections {
		if s.SizeOfRawData == 0 {
			continue
		}
		if err := hashRange(h, r, int64(s.PointerToRawData), int64(s.SizeOfRawData), img.size); err != nil {
			return Digest{}, fmt.Errorf("hashing section %s: %w", sectionName(s), err)
		}
		hashed += int64(s.SizeOfRawData)
	}
	if img.size > hashed {
		certSize := int64(img.certDir.Size)
		switch {
		case img.size > hashed+certSize:
			if err := hashRange(h, r, hashed, img.size-certSize-hashed, img.size); err != nil {
				return Digest{}, fmt.Errorf("hashing the data after the sections: %w", err)
			}
		case img.size < hashed+certSize:
			return Digest{}, fmt.Errorf("certificate table of %d bytes does not fit after the %d hashed bytes of a %d-byte image", certSize, hashed, img.size)
		}
	}
	var d Digest
	h.Sum(d[:0])
	return d, nil
}

// sectionName is a section's 8-byte name as text, for messages.
func sectionName(s pe.SectionHeader32) string {
	return fmt.Sprintf("%q", bytes.TrimRight(s.Name[:], "\x00"))
}

// readFull reads len(p) bytes at off, refusing ranges outside r[0:size].
func readFull(r io.ReaderAt, p []byte, off, size int64) error {
	if off < 0 || off > size || int64(len(p)) > size-off {
		return fmt.Errorf("%d bytes at %#x are beyond the end of the %d-byte image", len(p), off, size)
	}
	_, err := r.ReadAt(p, off)
	if errors.Is(err, io.EOF) {
		err = io.ErrUnexpectedEOF
	}
	return err
}

// copyBufferSize bounds what one hashing job holds in memory.
const copyBufferSize = 1 << 20

// hashRange writes r[off:off+n] to h, refusing ranges outside r[0:size].
func hashRange(h hash.Hash, r io.ReaderAt, off, n, size int64) error {
	if off < 0 || n < 0 || off > size || n > size-off {
		return fmt.Errorf("%d bytes at %#x are beyond the end of the %d-byte image", n, off, size)
	}
	if n == 0 {
		return nil
	}
	buf := make([]byte, min(n, copyBufferSize))
	got, err := io.CopyBuffer(h, io.NewSectionReader(r, off, n), buf)
	if err != nil {
		return err
	}
	if got != n {
		return fmt.Errorf("read %d of %d bytes at %#x: %w", got, n, off, io.ErrUnexpectedEOF)
	}
	return nil
}
