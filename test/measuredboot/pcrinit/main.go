// Command pcrinit is the init of the measured-boot test's initrd: it reads the PCRs the boot measured from
// the TPM, prints them on the console for the test on the host to compare with the prediction, and powers
// the machine off. It runs as PID 1 with nothing else in the initrd, so it mounts /dev itself.
package main

import (
	"fmt"
	"os"
	"syscall"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport/linuxtpm"
)

// sysloglevelConsole is SYSLOG_ACTION_CONSOLE_LEVEL of syslog(2).
const sysloglevelConsole = 8

// pcrs are the PCRs Berth predicts for a UKI boot.
var pcrs = []uint{4, 9, 11, 12}

func main() {
	// The initrd holds no /dev/console, so the kernel gave init no output: open the console once /dev is
	// mounted. Before that, the kernel's own log is all there is.
	out := os.Stderr
	// Kernel messages on the console would land inside the lines the test parses: keep only emergencies.
	// syslog(2) takes the console level in its length argument.
	syscall.Syscall(syscall.SYS_SYSLOG, sysloglevelConsole, 0, 1)
	err := mountDev()
	if err == nil {
		if console, cerr := os.OpenFile("/dev/console", os.O_WRONLY, 0); cerr == nil {
			out = console
		}
		err = run(out)
	}
	if err != nil {
		fmt.Fprintln(out, "BERTH-PCR-ERROR", err)
	}
	fmt.Fprintln(out, "BERTH-PCR-DONE")
	syscall.Sync()
	syscall.Reboot(syscall.LINUX_REBOOT_CMD_POWER_OFF)
}

func mountDev() error {
	if err := os.MkdirAll("/dev", 0o755); err != nil {
		return err
	}
	if err := syscall.Mount("devtmpfs", "/dev", "devtmpfs", 0, ""); err != nil && err != syscall.EBUSY {
		return fmt.Errorf("mounting /dev: %w", err)
	}
	return nil
}

func run(out *os.File) error {
	tpm, err := linuxtpm.Open("/dev/tpmrm0")
	if err != nil {
		return fmt.Errorf("opening the TPM: %w", err)
	}
	defer tpm.Close()
	for _, i := range pcrs {
		res, err := tpm2.PCRRead{PCRSelectionIn: tpm2.TPMLPCRSelection{PCRSelections: []tpm2.TPMSPCRSelection{{
			Hash: tpm2.TPMAlgSHA256, PCRSelect: tpm2.PCClientCompatible.PCRs(i),
		}}}}.Execute(tpm)
		if err != nil {
			return fmt.Errorf("reading PCR %d: %w", i, err)
		}
		if len(res.PCRValues.Digests) != 1 {
			return fmt.Errorf("reading PCR %d: the TPM returned %d values", i, len(res.PCRValues.Digests))
		}
		// A fresh line first: a kernel message may have ended without one.
		fmt.Fprintf(out, "\nBERTH-PCR %d %x\n", i, res.PCRValues.Digests[0].Buffer)
	}
	return nil
}
