// Package ukiinstall is the provisioner berth-uki-install: it turns the machine being provisioned into one
// that boots a unified kernel image (UKI) whose TPM measurements berth-manifest predicts. It downloads the
// machine's own kernel, initrd, os-release and (unless configured) command line over the communicator,
// assembles the UKI on the machine Packer runs on with internal/uki, the way berth-uki does, predicts its
// PCRs with internal/measure, and installs it on the machine's EFI system partition as the removable-media
// boot loader, EFI/BOOT/BOOTX64.EFI. The machine needs nothing but a POSIX sh, readlink, cp and sha256sum.
//
// With verified_root, the image is another disk of the build machine: the machine's initramfs-tools learn to
// open a dm-verity root (initramfs/), its root file system becomes an erofs image followed by its hash tree
// on that disk, and the UKI, installed on that disk's own ESP, carries the root hash on its command line.
//
// The UKI stays on the Packer machine (output) for berth-manifest's uki: the manifest's prediction is then
// made from the very bytes installed, whatever the builder's artifact (an AMI has no files to read).
package ukiinstall

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/hashicorp/hcl/v2/hcldec"
	packersdk "github.com/hashicorp/packer-plugin-sdk/packer"

	"github.com/berthlabs/berth/internal/measure"
	ukiimage "github.com/berthlabs/berth/internal/uki"
	"github.com/berthlabs/berth/packer/internal/remote"
	"github.com/berthlabs/berth/packer/internal/verity"
)

// Provisioner is berth-uki-install.
type Provisioner struct {
	config Config
}

func (p *Provisioner) ConfigSpec() hcldec.ObjectSpec { return p.config.FlatMapstructure().HCL2Spec() }

func (p *Provisioner) Prepare(raws ...any) error { return p.config.Prepare(raws...) }

func (p *Provisioner) Provision(ctx context.Context, ui packersdk.Ui, comm packersdk.Communicator, _ map[string]any) error {
	if comm == nil {
		return errors.New("the builder gives provisioners no communicator: berth-uki-install reads the kernel from the machine being built and installs the UKI on it (ssh, or berth-uki with root_directory)")
	}
	c := &p.config
	staging := c.StagingDirectory
	if err := remote.Run(ctx, ui, comm, fmt.Sprintf("mkdir -p %s && chmod 0700 %s", remote.Quote(staging), remote.Quote(staging))); err != nil {
		return fmt.Errorf("creating the staging directory %s: %w", staging, err)
	}
	err := p.provision(ctx, ui, comm)
	if err != nil {
		// The install script removes the staging directory itself; before it runs, the copies of the
		// kernel and initrd belong to the communicator's user, who removes them.
		if cleanup := remote.Run(context.WithoutCancel(ctx), ui, comm, "rm -rf "+remote.Quote(staging)); cleanup != nil {
			ui.Error(fmt.Sprintf("removing the staging directory %s: %v", staging, cleanup))
		}
	}
	return err
}

func (p *Provisioner) provision(ctx context.Context, ui packersdk.Ui, comm packersdk.Communicator) error {
	c := &p.config
	if c.VerifiedRoot != nil {
		ui.Say("Preparing a verified root: the initrd opens it through dm-verity")
		if err := p.runScript(ctx, ui, comm, prepareScript, c.prepare()); err != nil {
			return fmt.Errorf("preparing the verified root: %w", err)
		}
	}
	if err := p.runScript(ctx, ui, comm, collectScript, c.collect()); err != nil {
		return fmt.Errorf("collecting the kernel, initrd and os-release: %w", err)
	}
	staged := []string{stagedKernel, stagedInitrd, stagedOSRelease}
	if c.Cmdline == "" {
		staged = append(staged, stagedCmdline)
	}
	files := map[string][]byte{}
	start := time.Now()
	for _, name := range staged {
		if err := ctx.Err(); err != nil {
			return err
		}
		var buf bytes.Buffer
		if err := comm.Download(path.Join(c.StagingDirectory, name), &buf); err != nil {
			return fmt.Errorf("downloading the %s: %w", name, err)
		}
		files[name] = buf.Bytes()
	}
	ui.Say(fmt.Sprintf("Downloaded the kernel (%s), initrd (%s) and os-release in %.2fs",
		mib(len(files[stagedKernel])), mib(len(files[stagedInitrd])), time.Since(start).Seconds()))

	cmdline := c.Cmdline
	if cmdline == "" {
		var err error
		if cmdline, err = ownCmdline(string(files[stagedCmdline])); err != nil {
			return err
		}
	}
	if c.VerifiedRoot != nil {
		// Last on the machine: the root file system it seals is the image, byte for byte.
		start := time.Now()
		ui.Say(fmt.Sprintf("Writing the verified root onto %s", c.VerifiedRoot.Device))
		if err := p.runScript(ctx, ui, comm, sealScript, c.seal()); err != nil {
			return fmt.Errorf("writing the verified root: %w", err)
		}
		var record bytes.Buffer
		if err := comm.Download(path.Join(c.StagingDirectory, stagedVerity), &record); err != nil {
			return fmt.Errorf("downloading the verified root's record: %w", err)
		}
		var err error
		if cmdline, err = verity.Cmdline(cmdline, record.String()); err != nil {
			return err
		}
		ui.Say(fmt.Sprintf("Wrote the verified root in %.0fs", time.Since(start).Seconds()))
	}
	ui.Say("Command line embedded in the UKI: " + cmdline)

	if err := ctx.Err(); err != nil {
		return err
	}
	start = time.Now()
	// The sections in berth-uki's order: the same inputs make the same UKI, whichever component made it.
	if err := assemble(ctx, c.Stub, c.Output, []ukiimage.Section{
		{Name: ".osrel", Data: files[stagedOSRelease]},
		{Name: ".cmdline", Data: []byte(cmdline)},
		{Name: ".linux", Data: files[stagedKernel]},
		{Name: ".initrd", Data: files[stagedInitrd]},
	}); err != nil {
		return err
	}
	uki, err := os.ReadFile(c.Output)
	if err != nil {
		return fmt.Errorf("reading the assembled UKI: %w", err)
	}
	ui.Say(fmt.Sprintf("Assembled the UKI %s: %s in %.2fs", c.Output, mib(len(uki)), time.Since(start).Seconds()))

	// A UKI whose boot cannot be predicted is refused before it reaches the machine.
	start = time.Now()
	prediction, err := measure.Predict(bytes.NewReader(uki), int64(len(uki)))
	if err != nil {
		return fmt.Errorf("predicting the measurements of %s: %w", c.Output, err)
	}
	for _, i := range slices.Sorted(maps.Keys(prediction.PCRs)) {
		ui.Message(fmt.Sprintf("PCR %2d = %s", i, prediction.PCRs[i]))
	}
	ui.Message(fmt.Sprintf("predicted in %.2fs; berth-manifest with uki = %q records the same values", time.Since(start).Seconds(), c.Output))

	if err := ctx.Err(); err != nil {
		return err
	}
	sum := sha256.Sum256(uki)
	target := path.Join(c.ESP, "EFI/BOOT/BOOTX64.EFI")
	if c.VerifiedRoot != nil {
		target = "EFI/BOOT/BOOTX64.EFI on " + c.VerifiedRoot.Device
	}
	fi, err := os.Stat(c.Output)
	if err != nil {
		return err
	}
	progress := ui.TrackProgress(stagedUKI, 0, int64(len(uki)), io.NopCloser(bytes.NewReader(uki)))
	err = comm.Upload(path.Join(c.StagingDirectory, stagedUKI), progress, &fi)
	progress.Close()
	if err != nil {
		return fmt.Errorf("uploading the UKI: %w", err)
	}
	ui.Say(fmt.Sprintf("Installing the UKI as %s", target))
	if err := p.runScript(ctx, ui, comm, installScript, c.install(hex.EncodeToString(sum[:]))); err != nil {
		return fmt.Errorf("installing the UKI: %w", err)
	}
	return nil
}

// assemble writes the UKI to out through a temporary file beside it, so that an earlier UKI is replaced
// only by a whole one.
func assemble(ctx context.Context, stub, out string, sections []ukiimage.Section) error {
	dir := filepath.Dir(out)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("creating the directory of output: %w", err)
	}
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(out)+"-*")
	if err != nil {
		return fmt.Errorf("assembling the UKI: %w", err)
	}
	tmp.Close()
	defer os.Remove(tmp.Name())
	if err := ukiimage.Assemble(ctx, stub, tmp.Name(), sections...); err != nil {
		return fmt.Errorf("assembling the UKI: %w", err)
	}
	if err := os.Chmod(tmp.Name(), 0o644); err != nil {
		return err
	}
	if err := os.Rename(tmp.Name(), out); err != nil {
		return fmt.Errorf("writing the UKI to %s: %w", out, err)
	}
	return nil
}

// runScript uploads a script to the staging directory and runs it with execute_command.
func (p *Provisioner) runScript(ctx context.Context, ui packersdk.Ui, comm packersdk.Communicator, name, script string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := comm.Upload(path.Join(p.config.StagingDirectory, name), strings.NewReader(script), nil); err != nil {
		return fmt.Errorf("uploading %s: %w", name, err)
	}
	command, err := p.config.executeCommand(name)
	if err != nil {
		return err
	}
	return remote.Run(ctx, ui, comm, command)
}

func mib(n int) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }
