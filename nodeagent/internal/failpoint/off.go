//go:build !failpoint

package failpoint

// Enabled says whether this build honours BERTH_FAILPOINT.
const Enabled = false

// Crash does nothing in builds without the failpoint tag.
func Crash(string) {}
