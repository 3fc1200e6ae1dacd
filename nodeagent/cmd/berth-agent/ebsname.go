package main

import (
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/berthlabs/berth/nodeagent/internal/ebsnvme"
)

// runEBSName prints the block device mapping name of an EBS volume (sdb for /dev/nvme1n1), for the udev rule
// that gives the volume a link by that name (examples/packer/aws/90-berth-ebs.rules); anything else is an
// error, so that udev makes no link.
func runEBSName(args []string, stdout, stderr io.Writer) int {
	const synopsis = "berth-agent ebs-name DEVICE"
	fs := flag.NewFlagSet("berth-agent ebs-name", flag.ContinueOnError)
	if len(args) == 1 && !strings.HasPrefix(args[0], "-") {
		page, err := ebsnvme.Identify(args[0])
		if err != nil {
			fmt.Fprintf(stderr, "berth-agent ebs-name: %v\n", err)
			return exitFailure
		}
		id, err := ebsnvme.Parse(page)
		if err != nil {
			fmt.Fprintf(stderr, "berth-agent ebs-name: %s: %v\n", args[0], err)
			return exitFailure
		}
		fmt.Fprintln(stdout, id.DeviceName)
		return exitOK
	}
	if code, ok := parseFlags(fs, synopsis, args, stdout, stderr); !ok {
		return code
	}
	fmt.Fprintf(stderr, "berth-agent ebs-name: the device is required\nUsage: %s\n", synopsis)
	return exitUsage
}
