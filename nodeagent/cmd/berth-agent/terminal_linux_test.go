package main

import (
	"bytes"
	"encoding/json"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// openPTY opens a pseudo-terminal: the process given its second end sees a terminal, as when a person
// runs berth-agent by hand.
func openPTY(t *testing.T) (ptm, pts *os.File) {
	t.Helper()
	ptm, err := os.OpenFile("/dev/ptmx", os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		t.Fatalf("opening a pseudo-terminal: %v", err)
	}
	t.Cleanup(func() { ptm.Close() })
	if err := unix.IoctlSetPointerInt(int(ptm.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		t.Fatalf("unlocking the pseudo-terminal: %v", err)
	}
	n, err := unix.IoctlGetInt(int(ptm.Fd()), unix.TIOCGPTN)
	if err != nil {
		t.Fatalf("naming the pseudo-terminal: %v", err)
	}
	pts, err = os.OpenFile("/dev/pts/"+strconv.Itoa(n), os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		t.Fatalf("opening the pseudo-terminal's other end: %v", err)
	}
	return ptm, pts
}

// runOnTerminal runs the binary with stderr on a terminal and stdout on a pipe; controlling makes the
// terminal the process's controlling one, as a login's is, where without it the terminal is like the
// serial console an image's init passes on.
func runOnTerminal(t *testing.T, controlling bool, bin string, args ...string) result {
	t.Helper()
	ptm, pts := openPTY(t)
	var stdout bytes.Buffer
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = &stdout, pts
	if controlling {
		// Ctty is a descriptor of the child's: its stderr.
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 2}
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pts.Close()
	// The terminal's reads end with EIO once the process, its last user, has exited.
	read := make(chan []byte)
	go func() {
		b, _ := io.ReadAll(ptm)
		read <- b
	}()
	code := exitCode(t, cmd.Wait())
	// The terminal turns each newline into CR LF.
	stderr := strings.ReplaceAll(string(<-read), "\r\n", "\n")
	return result{code: code, stdout: stdout.String(), stderr: stderr}
}

// TestTerminalErrors: on the terminal a person typed the command at, boot and joinservice say what stopped
// them in a sentence, the configuration's problems one a line, where under systemd they log a JSON event
// (TestCommandLine), as they do on a console that is no one's controlling terminal.
func TestTerminalErrors(t *testing.T) {
	bin := buildAgent(t)
	dir := t.TempDir()
	bad := writeFile(t, dir, "agent.yaml", "metadataURL: http://127.0.0.1:1\nstatedisk: /dev/null\nretryMax: 5\n")
	missing := dir + "/absent.yaml"
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	cases := []struct {
		name   string
		args   []string
		code   int
		stderr string
	}{
		{name: "boot with a wrong configuration", args: []string{"boot", "--config", bad}, code: 3,
			stderr: "berth-agent boot: parsing agent configuration " + bad + ":\n" +
				"  line 2: unknown field \"statedisk\" (keys are case-sensitive: did you mean \"stateDisk\"?)\n" +
				"  line 3: retryMax: a duration such as 5s or 1m30s, not 5\n"},
		{name: "joinservice without configuration", args: []string{"joinservice", "--config", missing}, code: 3,
			stderr: "berth-agent joinservice: reading agent configuration: open " + missing + ": no such file or directory\n"},
		{name: "joinservice without service configuration", args: []string{"joinservice", "--service-config", missing}, code: 3,
			stderr: "berth-agent joinservice: reading join service configuration: open " + missing + ": no such file or directory\n"},
		{name: "status without configuration", args: []string{"status", "--config", missing}, code: 3,
			stderr: "berth-agent status: reading agent configuration: open " + missing + ": no such file or directory\n"},
		{name: "debug listener on a taken address", args: []string{"boot", "--config", missing, "--debug-listen", taken.Addr().String()}, code: 1,
			stderr: "berth-agent boot: --debug-listen: listen tcp " + taken.Addr().String() + ": bind: address already in use\n"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := runOnTerminal(t, true, bin, tc.args...)
			if r.code != tc.code || !strings.HasPrefix(r.stderr, tc.stderr) {
				t.Errorf("exit code %d, stderr:\n%s\nwant %d, stderr starting:\n%s", r.code, r.stderr, tc.code, tc.stderr)
			}
		})
	}
	t.Run("console of an image's init", func(t *testing.T) {
		r := runOnTerminal(t, false, bin, "boot", "--config", bad)
		var event struct{ Level, Msg, Error string }
		if err := json.Unmarshal([]byte(r.stderr), &event); err != nil {
			t.Fatalf("stderr %q is not one JSON event: %v", r.stderr, err)
		}
		if r.code != 3 || event.Msg != "configuration" || !strings.HasPrefix(event.Error, "parsing agent configuration "+bad+":\n  line 2: unknown field") {
			t.Errorf("exit code %d, event %+v; want 3 and the configuration's problems", r.code, event)
		}
	})
}
