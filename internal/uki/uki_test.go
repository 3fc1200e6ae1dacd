package uki_test

import (
	"bytes"
	"context"
	"debug/pe"
	"path/filepath"
	"strings"
	"testing"

	"github.com/berthlabs/berth/internal/uki"
	"github.com/berthlabs/berth/internal/uki/ukitest"
)

// TestAssemble checks the layout against the stub's own headers, read here independently: every added
// section holds its bytes unchanged, starts aligned to SectionAlignment, and overlaps neither the stub's
// sections nor the one before it.
func TestAssemble(t *testing.T) {
	parts := ukitest.BootParts(t)
	stub, err := pe.Open(parts.Stub)
	if err != nil {
		t.Fatal(err)
	}
	defer stub.Close()
	oh := stub.OptionalHeader.(*pe.OptionalHeader64)
	var stubEnd uint64
	for _, s := range stub.Sections {
		stubEnd = max(stubEnd, uint64(s.VirtualAddress)+uint64(max(s.VirtualSize, s.Size)))
	}

	added := []uki.Section{
		{Name: ".osrel", Data: []byte("ID=berth\n")},
		{Name: ".cmdline", Data: []byte("console=ttyS0\n")},
		{Name: ".initrd", Data: bytes.Repeat([]byte{7}, 5000)},
	}
	out := filepath.Join(t.TempDir(), "uki.efi")
	if err := uki.Assemble(context.Background(), parts.Stub, out, added...); err != nil {
		t.Fatal(err)
	}
	f, err := pe.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	prevEnd := stubEnd
	for _, want := range added {
		s := f.Section(want.Name)
		if s == nil {
			t.Fatalf("UKI has no %s section", want.Name)
		}
		data, err := s.Data()
		if err != nil {
			t.Fatal(err)
		}
		if int(s.VirtualSize) != len(want.Data) || !bytes.Equal(data[:s.VirtualSize], want.Data) {
			t.Errorf("%s: VirtualSize %d, want the %d bytes given, unchanged", want.Name, s.VirtualSize, len(want.Data))
		}
		va := uint64(s.VirtualAddress)
		if va%uint64(oh.SectionAlignment) != 0 || va < prevEnd {
			t.Errorf("%s at %#x: want an address aligned to %#x at or after %#x", want.Name, va, oh.SectionAlignment, prevEnd)
		}
		prevEnd = va + uint64(s.VirtualSize)
	}
}

func TestAssembleRefuses(t *testing.T) {
	parts := ukitest.BootParts(t)
	missing := filepath.Join(t.TempDir(), "stub")
	for _, tc := range []struct {
		name     string
		stub     string
		sections []uki.Section
		want     string
	}{
		{"stub is no PE file", "uki_test.go", nil, "reading the stub's headers"},
		{"missing stub", missing, nil, "reading the stub's headers"},
		{"long name", parts.Stub, []uki.Section{{Name: ".toolongname"}}, `section name ".toolongname"`},
		{"twice", parts.Stub, []uki.Section{{Name: ".osrel"}, {Name: ".osrel"}}, "section .osrel given twice"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := uki.Assemble(context.Background(), tc.stub, filepath.Join(t.TempDir(), "out.efi"), tc.sections...)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Assemble = %v, want an error containing %q", err, tc.want)
			}
		})
	}
}
