package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/berthlabs/berth/internal/measure"
	"github.com/berthlabs/berth/internal/uki/ukitest"
)

func TestMeasure(t *testing.T) {
	parts := ukitest.BootParts(t)
	kernel, err := os.ReadFile(parts.Kernel)
	if err != nil {
		t.Fatal(err)
	}
	uki := ukitest.Build(t, parts.Stub,
		ukitest.Section{Name: ".osrel", Data: []byte("ID=berth\n")},
		ukitest.Section{Name: ".cmdline", Data: []byte("console=ttyS0 panic=-1\n")},
		ukitest.Section{Name: ".linux", Data: kernel},
		ukitest.Section{Name: ".initrd", Data: ukitest.Cpio("init", []byte("#!/bin/sh\n"))},
	)
	want, err := measure.PredictFile(uki)
	if err != nil {
		t.Fatal(err)
	}

	t.Run("text", func(t *testing.T) {
		var stdout, stderr strings.Builder
		if code := run([]string{"measure", "--uki", uki}, &stdout, &stderr); code != 0 {
			t.Fatalf("exit code %d, stderr: %s", code, stderr.String())
		}
		var lines []string
		for _, pcr := range []int{4, 9, 11, 12} {
			lines = append(lines, fmt.Sprintf("PCR %-2d sha256:%s", pcr, want.PCRs[pcr]))
		}
		if got, wantOut := stdout.String(), strings.Join(lines, "\n")+"\n"; got != wantOut {
			t.Errorf("stdout:\n%s\nwant:\n%s", got, wantOut)
		}
	})

	t.Run("json", func(t *testing.T) {
		var stdout, stderr strings.Builder
		if code := run([]string{"measure", "--uki", uki, "--json"}, &stdout, &stderr); code != 0 {
			t.Fatalf("exit code %d, stderr: %s", code, stderr.String())
		}
		var got measure.Result
		if err := json.Unmarshal([]byte(stdout.String()), &got); err != nil {
			t.Fatalf("stdout is not a prediction: %v\n%s", err, stdout.String())
		}
		if len(got.PCRs) != 4 || len(got.Events) != len(want.Events) {
			t.Fatalf("JSON has %d PCRs and %d events, want 4 and %d", len(got.PCRs), len(got.Events), len(want.Events))
		}
		for pcr, d := range want.PCRs {
			if got.PCRs[pcr] != d {
				t.Errorf("PCR %d: %s, want %s", pcr, got.PCRs[pcr], d)
			}
		}
		for i, e := range want.Events {
			if got.Events[i] != e {
				t.Errorf("event %d: %+v, want %+v", i, got.Events[i], e)
			}
		}
	})
}

func TestMeasureErrors(t *testing.T) {
	notUKI := filepath.Join(t.TempDir(), "not-a-uki.efi")
	if err := os.WriteFile(notUKI, []byte("plain text, not a PE image, long enough to hold a DOS header......"), 0o600); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name   string
		args   []string
		code   int
		stderr string
	}{
		{"no --uki", []string{"measure"}, 2, "berth-agent measure: --uki is required\nUsage: berth-agent measure --uki FILE"},
		{"extra argument", []string{"measure", "--uki", notUKI, "more"}, 2, "berth-agent measure: unexpected argument \"more\"\nUsage: berth-agent measure --uki FILE"},
		{"unknown flag", []string{"measure", "--config", "x"}, 2, "flag provided but not defined: -config"},
		{"missing file", []string{"measure", "--uki", filepath.Join(t.TempDir(), "absent.efi")}, 1, "opening the UKI"},
		{"not a UKI", []string{"measure", "--uki", notUKI}, 1, "no MZ signature"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var stdout, stderr strings.Builder
			if code := run(tc.args, &stdout, &stderr); code != tc.code {
				t.Errorf("exit code %d, want %d; stderr: %s", code, tc.code, stderr.String())
			}
			if !strings.Contains(stderr.String(), tc.stderr) {
				t.Errorf("stderr %q does not contain %q", stderr.String(), tc.stderr)
			}
			if stdout.Len() != 0 {
				t.Errorf("stdout %q, want nothing", stdout.String())
			}
		})
	}
}
