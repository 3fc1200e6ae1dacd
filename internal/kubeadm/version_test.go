package kubeadm

import (
	"strings"
	"testing"
)

func TestUpgradeStep(t *testing.T) {
	for _, tt := range []struct {
		from, to string
		want     Step
		err      string
	}{
		{from: "v1.36.3", to: "v1.36.3", want: StepNone},
		{from: "v1.36.1", to: "v1.36.3", want: StepPatch},
		{from: "v1.35.4", to: "v1.36.3", want: StepMinor},
		{from: "v1.36.3", to: "v1.37.0-rc.1", want: StepMinor},
		{from: "v1.37.0-rc.1", to: "v1.37.0", want: StepPatch},
		{from: "v1.36.3", to: "v1.36.1", err: "v1.36.3 to v1.36.1 is a downgrade"},
		{from: "v1.36.3", to: "v1.35.4", err: "is a downgrade"},
		{from: "v1.37.0", to: "v1.37.0-rc.1", err: "is a downgrade"},
		{from: "v1.35.4", to: "v1.37.2", err: "skips a minor: kubeadm upgrades one minor at a time, so go to v1.36 first, then to v1.37"},
		{from: "v1.36.3", to: "v2.0.0", err: "changes the major version"},
		{from: "1.36.3", to: "v1.36.4", err: `"1.36.3" is not a Kubernetes release`},
		{from: "v1.36.3", to: "v1.37", err: `"v1.37" is not a Kubernetes release`},
	} {
		got, err := UpgradeStep(tt.from, tt.to)
		switch {
		case tt.err == "" && err != nil:
			t.Errorf("UpgradeStep(%s, %s): %v", tt.from, tt.to, err)
		case tt.err != "" && (err == nil || !strings.Contains(err.Error(), tt.err)):
			t.Errorf("UpgradeStep(%s, %s) = %v, %v; want an error with %q", tt.from, tt.to, got, err, tt.err)
		case tt.err == "" && got != tt.want:
			t.Errorf("UpgradeStep(%s, %s) = %v, want %v", tt.from, tt.to, got, tt.want)
		}
	}
}

func TestMinorsAhead(t *testing.T) {
	for _, tt := range []struct {
		a, b string
		want int
	}{
		{"v1.36.3", "v1.36.1", 0},
		{"v1.37.0", "v1.36.3", 1},
		{"v1.32.9", "v1.36.3", -4},
	} {
		if got, err := MinorsAhead(tt.a, tt.b); err != nil || got != tt.want {
			t.Errorf("MinorsAhead(%s, %s) = %d, %v; want %d", tt.a, tt.b, got, err, tt.want)
		}
	}
	for _, bad := range [][2]string{{"v2.0.0", "v1.36.3"}, {"v1.36", "v1.36.3"}, {"v1.36.3", ""}} {
		if got, err := MinorsAhead(bad[0], bad[1]); err == nil {
			t.Errorf("MinorsAhead(%q, %q) = %d, want an error", bad[0], bad[1], got)
		}
	}
}
