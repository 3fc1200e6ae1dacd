package manifest

import "github.com/berthlabs/berth/internal/measure"

// predictUKI is the boot's PCR values, from internal/measure.
func predictUKI(path string) (map[int][]byte, error) {
	res, err := measure.PredictFile(path)
	if err != nil {
		return nil, err
	}
	return res.Values(), nil
}
