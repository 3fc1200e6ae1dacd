package initclient

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/attest"
)

// The exchange itself runs against a real init server and swtpm in nodeagent/internal/initserver's tests;
// these cover what is refused before any connection.

func TestConfigRefusedBeforeDialing(t *testing.T) {
	valid := func() Config {
		return Config{
			Endpoint:     "127.0.0.1:1",
			Verifier:     attest.NewVerifier(attest.NewCertChain(nil, nil, nil)),
			ExpectedPCRs: map[int][]byte{9: make([]byte, 32), 4: make([]byte, 32)},
			Request:      &berthv1.InitRequest{InitSecret: []byte("secret")},
		}
	}
	cfg := valid()
	pcrs, err := cfg.check()
	if err != nil || len(pcrs) != 2 || pcrs[0] != 4 || pcrs[1] != 9 {
		t.Fatalf("check() = %v, %v; want [4 9]", pcrs, err)
	}

	for _, tc := range []struct {
		name   string
		change func(*Config)
		want   string
	}{
		{"no endpoint", func(c *Config) { c.Endpoint = "" }, "no endpoint"},
		{"no verifier", func(c *Config) { c.Verifier = nil }, "no verifier"},
		{"no request", func(c *Config) { c.Request = nil }, "no init request"},
		{"no init secret", func(c *Config) { c.Request = &berthv1.InitRequest{MasterSecret: make([]byte, 32)} }, "no init secret"},
		{"no expected PCRs", func(c *Config) { c.ExpectedPCRs = nil }, "no expected PCR values"},
		{"PCR 24", func(c *Config) { c.ExpectedPCRs[24] = make([]byte, 32) }, "PCR index 24 is out of range"},
		{"negative PCR", func(c *Config) { c.ExpectedPCRs[-1] = make([]byte, 32) }, "PCR index -1 is out of range"},
		{"SHA-1 value", func(c *Config) { c.ExpectedPCRs[7] = make([]byte, 20) }, "PCR 7 has 20 bytes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := valid()
			tc.change(&cfg)
			// The endpoint is never dialed: nothing listens on port 1, and a dial error would read differently.
			_, err := Init(context.Background(), cfg)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

func TestMeasurementError(t *testing.T) {
	for _, tc := range []struct {
		err  *MeasurementError
		want string
	}{
		{&MeasurementError{PCR: 9, Expected: bytes.Repeat([]byte{0x3d, 0x45}, 16), Got: bytes.Repeat([]byte{0x77, 0xaa}, 16)},
			"PCR 9: expected " + strings.Repeat("3d45", 16) + ", got " + strings.Repeat("77aa", 16)},
		{&MeasurementError{PCR: 4, Expected: []byte{0x01}}, "PCR 4: expected 01, got no value"},
	} {
		if got := tc.err.Error(); got != tc.want {
			t.Errorf("Error() = %q, want %q", got, tc.want)
		}
	}
}
