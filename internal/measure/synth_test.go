package measure

import (
	"bytes"
	"debug/pe"
	"encoding/binary"
)

// synthPE describes a small PE image that tests build byte by byte. Alongside the file, build returns the
// bytes an Authenticode hash covers, assembled from the pieces it wrote rather than by parsing the file, so
// that the parser under test is checked against an account it had no part in.
type synthPE struct {
	pe32     bool
	sections []synthSection
	// reverseTable lists the section headers in the opposite order of their data in the file, so that
	// hashing has to sort them by PointerToRawData.
	reverseTable bool
	// numDirs is NumberOfRvaAndSizes; 0 means 16. With 4 or fewer there is no certificate table entry.
	numDirs uint32
	// trailing is data after the last section, covered by the hash; cert is a certificate table at the
	// end of the file, which is not.
	trailing []byte
	cert     []byte
}

type synthSection struct {
	name string
	data []byte
	// virtualSize overrides len(data) when not zero.
	virtualSize uint32
	// virtualAddress overrides the address build assigns when not zero.
	virtualAddress uint32
}

const (
	synthFileAlign    = 0x200
	synthSectionAlign = 0x1000
)

func (s synthPE) build() (file, hashed []byte) {
	numDirs := s.numDirs
	if numDirs == 0 {
		numDirs = 16
	}
	fixed := optionalHeader64Fixed
	if s.pe32 {
		fixed = optionalHeader32Fixed
	}
	optSize := fixed + 8*int(numDirs)
	headersEnd := 64 + 4 + 20 + optSize + sectionHeaderSize*len(s.sections)
	sizeOfHeaders := alignTo(headersEnd, synthFileAlign)

	// Section data follows the headers in the order given; addresses follow one another.
	type placed struct {
		hdr  pe.SectionHeader32
		data []byte
	}
	var sections []placed
	off, va := sizeOfHeaders, synthSectionAlign
	for _, sec := range s.sections {
		var h pe.SectionHeader32
		copy(h.Name[:], sec.name)
		h.VirtualSize = uint32(len(sec.data))
		if sec.virtualSize != 0 {
			h.VirtualSize = sec.virtualSize
		}
		h.VirtualAddress = uint32(va)
		if sec.virtualAddress != 0 {
			h.VirtualAddress = sec.virtualAddress
		}
		h.SizeOfRawData = uint32(alignTo(len(sec.data), synthFileAlign))
		h.PointerToRawData = uint32(off)
		raw := make([]byte, h.SizeOfRawData)
		copy(raw, sec.data)
		sections = append(sections, placed{h, raw})
		off += len(raw)
		va = alignTo(int(h.VirtualAddress)+max(int(h.VirtualSize), len(raw)), synthSectionAlign)
	}
	certOff := off + len(s.trailing)

	var dirs [16]pe.DataDirectory
	if numDirs > pe.IMAGE_DIRECTORY_ENTRY_SECURITY && len(s.cert) > 0 {
		dirs[pe.IMAGE_DIRECTORY_ENTRY_SECURITY] = pe.DataDirectory{VirtualAddress: uint32(certOff), Size: uint32(len(s.cert))}
	}
	var opt bytes.Buffer
	// The checksum is set to a value nobody computes: the hash must skip it.
	const checksum = 0xdeadbeef
	if s.pe32 {
		must(binary.Write(&opt, binary.LittleEndian, pe.OptionalHeader32{
			Magic: 0x10b, SectionAlignment: synthSectionAlign, FileAlignment: synthFileAlign,
			SizeOfImage: uint32(va), SizeOfHeaders: uint32(sizeOfHeaders), CheckSum: checksum,
			Subsystem: pe.IMAGE_SUBSYSTEM_EFI_APPLICATION, NumberOfRvaAndSizes: numDirs, DataDirectory: dirs,
		}))
	} else {
		must(binary.Write(&opt, binary.LittleEndian, pe.OptionalHeader64{
			Magic: 0x20b, SectionAlignment: synthSectionAlign, FileAlignment: synthFileAlign,
			SizeOfImage: uint32(va), SizeOfHeaders: uint32(sizeOfHeaders), CheckSum: checksum,
			Subsystem: pe.IMAGE_SUBSYSTEM_EFI_APPLICATION, NumberOfRvaAndSizes: numDirs, DataDirectory: dirs,
		}))
	}
	optBytes := opt.Bytes()[:optSize]

	machine := uint16(pe.IMAGE_FILE_MACHINE_AMD64)
	if s.pe32 {
		machine = pe.IMAGE_FILE_MACHINE_I386
	}
	var f, h bytes.Buffer
	// Every byte goes to the file; those the hash covers also go to h.
	both := func(p []byte) { f.Write(p); h.Write(p) }

	dos := make([]byte, 64)
	copy(dos, "MZ")
	binary.LittleEndian.PutUint32(dos[0x3c:], 64)
	both(dos)
	both([]byte("PE\x00\x00"))
	var fh bytes.Buffer
	must(binary.Write(&fh, binary.LittleEndian, pe.FileHeader{
		Machine: machine, NumberOfSections: uint16(len(sections)), SizeOfOptionalHeader: uint16(optSize),
		Characteristics: pe.IMAGE_FILE_EXECUTABLE_IMAGE,
	}))
	both(fh.Bytes())
	both(optBytes[:checksumOffset])
	f.Write(optBytes[checksumOffset : checksumOffset+4])
	if numDirs > pe.IMAGE_DIRECTORY_ENTRY_SECURITY {
		certEntry := fixed + 8*pe.IMAGE_DIRECTORY_ENTRY_SECURITY
		both(optBytes[checksumOffset+4 : certEntry])
		f.Write(optBytes[certEntry : certEntry+8])
		both(optBytes[certEntry+8:])
	} else {
		both(optBytes[checksumOffset+4:])
	}
	table := sections
	if s.reverseTable {
		table = make([]placed, len(sections))
		for i, p := range sections {
			table[len(sections)-1-i] = p
		}
	}
	for _, p := range table {
		var b bytes.Buffer
		must(binary.Write(&b, binary.LittleEndian, p.hdr))
		both(b.Bytes())
	}
	both(make([]byte, sizeOfHeaders-headersEnd))
	for _, p := range sections {
		both(p.data)
	}
	both(s.trailing)
	f.Write(s.cert)
	return f.Bytes(), h.Bytes()
}

func alignTo(n, align int) int { return (n + align - 1) / align * align }

func must(err error) {
	if err != nil {
		panic(err)
	}
}

// synthKernel is a tiny PE32+ image standing in for a kernel in synthetic UKIs.
func synthKernel() []byte {
	k, _ := synthPE{sections: []synthSection{{name: ".text", data: []byte("not really a kernel")}}}.build()
	return k
}

// synthUKI is a UKI with the given sections around a synthetic kernel.
func synthUKI(sections ...synthSection) []byte {
	uki, _ := synthPE{sections: append([]synthSection{{name: ".text", data: []byte("stub code")}}, sections...)}.build()
	return uki
}
