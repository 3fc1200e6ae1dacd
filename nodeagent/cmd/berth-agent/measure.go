package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"maps"
	"slices"

	"github.com/berthlabs/berth/internal/measure"
)

// runMeasure prints the PCR values booting a UKI will produce, so an image's expected measurements can be
// read (and compared with a node's) without booting it. It needs no agent configuration.
func runMeasure(args []string, stdout, stderr io.Writer) int {
	const synopsis = "berth-agent measure --uki FILE [--json]"
	fs := flag.NewFlagSet("berth-agent measure", flag.ContinueOnError)
	uki := fs.String("uki", "", "the unified kernel image (UKI) to predict the measurements of")
	asJSON := fs.Bool("json", false, "print the whole prediction, with every measured event, as JSON")
	if code, ok := parseFlags(fs, synopsis, args, stdout, stderr); !ok {
		return code
	}
	if *uki == "" {
		fmt.Fprintf(stderr, "berth-agent measure: --uki is required\nUsage: %s\n", synopsis)
		return exitUsage
	}
	res, err := measure.PredictFile(*uki)
	if err != nil {
		fmt.Fprintf(stderr, "berth-agent measure: %v\n", err)
		return exitFailure
	}
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(res); err != nil {
			fmt.Fprintf(stderr, "berth-agent measure: writing JSON: %v\n", err)
			return exitFailure
		}
		return exitOK
	}
	for _, pcr := range slices.Sorted(maps.Keys(res.PCRs)) {
		fmt.Fprintf(stdout, "PCR %-2d sha256:%s\n", pcr, res.PCRs[pcr])
	}
	return exitOK
}
