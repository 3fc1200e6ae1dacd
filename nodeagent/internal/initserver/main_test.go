package initserver

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests when a goroutine outlives them: a server, stream or retry loop that
// a test started and the code under test did not stop.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
