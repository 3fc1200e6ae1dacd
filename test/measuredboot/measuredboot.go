// Package measuredboot boots a unified kernel image (UKI) the way a cloud's UEFI VM with a vTPM boots it:
// QEMU (TCG: this host has no KVM) with OVMF as firmware, a swtpm as the TPM, and the UKI as the only boot
// option, on an EFI system partition at the removable-media path, or a raw disk image holding such a
// partition. Tests compare what the TPM measured on that boot with Berth's prediction (internal/measure).
package measuredboot

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/berthlabs/berth/test/gobuild"
)

// Firmware is OVMF from Debian's ovmf package: code and the template of its variable store.
const (
	FirmwareCode = "/usr/share/OVMF/OVMF_CODE_4M.fd"
	FirmwareVars = "/usr/share/OVMF/OVMF_VARS_4M.fd"
)

// Machine is one boot.
type Machine struct {
	// UKI is the image to boot, from an EFI system partition made for it.
	UKI string
	// Disk, if set, is a raw disk image booted instead of UKI, such as the berth-uki builder's: it must
	// hold its own EFI system partition. It is attached read-only, so the boot leaves it as it was.
	Disk string
	// Dir receives the ESP, the TPM state, the variable store and the logs.
	Dir string
	// Console, if set, receives the serial console as the machine writes it.
	Console io.Writer
	// TPMState, if set, is the swtpm state directory the machine boots with, such as one manufactured with
	// an EK certificate (test/swtpm); otherwise its TPM starts empty, in Dir.
	TPMState string
	// Disks are raw disk images attached read-write after the boot disk: /dev/vdb, /dev/vdc, … in the guest.
	Disks []string
	// Overlay, if set, makes Disk writable as an instance's copy of its image is: the machine writes to this
	// qcow2 file (made at the first boot, kept for the next), and Disk stays as it was.
	Overlay string
	// Forwards, if any, give the machine a network: QEMU's user network (the guest is 10.0.2.15, its
	// gateway 10.0.2.2), restricted so that the guest reaches nothing but these forwards.
	Forwards []Forward
	// Tap, if set, gives the machine a network card on a host bridge instead.
	Tap *Tap
	// Memory is the machine's memory in MiB; 1024 if zero. CPUs is its number of processors; 1 if zero.
	Memory, CPUs int
}

// Tap is a network card on a host bridge, through a tap device QEMU makes for the boot and removes after it.
type Tap struct {
	Name   string // the tap device: at most 15 bytes
	Bridge string
	MAC    string
}

// Forward makes a TCP address in the guest's network lead to one on the host: each connection the guest
// opens to Guest runs socat to Host.
type Forward struct {
	Guest netip.AddrPort // in 10.0.2.0/24
	Host  string         // host:port
}

// Boot boots m until the guest powers off or ctx ends, and returns its serial console output.
func (m Machine) Boot(ctx context.Context) (string, error) {
	tools := []string{"qemu-system-x86_64", "swtpm"}
	if len(m.Forwards) > 0 {
		tools = append(tools, "socat")
	}
	if m.Overlay != "" {
		tools = append(tools, "qemu-img")
	}
	if len(m.Forwards) > 0 && m.Tap != nil {
		return "", errors.New("a machine has either forwards on QEMU's user network or a tap, not both")
	}
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			return "", fmt.Errorf("%s not found: run make deps (installs qemu-system-x86, ovmf, swtpm and socat)", tool)
		}
	}
	for _, f := range []string{FirmwareCode, FirmwareVars} {
		if _, err := os.Stat(f); err != nil {
			return "", fmt.Errorf("OVMF firmware: %w (run make deps: installs ovmf)", err)
		}
	}
	drive := "readonly=on,format=raw,file=" + m.Disk
	if m.Overlay != "" {
		if err := makeOverlay(ctx, m.Disk, m.Overlay); err != nil {
			return "", err
		}
		drive = "format=qcow2,file=" + m.Overlay
	}
	if m.Disk == "" {
		boot := filepath.Join(m.Dir, "esp", "EFI", "BOOT")
		if err := os.MkdirAll(boot, 0o755); err != nil {
			return "", err
		}
		if err := copyFile(m.UKI, filepath.Join(boot, "BOOTX64.EFI")); err != nil {
			return "", err
		}
		drive = "readonly=on,format=raw,file=fat:" + filepath.Join(m.Dir, "esp")
	} else if err := os.MkdirAll(m.Dir, 0o755); err != nil {
		return "", err
	}
	vars := filepath.Join(m.Dir, "OVMF_VARS.fd")
	if err := copyFile(FirmwareVars, vars); err != nil {
		return "", err
	}
	tpmDir := m.TPMState
	if tpmDir == "" {
		tpmDir = filepath.Join(m.Dir, "tpm")
		if err := os.MkdirAll(tpmDir, 0o700); err != nil {
			return "", err
		}
	}
	// A unix socket's path is limited to 108 bytes; Dir is usually short, a test's TPM state not always.
	ctrl := filepath.Join(m.Dir, "tpm-ctrl.sock")
	// The firmware starts the TPM (TPM2_Startup) and measures into it; swtpm ends with the connection.
	tpm := exec.CommandContext(ctx, "swtpm", "socket", "--tpm2", "--tpmstate", "dir="+tpmDir,
		"--ctrl", "type=unixio,path="+ctrl, "--terminate", "--log", "file="+filepath.Join(m.Dir, "swtpm.log"))
	if err := tpm.Start(); err != nil {
		return "", fmt.Errorf("swtpm: %w", err)
	}
	defer tpm.Wait()
	defer tpm.Process.Kill()
	if err := waitForFile(ctrl, 10*time.Second); err != nil {
		return "", fmt.Errorf("swtpm did not make its control socket: %w", err)
	}

	var console bytes.Buffer
	var out io.Writer = &console
	if m.Console != nil {
		out = io.MultiWriter(&console, m.Console)
	}
	args := []string{
		"-machine", "q35", "-accel", "tcg", "-m", strconv.Itoa(cmp.Or(m.Memory, 1024)), "-smp", strconv.Itoa(cmp.Or(m.CPUs, 1)),
		// Only the devices below: OVMF then tries no other boot option first, so PCR 4 holds exactly
		// the UKI's boot.
		"-nodefaults", "-nographic", "-serial", "stdio", "-no-reboot",
		"-drive", "if=pflash,format=raw,unit=0,readonly=on,file=" + FirmwareCode,
		"-drive", "if=pflash,format=raw,unit=1,file=" + vars,
		"-chardev", "socket,id=chrtpm,path=" + ctrl,
		"-tpmdev", "emulator,id=tpm0,chardev=chrtpm",
		"-device", "tpm-tis,tpmdev=tpm0",
		"-drive", "if=none,id=esp," + drive,
		"-device", "virtio-blk-pci,drive=esp,bootindex=0",
	}
	for i, d := range m.Disks {
		args = append(args, "-drive", fmt.Sprintf("if=none,id=disk%d,format=raw,file=%s", i, d),
			"-device", fmt.Sprintf("virtio-blk-pci,drive=disk%d", i))
	}
	if len(m.Forwards) > 0 {
		netdev := "user,id=net0,net=10.0.2.0/24,restrict=on"
		for _, f := range m.Forwards {
			if strings.ContainsAny(f.Host, ", ") {
				return "", fmt.Errorf("forward to %q: want host:port", f.Host)
			}
			netdev += fmt.Sprintf(",guestfwd=tcp:%s-cmd:socat - TCP:%s", f.Guest, f.Host)
		}
		args = append(args, "-netdev", netdev, "-device", "virtio-net-pci,netdev=net0")
	}
	if t := m.Tap; t != nil {
		if len(t.Name) > 15 || strings.ContainsAny(t.Name+t.Bridge+t.MAC, ", /") {
			return "", fmt.Errorf("tap %q on bridge %q with MAC %q: want a device name of at most 15 bytes, and no commas, spaces or slashes", t.Name, t.Bridge, t.MAC)
		}
		// QEMU runs this with the tap's name once it has made the device.
		up := filepath.Join(m.Dir, "tap-up")
		if err := os.WriteFile(up, []byte("#!/bin/sh\nexec ip link set \"$1\" master "+t.Bridge+" up\n"), 0o755); err != nil {
			return "", err
		}
		args = append(args, "-netdev", fmt.Sprintf("tap,id=net0,ifname=%s,script=%s,downscript=no", t.Name, up),
			"-device", "virtio-net-pci,netdev=net0,mac="+t.MAC)
	}
	qemu := exec.CommandContext(ctx, "qemu-system-x86_64", args...)
	qemu.Stdout, qemu.Stderr = out, out
	err := qemu.Run()
	if ctx.Err() != nil {
		return console.String(), fmt.Errorf("the machine did not power off in time: %w", ctx.Err())
	}
	if err != nil {
		return console.String(), fmt.Errorf("qemu: %w", err)
	}
	return console.String(), nil
}

// makeOverlay makes a qcow2 overlay of the raw disk at path, unless an earlier boot made it.
func makeOverlay(ctx context.Context, disk, path string) error {
	if _, err := os.Stat(path); err == nil {
		return nil
	}
	out, err := exec.CommandContext(ctx, "qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", disk, path).CombinedOutput()
	if err != nil {
		return fmt.Errorf("qemu-img create %s: %w: %s", path, err, bytes.TrimSpace(out))
	}
	return nil
}

// BuildInit builds pcrinit, the initrd init that prints the PCRs a boot measured, as a static binary in dir
// and returns its path.
func BuildInit(dir string) (string, error) {
	init := filepath.Join(dir, "pcrinit")
	if err := gobuild.Build(context.Background(), "", "github.com/berthlabs/berth/test/measuredboot/pcrinit", init, ""); err != nil {
		return "", fmt.Errorf("building pcrinit: %w", err)
	}
	return init, nil
}

// PCRs are the values the guest's pcrinit printed ("BERTH-PCR <index> <hex>"); an error says what the guest
// reported instead.
func PCRs(console string) (map[int][]byte, error) {
	pcrs := map[int][]byte{}
	sc := bufio.NewScanner(strings.NewReader(console))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if msg, ok := strings.CutPrefix(line, "BERTH-PCR-ERROR "); ok {
			return nil, fmt.Errorf("the guest could not read its PCRs: %s", msg)
		}
		f := strings.Fields(line)
		if len(f) != 3 || f[0] != "BERTH-PCR" {
			continue
		}
		i, err := strconv.Atoi(f[1])
		if err != nil {
			return nil, fmt.Errorf("console line %q: %w", line, err)
		}
		if pcrs[i], err = hex.DecodeString(f[2]); err != nil {
			return nil, fmt.Errorf("console line %q: %w", line, err)
		}
	}
	if len(pcrs) == 0 {
		return nil, errors.New("the guest printed no PCR values")
	}
	return pcrs, nil
}

func copyFile(src, dst string) error {
	data, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	return os.WriteFile(dst, data, 0o644)
}

func waitForFile(path string, timeout time.Duration) error {
	for deadline := time.Now().Add(timeout); ; time.Sleep(20 * time.Millisecond) {
		if _, err := os.Stat(path); err == nil {
			return nil
		} else if time.Now().After(deadline) {
			return err
		}
	}
}
