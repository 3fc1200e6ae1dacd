package agent

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests when a goroutine outlives them: work a boot started (the kubelet's
// supervisor, the seal's refresh, the join service and its watches) that the boot did not stop.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
