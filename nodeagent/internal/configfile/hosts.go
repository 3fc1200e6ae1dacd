package configfile

import (
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
)

// CheckHostPort refuses an address that a listener or a dialer would refuse only when it is first used: it
// must be host:port with a numeric, non-zero port, and a host that is an IP address or a DNS name. An empty
// host (every address) is accepted only where emptyHost is true. example shows the form in the error.
func CheckHostPort(name, addr, example string, emptyHost bool) error {
	host, port, err := net.SplitHostPort(addr)
	n, perr := strconv.ParseUint(port, 10, 16)
	switch {
	case err != nil || perr != nil || (host == "" && !emptyHost) || (host != "" && !ValidHost(host)):
		return fmt.Errorf("%s: %q is not host:port (such as %s)", name, addr, example)
	case n == 0:
		return fmt.Errorf("%s: %q has port 0: what connects to it needs a port it knows", name, addr)
	}
	return nil
}

// ValidHost says whether host is an IP address or a DNS name (RFC 1123 labels).
func ValidHost(host string) bool {
	if _, err := netip.ParseAddr(host); err == nil {
		return true
	}
	if len(host) > 253 {
		return false
	}
	for _, label := range strings.Split(strings.TrimSuffix(host, "."), ".") {
		if len(label) == 0 || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return false
		}
		for _, r := range label {
			if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-') {
				return false
			}
		}
	}
	return true
}
