package measure

import (
	"bytes"
	"cmp"
	"debug/pe"
	"errors"
	"fmt"
	"io"
	"slices"
)

// unifiedSections are the UKI sections systemd-stub 252 knows, in the order it measures them into PCR 11:
// enum UnifiedSection in src/fundamental/tpm-pcr.h and its names in src/fundamental/tpm-pcr.c, the same
// from v252 to v252.31 (the strings in Debian's 252.39 stub appear in this order too). .uname only arrives
// in v253, so a .uname section is neither measured nor known here.
var unifiedSections = [...]string{".linux", ".osrel", ".cmdline", ".initrd", ".splash", ".dtb", ".pcrsig", ".pcrpkey"}

// Indices into unifiedSections of the sections with a role beyond being measured.
const (
	sectionLinux = iota
	_            // .osrel
	sectionCmdline
	sectionInitrd
	_ // .splash
	_ // .dtb
	sectionPCRSig
	sectionPCRPKey
)

// locateSections finds the unified sections the way stub 252's locate_sections() does: a section header
// matches when its 8-byte name starts with the section's name (so ".linux" also matches ".linuxXY"), a
// later header replaces an earlier match, and a match whose VirtualSize is zero counts as absent. The
// content it measures is VirtualSize bytes of the loaded image from the section's address.
func locateSections(img *peImage) (found [len(unifiedSections)]*pe.SectionHeader32) {
	for i := range img.sections {
		for j, name := range unifiedSections {
			if bytes.HasPrefix(img.sections[i].Name[:], []byte(name)) {
				found[j] = &img.sections[i]
			}
		}
	}
	for j, s := range found {
		if s != nil && s.VirtualSize == 0 {
			found[j] = nil
		}
	}
	return found
}

// checkSections refuses what this prediction does not model, so that every prediction it makes is one the
// boot can match.
func checkSections(img *peImage, found [len(unifiedSections)]*pe.SectionHeader32) error {
	switch {
	case found[sectionLinux] == nil:
		return errors.New("no .linux section: systemd-stub would refuse to boot it")
	case found[sectionCmdline] == nil:
		return errors.New("no .cmdline section: the command line would come from the boot entry, so PCRs 9 and 12 cannot be predicted")
	case found[sectionPCRSig] != nil || found[sectionPCRPKey] != nil:
		return errors.New("a .pcrsig or .pcrpkey section is present: stub 252 appends them to the initrd as cpio archives, which this prediction does not model")
	}
	for j, s := range found {
		if s == nil {
			continue
		}
		// The loader copies min(VirtualSize, SizeOfRawData) bytes from the file and zero-fills the rest of
		// VirtualSize. The measurements read VirtualSize bytes, so without zero-fill they are the file's
		// bytes at PointerToRawData. objcopy and ukify write VirtualSize as the content's size and pad only
		// SizeOfRawData; a section that relies on zero-fill is refused rather than hashed as zeros.
		if s.VirtualSize > s.SizeOfRawData {
			return fmt.Errorf("section %s: VirtualSize %#x exceeds SizeOfRawData %#x", unifiedSections[j], s.VirtualSize, s.SizeOfRawData)
		}
		if int64(s.PointerToRawData)+int64(s.VirtualSize) > img.size {
			return fmt.Errorf("section %s: %d bytes at %#x are beyond the end of the %d-byte UKI", unifiedSections[j], s.VirtualSize, s.PointerToRawData, img.size)
		}
	}
	return checkOverlap(img.sections)
}

// checkOverlap refuses sections that share addresses once loaded: the loaded image would then not hold
// the file's bytes where the stub reads them.
func checkOverlap(sections []pe.SectionHeader32) error {
	type span struct {
		start, end int64
		name       string
	}
	spans := make([]span, 0, len(sections))
	for _, s := range sections {
		// EDK2's loader maps VirtualSize bytes, or SizeOfRawData when VirtualSize is zero.
		n := int64(s.VirtualSize)
		if n == 0 {
			n = int64(s.SizeOfRawData)
		}
		if n > 0 {
			spans = append(spans, span{int64(s.VirtualAddress), int64(s.VirtualAddress) + n, sectionName(s)})
		}
	}
	slices.SortFunc(spans, func(a, b span) int { return cmp.Compare(a.start, b.start) })
	for i := 1; i < len(spans); i++ {
		if spans[i].start < spans[i-1].end {
			return fmt.Errorf("sections %s and %s overlap in memory", spans[i-1].name, spans[i].name)
		}
	}
	return nil
}

// loadOptions returns the LoadOptions stub 252 hands the kernel for an embedded command line, which the
// kernel's EFI stub measures into PCR 9: the section's bytes up to the first NUL, converted to UCS-2
// (xstrn8_to_16), with ASCII control characters turned into spaces and trailing spaces removed
// (mangle_stub_cmdline), as UTF-16LE with a terminating NUL (strsize16). Berth's command lines are ASCII;
// other bytes are refused rather than run through the stub's lenient UTF-8 decoder.
func loadOptions(section []byte) ([]byte, error) {
	if i := bytes.IndexByte(section, 0); i >= 0 {
		section = section[:i]
	}
	line := make([]byte, 0, len(section))
	for i, b := range section {
		switch {
		case b >= 0x80:
			return nil, fmt.Errorf("the command line has the non-ASCII byte %#x at offset %d", b, i)
		case b <= 0x1f:
			line = append(line, ' ')
		default:
			line = append(line, b)
		}
	}
	line = bytes.TrimRight(line, " ")
	if len(line) == 0 {
		return nil, errors.New("the command line is empty once systemd-stub has turned control characters into spaces and trimmed them")
	}
	// An ASCII character is the same code unit in UTF-16LE, followed by a zero byte.
	out := make([]byte, 0, 2*len(line)+2)
	for _, b := range line {
		out = append(out, b, 0)
	}
	return append(out, 0, 0), nil
}

// readSection returns the content of section s that the stub measures.
func readSection(r io.ReaderAt, s *pe.SectionHeader32, size int64) ([]byte, error) {
	buf := make([]byte, s.VirtualSize)
	if err := readFull(r, buf, int64(s.PointerToRawData), size); err != nil {
		return nil, err
	}
	return buf, nil
}
