package agent

import (
	"crypto/x509"
	"testing"
	"time"
)

func TestRenewAt(t *testing.T) {
	start := time.Date(2026, 11, 25, 0, 0, 0, 0, time.UTC)
	cert := &x509.Certificate{NotBefore: start, NotAfter: start.Add(24 * time.Hour)}
	if got, want := renewAt(cert), start.Add(16*time.Hour); !got.Equal(want) {
		t.Errorf("renewAt of a day-long certificate = %v, want %v", got, want)
	}
}
