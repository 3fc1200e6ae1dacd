package measure

import (
	"bytes"
	"crypto/sha256"
	"debug/pe"
	"encoding/binary"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/berthlabs/berth/internal/uki/ukitest"
)

func TestAuthenticodeSynthetic(t *testing.T) {
	sections := []synthSection{
		{name: ".text", data: bytes.Repeat([]byte{0xc3}, 700)},
		{name: ".data", data: []byte("some data")},
		{name: ".reloc", data: []byte{1, 2, 3, 4}},
	}
	cases := []struct {
		name string
		pe   synthPE
	}{
		{"PE32+", synthPE{sections: sections}},
		{"PE32", synthPE{pe32: true, sections: sections}},
		{"PE32+ with certificate table and trailing data", synthPE{sections: sections, trailing: []byte("trailer"), cert: bytes.Repeat([]byte{0xce}, 64)}},
		{"PE32 with certificate table and trailing data", synthPE{pe32: true, sections: sections, trailing: []byte("trailer"), cert: bytes.Repeat([]byte{0xce}, 64)}},
		{"PE32+ with section headers not in file order", synthPE{sections: sections, reverseTable: true}},
		{"PE32 with section headers not in file order", synthPE{pe32: true, sections: sections, reverseTable: true}},
		{"PE32+ without a certificate table entry", synthPE{sections: sections, numDirs: 4}},
		{"PE32 without a certificate table entry", synthPE{pe32: true, sections: sections, numDirs: 3}},
		{"no sections", synthPE{}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			file, hashed := tc.pe.build()
			got, err := authenticode(bytes.NewReader(file), int64(len(file)))
			if err != nil {
				t.Fatal(err)
			}
			if want := Digest(sha256.Sum256(hashed)); got != want {
				t.Errorf("Authenticode hash %s, want %s (SHA-256 of the %d bytes the builder marked as hashed)", got, want, len(hashed))
			}
		})
	}
}

// TestAuthenticodeSyntheticIgnoresExcludedFields changes each excluded part of an image and checks that
// the hash stays, and that changing a covered byte moves it.
func TestAuthenticodeSyntheticIgnoresExcludedFields(t *testing.T) {
	file, _ := synthPE{sections: []synthSection{{name: ".text", data: []byte("code")}}, cert: []byte("certificate-bytes")}.build()
	base, err := authenticode(bytes.NewReader(file), int64(len(file)))
	if err != nil {
		t.Fatal(err)
	}
	optional := 64 + 4 + 20
	cases := []struct {
		name   string
		offset int
		same   bool
	}{
		{"checksum", optional + checksumOffset, true},
		{"certificate table in the file", len(file) - 3, true},
		{"linker version", optional + 2, false},
		{"section data", 0x200, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			changed := bytes.Clone(file)
			changed[tc.offset] ^= 0xff
			got, err := authenticode(bytes.NewReader(changed), int64(len(changed)))
			if err != nil {
				t.Fatal(err)
			}
			if (got == base) != tc.same {
				t.Errorf("hash after changing byte %#x: %s, before %s; want same=%v", tc.offset, got, base, tc.same)
			}
		})
	}
}

// TestAuthenticodeRealFiles checks the hash of the real stub, the real Debian kernel (signed, so its
// certificate table must be left out) and a real UKI two ways: against the plain SHA-256 of the file less
// the excluded fields, which is the Authenticode hash when the sections tile the file after the headers
// (linearAuthenticode checks that they do), and against osslsigncode.
func TestAuthenticodeRealFiles(t *testing.T) {
	parts := ukitest.BootParts(t)
	kernel, err := os.ReadFile(parts.Kernel)
	if err != nil {
		t.Fatal(err)
	}
	uki := ukitest.Build(t, parts.Stub,
		ukitest.Section{Name: ".osrel", Data: []byte("ID=berth\n")},
		ukitest.Section{Name: ".cmdline", Data: []byte("console=ttyS0\n")},
		ukitest.Section{Name: ".linux", Data: kernel},
	)
	for _, path := range []string{parts.Stub, parts.Kernel, uki} {
		t.Run(filepath.Base(path), func(t *testing.T) {
			data, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			got, err := authenticode(bytes.NewReader(data), int64(len(data)))
			if err != nil {
				t.Fatal(err)
			}
			if want := linearAuthenticode(t, data); got != want {
				t.Errorf("Authenticode hash %s, SHA-256 of the file less checksum and certificate table: %s", got, want)
			}
			// osslsigncode hashes an unsigned image as if zero-padded to a multiple of eight bytes, the
			// padding signing would add; EDK2 hashes the file as it is. Both agree on a padded copy.
			padded := append(bytes.Clone(data), make([]byte, (8-len(data)%8)%8)...)
			paddedPath := filepath.Join(t.TempDir(), "padded.efi")
			if err := os.WriteFile(paddedPath, padded, 0o600); err != nil {
				t.Fatal(err)
			}
			gotPadded, err := authenticode(bytes.NewReader(padded), int64(len(padded)))
			if err != nil {
				t.Fatal(err)
			}
			if want := osslsigncodeDigest(t, paddedPath); gotPadded != want {
				t.Errorf("Authenticode hash of the copy padded to 8 bytes %s, osslsigncode says %s", gotPadded, want)
			}
		})
	}
}

// linearAuthenticode is the Authenticode SHA-256 of a PE32+ image whose sections follow one another from
// SizeOfHeaders on, in file order, with nothing between them: then the hash is that of the whole file less
// the checksum, the certificate table's directory entry and the certificate table. It finds the sections
// with debug/pe, not with the package's parser, and fails the test when they do not tile the file.
func linearAuthenticode(t *testing.T, data []byte) Digest {
	t.Helper()
	f, err := pe.NewFile(bytes.NewReader(data))
	if err != nil {
		t.Fatalf("debug/pe: %v", err)
	}
	oh, ok := f.OptionalHeader.(*pe.OptionalHeader64)
	if !ok {
		t.Fatalf("not a PE32+ image: %T", f.OptionalHeader)
	}
	next := oh.SizeOfHeaders
	for _, s := range f.Sections {
		if s.Offset != next {
			t.Fatalf("section %s starts at %#x, not right after the previous one at %#x: the shortcut does not apply", s.Name, s.Offset, next)
		}
		next += s.Size
	}
	optional := int(binary.LittleEndian.Uint32(data[0x3c:])) + 4 + 20
	checksum := optional + 64
	certEntry := optional + 112 + 8*pe.IMAGE_DIRECTORY_ENTRY_SECURITY
	end := len(data) - int(oh.DataDirectory[pe.IMAGE_DIRECTORY_ENTRY_SECURITY].Size)
	h := sha256.New()
	h.Write(data[:checksum])
	h.Write(data[checksum+4 : certEntry])
	h.Write(data[certEntry+8 : end])
	var d Digest
	h.Sum(d[:0])
	return d
}

func TestAuthenticodeRefusesBrokenImages(t *testing.T) {
	good, _ := synthPE{sections: []synthSection{{name: ".text", data: []byte("code")}}, cert: []byte("cert")}.build()
	optional := 64 + 4 + 20
	cases := []struct {
		name    string
		mutate  func([]byte) []byte
		wantErr string
	}{
		{"empty", func([]byte) []byte { return nil }, "beyond the end"},
		{"no MZ", func(b []byte) []byte { b[0] = 'X'; return b }, "no MZ signature"},
		{"PE offset beyond the file", func(b []byte) []byte { b[0x3c] = 0xff; b[0x3d] = 0xff; return b }, "reading the PE header"},
		{"no PE signature", func(b []byte) []byte { b[64] = 'X'; return b }, "no PE signature"},
		{"unknown magic", func(b []byte) []byte { b[optional] = 0x0b; b[optional+1] = 0x03; return b }, "neither PE32"},
		{"too many data directories", func(b []byte) []byte { b[optional+108] = 17; return b }, "more than the 16"},
		{"directory count disagrees with the header size", func(b []byte) []byte { b[optional+108] = 15; return b }, "data directories make it"},
		{"truncated section data", func(b []byte) []byte { return b[:0x210] }, "hashing section"},
		{"certificate table larger than the file", func(b []byte) []byte {
			certSize := optional + optionalHeader64Fixed + 8*pe.IMAGE_DIRECTORY_ENTRY_SECURITY + 4
			b[certSize+2] = 0x10
			return b
		}, "does not fit"},
		{"SizeOfHeaders beyond the file", func(b []byte) []byte { b[optional+60+3] = 0x10; return b }, "beyond the end"},
		{"SizeOfHeaders inside the section table", func(b []byte) []byte { b[optional+60] = 0x10; b[optional+61] = 0; return b }, "section table ends"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b := tc.mutate(bytes.Clone(good))
			_, err := authenticode(bytes.NewReader(b), int64(len(b)))
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("error %v, want one containing %q", err, tc.wantErr)
			}
		})
	}
}

// sha256DigestInfo is the DER prefix of a DigestInfo for SHA-256: the algorithm, then a 32-byte OCTET
// STRING holding the digest.
var sha256DigestInfo = []byte{0x30, 0x0d, 0x06, 0x09, 0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02, 0x01, 0x05, 0x00, 0x04, 0x20}

// osslsigncodeDigest is the Authenticode SHA-256 of the image at path as osslsigncode computes it: its
// extract-data command writes the SpcIndirectDataContent a signature would sign, which ends with that
// digest, and needs no key.
func osslsigncodeDigest(t *testing.T, path string) Digest {
	t.Helper()
	tool, err := exec.LookPath("osslsigncode")
	if err != nil {
		t.Fatal("osslsigncode not found: apt-get install osslsigncode")
	}
	out := filepath.Join(t.TempDir(), "data.der")
	if b, err := exec.Command(tool, "extract-data", "-h", "sha256", "-in", path, "-out", out).CombinedOutput(); err != nil {
		t.Fatalf("osslsigncode extract-data %s: %v\n%s", path, err, b)
	}
	der, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	i := bytes.Index(der, sha256DigestInfo)
	if i < 0 || len(der) < i+len(sha256DigestInfo)+sha256.Size {
		t.Fatalf("osslsigncode extract-data wrote no SHA-256 DigestInfo: %x", der)
	}
	var d Digest
	copy(d[:], der[i+len(sha256DigestInfo):])
	return d
}
