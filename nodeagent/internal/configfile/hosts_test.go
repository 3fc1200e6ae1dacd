package configfile

import (
	"strings"
	"testing"
)

func TestCheckHostPort(t *testing.T) {
	for _, tc := range []struct {
		addr      string
		emptyHost bool
		want      string // "" for accepted
	}{
		{"10.0.0.10:6443", false, ""},
		{"api.example.com:6443", false, ""},
		{"[fd00::1]:6443", false, ""},
		{":7451", true, ""},
		{":7451", false, "is not host:port"},
		{"localhost", true, "is not host:port"},
		{"not a host!:80", true, "is not host:port"},
		{"-bad.example:80", false, "is not host:port"},
		{"10.0.0.10:http", false, "is not host:port"},
		{"10.0.0.10:65536", false, "is not host:port"},
		{"10.0.0.10:0", false, "has port 0"},
	} {
		err := CheckHostPort("x", tc.addr, "10.0.0.10:6443", tc.emptyHost)
		if (err == nil) != (tc.want == "") || (err != nil && !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("CheckHostPort(%q, emptyHost %t) = %v, want %q", tc.addr, tc.emptyHost, err, tc.want)
		}
	}
}
