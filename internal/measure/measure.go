// Package measure predicts, offline, the SHA-256 PCR values that booting a unified kernel image (UKI)
// produces, so that a join policy can admit exactly the image Berth built, and explains each value by the
// events that make it up, so that a refused node can be told which part of its boot differed.
//
// The prediction is for the boot Berth's images make: OVMF (EDK2) starts the UKI as the first boot option
// it tries, the UKI's stub is systemd-stub 252 (Debian 12) with its command line embedded, and the ESP
// holds no credentials, system extensions or add-ons for the stub to pick up. Then:
//
//   - PCR 4: EDK2's "Calling EFI Application from Boot Option" action, the separator, the UKI's
//     Authenticode hash, and the Authenticode hash of the kernel in .linux, which the stub LoadImage()s;
//   - PCR 9: the kernel's EFI stub measures its LoadOptions (the command line, UTF-16LE with a NUL) and the
//     initrd the stub hands it (.initrd);
//   - PCR 11: the stub measures each UKI section it knows, name then content, in its fixed order;
//   - PCR 12: nothing, since the command line is embedded and no credentials exist.
//
// With Secure Boot off the stub also accepts a command line from the boot entry's optional data instead
// of the embedded one; the boot entry must then carry none. The firmware's own PCRs (0–3, 5–7) depend on
// OVMF's build and are checked by replaying its event log, not predicted here.
package measure

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"sync"
)

// MaxSize is the largest UKI Predict reads. Real ones are tens of megabytes; the limit keeps a wrong file
// (a disk image, say) from being hashed for minutes.
const MaxSize = 512 << 20

// predictedPCRs are the registers Predict predicts.
var predictedPCRs = [...]int{4, 9, 11, 12}

// Digest is a SHA-256 digest or PCR value. It reads and writes as lowercase hex.
type Digest [sha256.Size]byte

func (d Digest) String() string { return hex.EncodeToString(d[:]) }

// MarshalText writes d as hex.
func (d Digest) MarshalText() ([]byte, error) { return []byte(d.String()), nil }

// UnmarshalText reads 64 hex digits.
func (d *Digest) UnmarshalText(text []byte) error {
	if hex.DecodedLen(len(text)) != len(d) {
		return fmt.Errorf("digest is %d hex digits, want %d", len(text), 2*len(d))
	}
	_, err := hex.Decode(d[:], text)
	return err
}

// Event is one measurement: Digest is extended into PCR. Size is the number of bytes the digest covers
// (for an Authenticode hash, the size of the image).
type Event struct {
	PCR         int    `json:"pcr"`
	Description string `json:"description"`
	Digest      Digest `json:"digest"`
	Size        int64  `json:"size"`
}

// Result is a prediction: the final value of PCRs 4, 9, 11 and 12, and the events that produce them in the order
// the boot measures them.
type Result struct {
	PCRs   map[int]Digest `json:"pcrs"`
	Events []Event        `json:"events"`
}

// Mismatch is a PCR whose value differs from the prediction. Got is nil when no value was given for it.
type Mismatch struct {
	PCR      int
	Expected Digest
	Got      []byte
}

func (m Mismatch) String() string {
	if m.Got == nil {
		return fmt.Sprintf("PCR %d: expected %s, got no value", m.PCR, m.Expected)
	}
	return fmt.Sprintf("PCR %d: expected %s, got %x", m.PCR, m.Expected, m.Got)
}

// Values are the predicted PCR values as byte slices, the form join policies and quotes use.
func (r *Result) Values() map[int][]byte {
	out := make(map[int][]byte, len(r.PCRs))
	for i, d := range r.PCRs {
		out[i] = bytes.Clone(d[:])
	}
	return out
}

// Compare checks actual PCR values (from a quote or a TPM read) against the prediction and returns the
// PCRs that differ, in ascending order; none means the boot was the predicted one.
func (r *Result) Compare(actual map[int][]byte) []Mismatch {
	var out []Mismatch
	for _, pcr := range slices.Sorted(maps.Keys(r.PCRs)) {
		want := r.PCRs[pcr]
		got, ok := actual[pcr]
		switch {
		case !ok:
			out = append(out, Mismatch{PCR: pcr, Expected: want})
		case string(got) != string(want[:]):
			out = append(out, Mismatch{PCR: pcr, Expected: want, Got: slices.Clone(got)})
		}
	}
	return out
}

// PredictFile predicts the PCR values of booting the UKI at path.
func PredictFile(path string) (*Result, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("opening the UKI: %w", err)
	}
	defer f.Close()
	info, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("reading the UKI's size: %w", err)
	}
	if !info.Mode().IsRegular() {
		return nil, fmt.Errorf("UKI %s is not a regular file", path)
	}
	return Predict(f, info.Size())
}

// Predict predicts the PCR values of booting the UKI in r[0:size]. r must allow concurrent ReadAt calls,
// as *os.File and *bytes.Reader do: the large hashes run in parallel.
func Predict(r io.ReaderAt, size int64) (*Result, error) {
	if size > MaxSize {
		return nil, fmt.Errorf("UKI is %d bytes, over the %d MiB limit", size, MaxSize>>20)
	}
	img, err := readPE(r, size)
	if err != nil {
		return nil, fmt.Errorf("reading the UKI's PE headers: %w", err)
	}
	found := locateSections(img)
	if err := checkSections(img, found); err != nil {
		return nil, fmt.Errorf("UKI sections: %w", err)
	}
	cmdline, err := readSection(r, found[sectionCmdline], size)
	if err != nil {
		return nil, fmt.Errorf("reading .cmdline: %w", err)
	}
	options, err := loadOptions(cmdline)
	if err != nil {
		return nil, fmt.Errorf("UKI .cmdline: %w", err)
	}

	linux := found[sectionLinux]
	var (
		ukiHash, kernelHash Digest
		contents            [len(unifiedSections)]Digest
	)
	jobs := []func() error{
		func() (err error) {
			if ukiHash, err = img.authenticode(r); err != nil {
				err = fmt.Errorf("Authenticode hash of the UKI: %w", err)
			}
			return err
		},
		func() (err error) {
			kernel := io.NewSectionReader(r, int64(linux.PointerToRawData), int64(linux.VirtualSize))
			if kernelHash, err = authenticode(kernel, int64(linux.VirtualSize)); err != nil {
				err = fmt.Errorf("Authenticode hash of the kernel in .linux (systemd-stub LoadImage()s it): %w", err)
			}
			return err
		},
	}
	for j, s := range found {
		if s == nil {
			continue
		}
		jobs = append(jobs, func() error {
			h := sha256.New()
			if err := hashRange(h, r, int64(s.PointerToRawData), int64(s.VirtualSize), size); err != nil {
				return fmt.Errorf("hashing section %s: %w", unifiedSections[j], err)
			}
			h.Sum(contents[j][:0])
			return nil
		})
	}
	if err := runAll(jobs); err != nil {
		return nil, err
	}

	events := []Event{
		{PCR: 4, Description: `EV_EFI_ACTION "Calling EFI Application from Boot Option"`, Digest: sha256.Sum256([]byte(callingEFIApplication)), Size: int64(len(callingEFIApplication))},
		{PCR: 4, Description: "EV_SEPARATOR", Digest: sha256.Sum256(separator[:]), Size: int64(len(separator))},
		{PCR: 4, Description: "EV_EFI_BOOT_SERVICES_APPLICATION: the UKI (Authenticode)", Digest: ukiHash, Size: size},
		{PCR: 4, Description: "EV_EFI_BOOT_SERVICES_APPLICATION: the kernel in .linux (Authenticode)", Digest: kernelHash, Size: int64(linux.VirtualSize)},
		{PCR: 9, Description: "EV_EVENT_TAG LOADED_IMAGE::LoadOptions: the command line from .cmdline (UTF-16LE, NUL-terminated)", Digest: sha256.Sum256(options), Size: int64(len(options))},
	}
	if s := found[sectionInitrd]; s != nil {
		events = append(events, Event{PCR: 9, Description: "EV_EVENT_TAG Linux initrd: the .initrd section", Digest: contents[sectionInitrd], Size: int64(s.VirtualSize)})
	}
	for j, s := range found {
		if s == nil {
			continue
		}
		name := append([]byte(unifiedSections[j]), 0)
		events = append(events,
			Event{PCR: 11, Description: fmt.Sprintf("EV_IPL: the name %q with its NUL", unifiedSections[j]), Digest: sha256.Sum256(name), Size: int64(len(name))},
			Event{PCR: 11, Description: fmt.Sprintf("EV_IPL: the content of %s", unifiedSections[j]), Digest: contents[j], Size: int64(s.VirtualSize)},
		)
	}
	return &Result{PCRs: replay(events), Events: events}, nil
}

// callingEFIApplication is the action EDK2 measures into PCR 4 before it starts the first boot option; the
// separator follows it when the firmware hands over to the boot option.
const callingEFIApplication = "Calling EFI Application from Boot Option"

var separator = [4]byte{}

// replay extends each event into a PCR that starts at zero: PCR = SHA-256(PCR || digest).
func replay(events []Event) map[int]Digest {
	pcrs := make(map[int]Digest, len(predictedPCRs))
	for _, pcr := range predictedPCRs {
		pcrs[pcr] = Digest{}
	}
	for _, e := range events {
		v := pcrs[e.PCR]
		pcrs[e.PCR] = sha256.Sum256(append(v[:], e.Digest[:]...))
	}
	return pcrs
}

// runAll runs the jobs concurrently and returns their errors joined.
func runAll(jobs []func() error) error {
	errs := make([]error, len(jobs))
	var wg sync.WaitGroup
	for i, job := range jobs {
		wg.Go(func() { errs[i] = job() })
	}
	wg.Wait()
	return errors.Join(errs...)
}
