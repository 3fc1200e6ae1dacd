package attest

import (
	"os"
	"strings"
	"syscall"
	"testing"
)

// TestOpenDeviceBlocking opens a pollable character device as OpenTPM opens /dev/tpmrm0 and finds the
// descriptor blocking, where os.OpenFile leaves it non-blocking (the TPM driver's asynchronous mode).
func TestOpenDeviceBlocking(t *testing.T) {
	const pollable = "/dev/ptmx"
	nonblocking := func(f *os.File) bool {
		t.Helper()
		raw, err := f.SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		var flags uintptr
		var errno syscall.Errno
		if err := raw.Control(func(fd uintptr) { flags, _, errno = syscall.Syscall(syscall.SYS_FCNTL, fd, syscall.F_GETFL, 0) }); err != nil || errno != 0 {
			t.Fatal(err, errno)
		}
		return flags&syscall.O_NONBLOCK != 0
	}
	plain, err := os.OpenFile(pollable, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	if !nonblocking(plain) {
		t.Fatalf("os.OpenFile(%s) is blocking: this test no longer shows what openDevice avoids", pollable)
	}
	f, err := openDevice(pollable)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if nonblocking(f) {
		t.Errorf("openDevice(%s) is non-blocking: the TPM driver would run commands asynchronously", pollable)
	}
	if _, err := openDevice("/dev/no-such-tpm"); err == nil || !strings.Contains(err.Error(), "/dev/no-such-tpm") {
		t.Errorf("openDevice of a missing device: %v", err)
	}
}
