package measure

import (
	"bytes"
	"testing"
)

// fuzzSeeds are valid images and UKIs for the fuzzers to start from.
func fuzzSeeds() [][]byte {
	pe32, _ := synthPE{pe32: true, sections: []synthSection{{name: ".text", data: []byte("code")}}, trailing: []byte("t"), cert: []byte("cert")}.build()
	pe32plus, _ := synthPE{sections: []synthSection{{name: ".text", data: []byte("code")}}, numDirs: 4}.build()
	return [][]byte{
		pe32,
		pe32plus,
		synthUKI(
			synthSection{name: ".linux", data: synthKernel()},
			synthSection{name: ".cmdline", data: []byte("console=ttyS0\n")},
			synthSection{name: ".initrd", data: []byte("initrd")},
			synthSection{name: ".osrel", data: []byte("ID=berth\n")},
		),
		[]byte("MZ"),
	}
}

// FuzzPredict feeds arbitrary bytes to Predict: it must return a result or an error, never panic, and a
// result always has the four PCRs.
func FuzzPredict(f *testing.F) {
	for _, seed := range fuzzSeeds() {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		res, err := Predict(bytes.NewReader(data), int64(len(data)))
		if err != nil {
			return
		}
		if len(res.PCRs) != 4 {
			t.Fatalf("result with %d PCRs: %v", len(res.PCRs), res.PCRs)
		}
	})
}

// FuzzAuthenticode feeds arbitrary bytes to the Authenticode hash, which must not panic and must give the
// same answer twice.
func FuzzAuthenticode(f *testing.F) {
	for _, seed := range fuzzSeeds() {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		a, errA := authenticode(bytes.NewReader(data), int64(len(data)))
		b, errB := authenticode(bytes.NewReader(data), int64(len(data)))
		if (errA == nil) != (errB == nil) || a != b {
			t.Fatalf("two runs differ: %s, %v and %s, %v", a, errA, b, errB)
		}
	})
}
