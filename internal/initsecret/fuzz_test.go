package initsecret

import (
	"testing"
)

// fuzzMaxWork bounds memory x passes (KiB) of the inputs that are also hashed while fuzzing: the
// parser is what is under test, and a few hundred MiB per input would stall the fuzzer.
const fuzzMaxWork = 1024

// FuzzVerify feeds Verify arbitrary hash strings: it must never panic, must accept only the
// canonical form, and its errors must not depend on the secret (so they cannot reveal it).
func FuzzVerify(f *testing.F) {
	for _, v := range referenceVectors {
		f.Add(v.encoded, []byte(v.secret))
	}
	f.Fuzz(func(t *testing.T, encoded string, secret []byte) {
		h, perr := parse(encoded)
		if perr == nil {
			if h.String() != encoded {
				t.Fatalf("parse accepted non-canonical %q (canonical %q)", encoded, h.String())
			}
			if uint64(h.memory)*uint64(h.time) > fuzzMaxWork {
				return
			}
		}
		ok, err := Verify(encoded, secret)
		if (err == nil) != (perr == nil) {
			t.Fatalf("Verify error %v, parse error %v", err, perr)
		}
		if err == nil {
			return
		}
		if ok {
			t.Fatalf("Verify returned true with error %v", err)
		}
		_, err2 := Verify(encoded, append([]byte("other"), secret...))
		if err2 == nil || err2.Error() != err.Error() {
			t.Fatalf("error depends on the secret: %q vs %q", err, err2)
		}
	})
}
