// Package attest proves and checks what a machine runs with its TPM.
//
// A Prover sits next to the TPM: it offers the TPM's endorsement key certificate, a fresh attestation key
// with the TPM's statement of how that key was made, and a quote over PCR values. A Verifier checks all of
// it: the EK certificate chains to a configured root, the attestation key is a restricted key that the TPM
// itself created, the quote is signed by that key over the expected nonce, and — by credential activation —
// that the attestation key lives in the same TPM as the endorsement key. Without that last step any key
// could claim to be an attestation key of any certified TPM.
//
// The nonce is never chosen by either side: both derive it from the TLS connection the evidence travels
// on (see Nonce), so a quote made for one connection is worthless on another.
package attest

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"syscall"

	gattest "github.com/google/go-attestation/attest"
	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"
)

// DefaultDevice is the kernel's TPM resource manager, which lets several processes share the TPM.
const DefaultDevice = "/dev/tpmrm0"

// eventLogPath is where the kernel exposes the firmware's measurement log.
const eventLogPath = "/sys/kernel/security/tpm0/binary_bios_measurements"

// TPM is an open TPM: go-attestation's view of it for keys and quotes, and the raw command channel under it
// for the commands go-attestation does not offer (sealing). Both share one connection, since swtpm serves
// one connection at a time; Prover serializes their use.
type TPM struct {
	*gattest.TPM
	raw transport.TPM
}

// OpenTPM opens the TPM named by device: a character device such as /dev/tpmrm0, "unix:/path" for swtpm's
// unixio server, or "tcp:host:port" for swtpm's TCP server.
func OpenTPM(device string) (*TPM, error) {
	if device == "" {
		device = DefaultDevice
	}
	var rwc io.ReadWriteCloser
	var err error
	switch {
	case strings.HasPrefix(device, "unix:"):
		rwc, err = net.Dial("unix", strings.TrimPrefix(device, "unix:"))
	case strings.HasPrefix(device, "tcp:"):
		rwc, err = net.Dial("tcp", strings.TrimPrefix(device, "tcp:"))
	default:
		rwc, err = openDevice(device)
	}
	if err != nil {
		return nil, fmt.Errorf("opening TPM %s: %w", device, err)
	}
	raw := transport.FromReadWriter(rwc)
	if err := flushLeftovers(raw); err != nil {
		rwc.Close()
		return nil, fmt.Errorf("opening TPM %s: %w", device, err)
	}
	tpm, err := gattest.OpenTPM(&gattest.OpenConfig{CommandChannel: channel{rwc}})
	if err != nil {
		rwc.Close()
		return nil, fmt.Errorf("opening TPM %s: %w", device, err)
	}
	return &TPM{TPM: tpm, raw: raw}, nil
}

// flushLeftovers flushes the objects and sessions a killed process left loaded. A TPM behind no resource
// manager (swtpm on a socket, /dev/tpm0) keeps them, and has room for only a few: an agent killed while it
// sealed would leave the next one unable to load its keys. Behind the kernel's resource manager
// (/dev/tpmrm0) a connection sees only its own handles, none at first, so this does nothing there.
func flushLeftovers(tpm transport.TPM) error {
	for _, kind := range []tpm2.TPMHT{tpm2.TPMHTTransient, tpm2.TPMHTLoadedSession} {
		rsp, err := tpm2.GetCapability{Capability: tpm2.TPMCapHandles, Property: uint32(kind) << 24, PropertyCount: 64}.Execute(tpm)
		if err != nil {
			return fmt.Errorf("listing loaded handles: %w", err)
		}
		handles, err := rsp.CapabilityData.Data.Handles()
		if err != nil {
			return fmt.Errorf("listing loaded handles: %w", err)
		}
		for _, h := range handles.Handle {
			if h>>24 != tpm2.TPMHandle(kind) {
				break
			}
			if _, err := (tpm2.FlushContext{FlushHandle: h}).Execute(tpm); err != nil {
				return fmt.Errorf("flushing handle %#x left loaded: %w", uint32(h), err)
			}
		}
	}
	return nil
}

// openDevice opens a TPM character device in blocking mode. os.OpenFile would make it non-blocking for
// Go's poller, and the kernel's TPM driver then runs each command asynchronously: a read that comes before
// the response returns nothing, the command fails, and the file stays busy (EBUSY) for every command
// after it. Seen on a TCG guest, where the driver's work queue is slow to run. Blocking, each command runs
// within write and its response is there for the read.
func openDevice(path string) (*os.File, error) {
	fd, err := syscall.Open(path, syscall.O_RDWR|syscall.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	// NewFile keeps a blocking descriptor out of the poller.
	return os.NewFile(uintptr(fd), path), nil
}

// channel hands go-attestation a command stream plus the firmware event log, where the kernel offers one.
type channel struct{ io.ReadWriteCloser }

func (channel) MeasurementLog() ([]byte, error) {
	log, err := os.ReadFile(eventLogPath)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	return log, err
}
