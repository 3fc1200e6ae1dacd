package measuredboot

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/measure"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/internal/uki/ukitest"
)

// TestPredictionMatchesBoot boots a real UKI (Debian's systemd-stub and kernel, an initrd whose init reads
// the PCRs) under OVMF with a swtpm and checks that PCR 4, 9, 11 and 12 hold exactly what internal/measure
// predicted from the file. A UKI with one byte changed in its command line is predicted, and measured,
// differently, and a join policy that admits only the first image's prediction refuses what the second
// boot measured, naming the PCR, expected and got.
func TestPredictionMatchesBoot(t *testing.T) {
	parts := ukitest.BootParts(t)
	dir := t.TempDir()
	init, err := BuildInit(dir)
	if err != nil {
		t.Fatal(err)
	}
	initData, err := os.ReadFile(init)
	if err != nil {
		t.Fatal(err)
	}
	kernel, err := os.ReadFile(parts.Kernel)
	if err != nil {
		t.Fatal(err)
	}
	uki := func(cmdline string) string {
		return ukitest.Build(t, parts.Stub,
			ukitest.Section{Name: ".osrel", Data: []byte("ID=berth\nVERSION_ID=measured-boot-test\n")},
			ukitest.Section{Name: ".cmdline", Data: []byte(cmdline)},
			ukitest.Section{Name: ".linux", Data: kernel},
			ukitest.Section{Name: ".initrd", Data: ukitest.CpioExecutable("init", initData)},
		)
	}
	images := map[string]string{
		"base":    uki("console=ttyS0 panic=-1 quiet"),
		"changed": uki("console=ttyS0 panic=-2 quiet"),
	}
	measured := map[string]map[int][]byte{}
	predictions := map[string]*measure.Result{}
	for _, name := range []string{"base", "changed"} {
		predicted, err := measure.PredictFile(images[name])
		if err != nil {
			t.Fatal(err)
		}
		predictions[name] = predicted
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		start := time.Now()
		console, err := Machine{UKI: images[name], Dir: filepath.Join(dir, name)}.Boot(ctx)
		cancel()
		if err != nil {
			t.Fatalf("%s: %v\n--- console ---\n%s", name, err, tail(console, 40))
		}
		got, err := PCRs(console)
		if err != nil {
			t.Fatalf("%s: %v\n--- console ---\n%s", name, err, tail(console, 40))
		}
		t.Logf("%s: booted and read the PCRs in %.1fs", name, time.Since(start).Seconds())
		if mismatches := predicted.Compare(got); len(mismatches) > 0 {
			for _, m := range mismatches {
				t.Errorf("%s: %v", name, m)
			}
		}
		measured[name] = got
	}
	for _, pcr := range []int{4, 9, 11} {
		if string(measured["base"][pcr]) == string(measured["changed"][pcr]) {
			t.Errorf("PCR %d is the same for both command lines", pcr)
		}
	}

	img := policy.Image{Name: "berth-measured", Roles: []metadata.Role{metadata.RoleWorker}, PCRs: predictions["base"].Values()}
	pol := &policy.Policy{Images: []policy.Image{img}}
	if got, err := pol.Check(metadata.RoleWorker, measured["base"], time.Now()); err != nil || got.Name != img.Name {
		t.Errorf("the policy of the prediction refuses the boot it predicted: %q, %v", got.Name, err)
	}
	_, err = pol.Check(metadata.RoleWorker, measured["changed"], time.Now())
	var mismatch *policy.MismatchError
	if !errors.As(err, &mismatch) || mismatch.PCR != 4 || !bytes.Equal(mismatch.Expected, img.PCRs[4]) ||
		!bytes.Equal(mismatch.Got, measured["changed"][4]) || !strings.Contains(err.Error(), "PCR 4") {
		t.Errorf("the changed image's boot: %v, want a refusal naming PCR 4 with the predicted and the measured value", err)
	}
	t.Logf("the changed image is refused: %v", err)
}

func tail(s string, lines int) string {
	all := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(all[max(0, len(all)-lines):], "\n")
}
