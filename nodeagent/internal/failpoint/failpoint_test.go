package failpoint

import (
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
)

// TestCrash builds a program with and without the failpoint tag and runs it with BERTH_FAILPOINT set: the
// failpoint build dies by SIGKILL at that point and only there, the plain build runs through.
func TestCrash(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		tags       []string
		wantKilled bool
	}{{nil, false}, {[]string{"-tags", "failpoint"}, true}} {
		bin := dir + "/prog"
		build := exec.Command("go", append(append([]string{"build"}, tc.tags...), "-o", bin, "./testdata/crash")...)
		if out, err := build.CombinedOutput(); err != nil {
			t.Fatalf("go build %v: %v\n%s", tc.tags, err, out)
		}
		cmd := exec.Command(bin)
		cmd.Env = append(os.Environ(), EnvVar+"=here")
		out, err := cmd.Output()
		killed := err != nil && cmd.ProcessState.Sys().(syscall.WaitStatus).Signal() == syscall.SIGKILL
		if killed != tc.wantKilled {
			t.Errorf("build %v: killed %v (%v), want %v; output %q", tc.tags, killed, err, tc.wantKilled, out)
		}
		if got := strings.Contains(string(out), "after"); got == tc.wantKilled {
			t.Errorf("build %v: output %q", tc.tags, out)
		}
	}
}
