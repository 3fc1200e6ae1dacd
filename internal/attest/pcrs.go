package attest

import "fmt"

// maxPCR is the highest PCR index of a TPM 2.0 PC client.
const maxPCR = 23

// PCRIndexes reads the PCR indexes a peer asks a node to quote: 1 to 24 distinct indexes of 0 to 23.
func PCRIndexes(indexes []uint32) ([]int, error) {
	if len(indexes) == 0 || len(indexes) > maxPCR+1 {
		return nil, fmt.Errorf("%d PCRs named, want 1 to %d", len(indexes), maxPCR+1)
	}
	var seen uint32
	pcrs := make([]int, len(indexes))
	for i, p := range indexes {
		if p > maxPCR || seen&(1<<p) != 0 {
			return nil, fmt.Errorf("PCR %d is out of range 0-%d or named twice", p, maxPCR)
		}
		seen |= 1 << p
		pcrs[i] = int(p)
	}
	return pcrs, nil
}
