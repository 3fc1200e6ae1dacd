package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os/exec"

	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/nodeagent/internal/agent"
	"github.com/berthlabs/berth/nodeagent/internal/doctor"
)

// runDoctor checks the machine as a node needs it, for the first instance of an image on a new cloud. It
// reads and changes nothing of the node's state: no TPM command, no disk, no network.
func runDoctor(args []string, stdout, stderr io.Writer) int {
	const synopsis = "berth-agent doctor [--config FILE] [--manifest FILE --image NAME] [--json]"
	fs := flag.NewFlagSet("berth-agent doctor", flag.ContinueOnError)
	configPath := fs.String("config", agent.DefaultConfigPath, "agent configuration file (for the TPM device)")
	manifestFile := fs.String("manifest", "", "berth-image.json, to compare the PCRs with the image's prediction")
	imageName := fs.String("image", "", "the image of --manifest this machine booted")
	asJSON := fs.Bool("json", false, "print the checks as JSON")
	if code, ok := parseFlags(fs, synopsis, args, stdout, stderr); !ok {
		return code
	}
	var want map[string]string
	if *manifestFile != "" || *imageName != "" {
		if *manifestFile == "" {
			fmt.Fprintf(stderr, "berth-agent doctor: --image needs --manifest\nUsage: %s\n", synopsis)
			return exitUsage
		}
		img, err := manifestImage(*manifestFile, *imageName)
		if err != nil {
			fmt.Fprintf(stderr, "berth-agent doctor: %v\n", err)
			return exitConfig
		}
		want = img.PCRs
	}
	// A machine whose configuration is broken is one doctor should still look at: the configuration is one
	// more finding, and the TPM is looked for where a node's usually is.
	var checks []doctor.Check
	tpm := attest.DefaultDevice
	if cfg, err := agent.LoadConfig(*configPath); err != nil {
		checks = append(checks, doctor.Check{Name: "configuration", Detail: err.Error()})
	} else {
		checks = append(checks, doctor.Check{Name: "configuration", OK: true, Detail: *configPath})
		tpm = cfg.TPM
	}
	checks = append(checks, doctor.Machine{Root: "/", TPM: tpm, LookPath: exec.LookPath}.Run(want)...)
	ok := true
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(checks); err != nil {
			fmt.Fprintf(stderr, "berth-agent doctor: writing the checks: %v\n", err)
			return exitFailure
		}
		for _, c := range checks {
			ok = ok && c.OK
		}
	} else {
		ok = doctor.Print(stdout, checks)
	}
	if !ok {
		return exitFailure
	}
	return exitOK
}
