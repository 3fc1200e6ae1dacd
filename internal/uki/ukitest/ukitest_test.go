package ukitest

import (
	"bytes"
	"debug/pe"
	"strconv"
	"testing"
)

func TestBuild(t *testing.T) {
	parts := BootParts(t)
	f, err := pe.Open(Build(t, parts.Stub, Section{Name: ".osrel", Data: []byte("ID=berth\n")}))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	s := f.Section(".osrel")
	if s == nil {
		t.Fatal("UKI has no .osrel section")
	}
	if data, err := s.Data(); err != nil || !bytes.HasPrefix(data, []byte("ID=berth\n")) || s.VirtualSize != 9 {
		t.Errorf(".osrel: %q (VirtualSize %d), %v; want ID=berth", data, s.VirtualSize, err)
	}
}

func TestCpio(t *testing.T) {
	for _, tc := range []struct {
		archive []byte
		mode    uint64
	}{
		{Cpio("init", []byte("#!/bin/sh\n")), 0o100644},
		{CpioExecutable("init", []byte("#!/bin/sh\n")), 0o100755},
	} {
		a := tc.archive
		if len(a)%4 != 0 {
			t.Errorf("archive of %d bytes, want a multiple of 4", len(a))
		}
		field := func(off, i int) uint64 {
			v, err := strconv.ParseUint(string(a[off+6+8*i:off+14+8*i]), 16, 32)
			if err != nil {
				t.Fatalf("header field %d: %v", i, err)
			}
			return v
		}
		if string(a[:6]) != "070701" {
			t.Fatalf("magic %q, want 070701 (newc)", a[:6])
		}
		mode, size, nameSize := field(0, 1), field(0, 6), field(0, 11)
		if mode != tc.mode || size != 10 || nameSize != 5 {
			t.Errorf("mode %o, size %d, name size %d; want %o, 10, 5", mode, size, nameSize, tc.mode)
		}
		if name := string(a[110 : 110+4]); name != "init" {
			t.Errorf("name %q, want init", name)
		}
		// 110-byte header + "init\0", padded to 116; the data then ends at 126, padded to 128.
		if data := string(a[116:126]); data != "#!/bin/sh\n" {
			t.Errorf("data %q", data)
		}
		if trailer := string(a[128+110 : 128+110+10]); trailer != "TRAILER!!!" {
			t.Errorf("second entry %q, want the trailer", trailer)
		}
	}
}
