//go:build failpoint

package failpoint

import (
	"fmt"
	"os"
	"syscall"
)

// Enabled says whether this build honours BERTH_FAILPOINT.
const Enabled = true

// Crash kills the process with SIGKILL if BERTH_FAILPOINT names point.
func Crash(point string) {
	if os.Getenv(EnvVar) != point {
		return
	}
	fmt.Fprintf(os.Stderr, "failpoint %s: killing the process\n", point)
	syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {}
}
