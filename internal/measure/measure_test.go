package measure

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unicode/utf16"

	"github.com/berthlabs/berth/internal/uki/ukitest"
)

// pcrOf is what a SHA-256 PCR holds after extending digests into it from zero, written here apart from the
// package's replay.
func pcrOf(digests ...Digest) Digest {
	var pcr Digest
	for _, d := range digests {
		h := sha256.New()
		h.Write(pcr[:])
		h.Write(d[:])
		copy(pcr[:], h.Sum(nil))
	}
	return pcr
}

func sha(b []byte) Digest { return sha256.Sum256(b) }

// utf16z is s as UTF-16LE with a terminating NUL, encoded through unicode/utf16 rather than the package's
// ASCII shortcut.
func utf16z(s string) []byte {
	var b []byte
	for _, u := range utf16.Encode([]rune(s + "\x00")) {
		b = binary.LittleEndian.AppendUint16(b, u)
	}
	return b
}

// realUKI is a UKI made of Debian's stub and kernel, and the inputs it was made of.
type realUKI struct {
	path                           string
	kernel, osrel, cmdline, initrd []byte
}

// buildRealUKI builds a UKI whose sections are in the file in another order than the stub measures them.
func buildRealUKI(t testing.TB, parts ukitest.Parts, cmdline string) realUKI {
	t.Helper()
	kernel, err := os.ReadFile(parts.Kernel)
	if err != nil {
		t.Fatal(err)
	}
	u := realUKI{
		kernel:  kernel,
		osrel:   []byte("ID=berth\nVERSION_ID=test\nPRETTY_NAME=\"Berth test image\"\n"),
		cmdline: []byte(cmdline),
		initrd:  ukitest.Cpio("init", []byte("#!/bin/sh\necho berth\n")),
	}
	u.path = ukitest.Build(t, parts.Stub,
		ukitest.Section{Name: ".osrel", Data: u.osrel},
		ukitest.Section{Name: ".cmdline", Data: u.cmdline},
		ukitest.Section{Name: ".initrd", Data: u.initrd},
		ukitest.Section{Name: ".linux", Data: u.kernel},
	)
	return u
}

// expected computes the four PCRs of u from its inputs, without the package. The Authenticode hashes are
// linearAuthenticode's; TestAuthenticodeRealFiles checks those files against osslsigncode too.
func (u realUKI) expected(t *testing.T) map[int][]byte {
	t.Helper()
	file, err := os.ReadFile(u.path)
	if err != nil {
		t.Fatal(err)
	}
	pcr4 := pcrOf(
		sha([]byte("Calling EFI Application from Boot Option")),
		sha([]byte{0, 0, 0, 0}),
		linearAuthenticode(t, file),
		linearAuthenticode(t, u.kernel),
	)
	pcr9 := pcrOf(sha(utf16z(strings.TrimSpace(string(u.cmdline)))), sha(u.initrd))
	pcr11 := pcrOf(
		sha([]byte(".linux\x00")), sha(u.kernel),
		sha([]byte(".osrel\x00")), sha(u.osrel),
		sha([]byte(".cmdline\x00")), sha(u.cmdline),
		sha([]byte(".initrd\x00")), sha(u.initrd),
	)
	var zero Digest
	return map[int][]byte{4: pcr4[:], 9: pcr9[:], 11: pcr11[:], 12: zero[:]}
}

func TestPredictRealUKI(t *testing.T) {
	parts := ukitest.BootParts(t)
	u := buildRealUKI(t, parts, "console=ttyS0 panic=-1 berth.test=1\n")
	res, err := PredictFile(u.path)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range res.Compare(u.expected(t)) {
		t.Error(m)
	}
	perPCR := map[int]int{}
	for _, e := range res.Events {
		perPCR[e.PCR]++
		if e.Size <= 0 || e.Description == "" {
			t.Errorf("event %+v lacks a size or a description", e)
		}
	}
	if want := map[int]int{4: 4, 9: 2, 11: 8}; !mapsEqual(perPCR, want) {
		t.Errorf("events per PCR %v, want %v", perPCR, want)
	}
	if len(res.PCRs) != 4 {
		t.Errorf("%d PCR values, want 4: %v", len(res.PCRs), res.PCRs)
	}
}

func mapsEqual(a, b map[int]int) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

// TestPredictCommandLineChange changes one byte of the command line: the section's content (PCR 11), the
// kernel's load options (PCR 9) and the UKI's hash (PCR 4) change; the kernel's hash does not.
func TestPredictCommandLineChange(t *testing.T) {
	parts := ukitest.BootParts(t)
	a := buildRealUKI(t, parts, "console=ttyS0 panic=-1\n")
	b := buildRealUKI(t, parts, "console=ttyS1 panic=-1\n")
	ra, err := PredictFile(a.path)
	if err != nil {
		t.Fatal(err)
	}
	rb, err := PredictFile(b.path)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range rb.Compare(b.expected(t)) {
		t.Errorf("changed UKI: %s", m)
	}
	for pcr, changes := range map[int]bool{4: true, 9: true, 11: true, 12: false} {
		if (ra.PCRs[pcr] != rb.PCRs[pcr]) != changes {
			t.Errorf("PCR %d: %s before, %s after; want changed=%v", pcr, ra.PCRs[pcr], rb.PCRs[pcr], changes)
		}
	}
	// Events 2 and 3 are the UKI's and the kernel's Authenticode hashes.
	if ra.Events[2].Digest == rb.Events[2].Digest {
		t.Error("the UKI's Authenticode hash did not change with its command line")
	}
	if ra.Events[3].Digest != rb.Events[3].Digest {
		t.Error("the kernel's Authenticode hash changed with the command line")
	}
}

// TestPredictSyntheticUKI checks the stub's rules on a UKI whose sections are in no particular order:
// PCR 11 follows stub 252's order, .uname (unknown to 252) is not measured, names match by prefix, and
// the command line is cleaned up as the stub does before the kernel measures it.
func TestPredictSyntheticUKI(t *testing.T) {
	kernel, kernelHashed := synthPE{sections: []synthSection{{name: ".text", data: []byte("not really a kernel")}}}.build()
	sections := []synthSection{
		{name: ".uname", data: []byte("6.1.0-test")},
		{name: ".initrd", data: []byte("initrd bytes")},
		{name: ".dtb.x", data: []byte("a device tree")},
		{name: ".cmdline", data: []byte("quiet\x01root=/dev/vda2 \n\x00after the NUL")},
		{name: ".splash", data: []byte("BM a bitmap")},
		{name: ".osrel", data: []byte("ID=berth\n")},
		{name: ".linux", data: kernel},
	}
	uki := synthUKI(sections...)
	res, err := Predict(bytes.NewReader(uki), int64(len(uki)))
	if err != nil {
		t.Fatal(err)
	}
	content := map[string][]byte{}
	for _, s := range sections {
		content[s.name] = s.data
	}
	_, ukiHashed := synthPE{sections: append([]synthSection{{name: ".text", data: []byte("stub code")}}, sections...)}.build()
	want := map[int]Digest{
		4: pcrOf(sha([]byte(callingEFIApplication)), sha(make([]byte, 4)), sha(ukiHashed), sha(kernelHashed)),
		9: pcrOf(sha(utf16z("quiet root=/dev/vda2")), sha(content[".initrd"])),
		11: pcrOf(
			sha([]byte(".linux\x00")), sha(content[".linux"]),
			sha([]byte(".osrel\x00")), sha(content[".osrel"]),
			sha([]byte(".cmdline\x00")), sha(content[".cmdline"]),
			sha([]byte(".initrd\x00")), sha(content[".initrd"]),
			sha([]byte(".splash\x00")), sha(content[".splash"]),
			sha([]byte(".dtb\x00")), sha(content[".dtb.x"]),
		),
		12: {},
	}
	actual := map[int][]byte{}
	for pcr, d := range want {
		actual[pcr] = bytes.Clone(d[:])
	}
	for _, m := range res.Compare(actual) {
		t.Error(m)
	}
}

func TestPredictRefuses(t *testing.T) {
	kernel := synthKernel()
	linux := synthSection{name: ".linux", data: kernel}
	cmdline := synthSection{name: ".cmdline", data: []byte("console=ttyS0\n")}
	cases := []struct {
		name    string
		uki     []byte
		wantErr string
	}{
		{"not a PE image", []byte("#!/bin/sh\necho not a UKI\n" + strings.Repeat(" ", 64)), "no MZ signature"},
		{"no .linux", synthUKI(cmdline), "no .linux section"},
		{"empty .linux", synthUKI(cmdline, synthSection{name: ".linux", data: nil}), "no .linux section"},
		{"no .cmdline", synthUKI(linux), "no .cmdline section"},
		{".pcrsig", synthUKI(linux, cmdline, synthSection{name: ".pcrsig", data: []byte("{}")}), ".pcrsig or .pcrpkey"},
		{".pcrpkey", synthUKI(linux, cmdline, synthSection{name: ".pcrpkey", data: []byte("key")}), ".pcrsig or .pcrpkey"},
		{"zero-filled section", synthUKI(linux, cmdline, synthSection{name: ".initrd", data: []byte("x"), virtualSize: 0x10000}), "exceeds SizeOfRawData"},
		{"overlapping sections", synthUKI(linux, cmdline, synthSection{name: ".initrd", data: []byte("x"), virtualAddress: 0x1000}), "overlap in memory"},
		{".linux is not a PE image", synthUKI(cmdline, synthSection{name: ".linux", data: []byte("MZ but nothing more")}), "the kernel in .linux"},
		{"non-ASCII command line", synthUKI(linux, synthSection{name: ".cmdline", data: []byte("console=ttyS0 name=b\xc3\xa4r")}), "non-ASCII byte 0xc3 at offset 20"},
		{"empty command line", synthUKI(linux, synthSection{name: ".cmdline", data: []byte(" \n\x00console=ttyS0")}), "command line is empty"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Predict(bytes.NewReader(tc.uki), int64(len(tc.uki)))
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("error %v, want one containing %q", err, tc.wantErr)
			}
		})
	}
}

// zeros reads as an endless run of zero bytes, to claim sizes no test should allocate.
type zeros struct{}

func (zeros) ReadAt(p []byte, _ int64) (int, error) {
	clear(p)
	return len(p), nil
}

func TestPredictRefusesHugeFiles(t *testing.T) {
	_, err := Predict(zeros{}, MaxSize+1)
	if err == nil || !strings.Contains(err.Error(), "over the 512 MiB limit") {
		t.Fatalf("error %v, want the size limit", err)
	}
}

func TestPredictFileErrors(t *testing.T) {
	dir := t.TempDir()
	if _, err := PredictFile(filepath.Join(dir, "absent.efi")); err == nil || !strings.Contains(err.Error(), "opening the UKI") {
		t.Errorf("missing file: error %v, want one about opening the UKI", err)
	}
	if _, err := PredictFile(dir); err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Errorf("directory: error %v, want one about a regular file", err)
	}
}

func TestCompare(t *testing.T) {
	uki := synthUKI(synthSection{name: ".linux", data: synthKernel()}, synthSection{name: ".cmdline", data: []byte("quiet")})
	res, err := Predict(bytes.NewReader(uki), int64(len(uki)))
	if err != nil {
		t.Fatal(err)
	}
	actual := map[int][]byte{}
	for pcr, d := range res.PCRs {
		actual[pcr] = bytes.Clone(d[:])
	}
	if m := res.Compare(actual); len(m) != 0 {
		t.Fatalf("mismatches against its own values: %v", m)
	}
	actual[9][0] ^= 1
	delete(actual, 11)
	m := res.Compare(actual)
	if len(m) != 2 || m[0].PCR != 9 || m[1].PCR != 11 {
		t.Fatalf("mismatches %v, want PCRs 9 and 11", m)
	}
	want9 := "PCR 9: expected " + res.PCRs[9].String() + ", got "
	if !strings.HasPrefix(m[0].String(), want9) || strings.HasSuffix(m[0].String(), res.PCRs[9].String()) {
		t.Errorf("mismatch reads %q, want the expected and the changed value", m[0])
	}
	if want := "PCR 11: expected " + res.PCRs[11].String() + ", got no value"; m[1].String() != want {
		t.Errorf("mismatch reads %q, want %q", m[1], want)
	}
}

func TestResultJSON(t *testing.T) {
	uki := synthUKI(synthSection{name: ".linux", data: synthKernel()}, synthSection{name: ".cmdline", data: []byte("quiet")})
	res, err := Predict(bytes.NewReader(uki), int64(len(uki)))
	if err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(res)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), `"11":"`+res.PCRs[11].String()+`"`) {
		t.Errorf("JSON %s does not hold PCR 11 as hex", b)
	}
	var back Result
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if len(back.Events) != len(res.Events) || back.PCRs[4] != res.PCRs[4] || back.Events[2] != res.Events[2] {
		t.Errorf("round trip changed the result:\n%+v\n%+v", back, *res)
	}
	var d Digest
	if err := d.UnmarshalText([]byte("abcd")); err == nil {
		t.Error("a 4-digit digest was accepted")
	}
}

// BenchmarkPredict predicts a 100 MB UKI (Debian's stub and kernel and a random initrd) and, with the
// timer stopped, hashes the same bytes once with plain SHA-256, reporting how many times that baseline a
// prediction takes.
func BenchmarkPredict(b *testing.B) {
	parts := ukitest.BootParts(b)
	kernel, err := os.ReadFile(parts.Kernel)
	if err != nil {
		b.Fatal(err)
	}
	initrd := make([]byte, 100_000_000-len(kernel))
	if _, err := io.ReadFull(rand.Reader, initrd); err != nil {
		b.Fatal(err)
	}
	path := ukitest.Build(b, parts.Stub,
		ukitest.Section{Name: ".osrel", Data: []byte("ID=berth\n")},
		ukitest.Section{Name: ".cmdline", Data: []byte("console=ttyS0\n")},
		ukitest.Section{Name: ".linux", Data: kernel},
		ukitest.Section{Name: ".initrd", Data: initrd},
	)
	data, err := os.ReadFile(path)
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(data)))
	var baseline time.Duration
	for b.Loop() {
		if _, err := PredictFile(path); err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		start := time.Now()
		sha256.Sum256(data)
		baseline += time.Since(start)
		b.StartTimer()
	}
	b.ReportMetric(float64(len(data))*float64(b.N)/baseline.Seconds()/1e6, "sha256-MB/s")
	b.ReportMetric(float64(b.Elapsed())/float64(baseline), "x-sha256")
}

func TestValues(t *testing.T) {
	r := &Result{PCRs: map[int]Digest{4: {1}, 9: {2}, 11: {3}, 12: {}}}
	v := r.Values()
	if len(v) != 4 || len(r.Compare(v)) != 0 {
		t.Fatalf("Values() = %x, which Compare does not accept", v)
	}
	v[4][0] = 0xff
	if r.PCRs[4][0] != 1 {
		t.Error("changing a value changed the prediction")
	}
}
