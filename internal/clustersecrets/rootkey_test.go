package clustersecrets

import (
	"bytes"
	"encoding/base64"
	"strings"
	"testing"
)

func TestParseRootKey(t *testing.T) {
	key := []byte{0xfb, 0xff, 0xfe} // encodes with '+' and '/' (std) or '-' and '_' (URL)
	key = append(key, bytes.Repeat([]byte{0x5a}, 30)...)
	for _, tt := range []struct {
		name, text string
	}{
		{"std padded", base64.StdEncoding.EncodeToString(key[:32])},
		{"std unpadded", base64.RawStdEncoding.EncodeToString(key[:32])},
		{"url padded", base64.URLEncoding.EncodeToString(key[:32])},
		{"url unpadded", base64.RawURLEncoding.EncodeToString(key[:32])},
		{"trailing newline", base64.StdEncoding.EncodeToString(key[:32]) + "\n"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseRootKey(tt.text)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, key[:32]) {
				t.Errorf("decoded %x, want %x", got, key[:32])
			}
		})
	}
	if got, err := ParseRootKey(base64.StdEncoding.EncodeToString(key)); err != nil || !bytes.Equal(got, key) {
		t.Errorf("33-byte key: %x, %v", got, err)
	}
}

func TestParseRootKeyRefuses(t *testing.T) {
	short := base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{7}, 31))
	mixed := base64.RawStdEncoding.EncodeToString(bytes.Repeat([]byte{0xfb, 0xff}, 16))[:40] + "-_"
	for _, tt := range []struct {
		name, text, want string
	}{
		{"empty", "  ", "empty"},
		{"short", short, "decodes to 31 bytes, want at least 32"},
		{"not base64", "this is my secret passphrase!!", "not base64"},
		{"mixed alphabets", mixed, "not base64"},
		{"huge", strings.Repeat("A", 5000), "more than 4096"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseRootKey(tt.text)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want one containing %q", err, tt.want)
			}
			if trimmed := strings.TrimSpace(tt.text); trimmed != "" && strings.Contains(err.Error(), trimmed[:8]) {
				t.Errorf("error %q echoes the root key", err)
			}
		})
	}
}
