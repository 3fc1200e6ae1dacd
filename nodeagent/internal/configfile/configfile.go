// Package configfile reads berth-agent's configuration files (agent.yaml, join-service.yaml): YAML whose keys
// are matched exactly, every problem of a file reported at once with its line and field, under a heading
// that names the file.
package configfile

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"
)

// Load reads the configuration file at path into out (decode), then runs check, which fills in defaults and
// says what is wrong. Errors name the file, kind saying what it is ("agent configuration"), and list every
// problem, one a line, with the line of the field it names: those of the YAML's shape (unknown keys, values
// of the wrong type), or else those check finds; a field that did not parse would only add misleading
// complaints about its absence.
func Load(path, kind string, out any, check func() error) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("reading %s: %w", kind, err)
	}
	lines, err := decode(data, out)
	if err != nil {
		return &fileError{"parsing " + kind + " " + path, err}
	}
	if err := check(); err != nil {
		return &fileError{kind + " " + path, withLines(err, lines)}
	}
	return nil
}

// withLines puts before each of check's problems that starts with a field's path (`metadataURL: ...`,
// `aws.ec2Endpoint "..." ...`) the line that sets the field; a problem of a field the file does not set
// (one that is missing) stays as it is.
func withLines(err error, lines map[string]int) error {
	var out []error
	for _, e := range flatten(err) {
		field, _, _ := strings.Cut(e.Error(), " ")
		if line, ok := lines[strings.TrimRight(field, ":,")]; ok {
			e = fmt.Errorf("line %d: %w", line, e)
		}
		out = append(out, e)
	}
	return errors.Join(out...)
}

// flatten is the problems of errors.Join's errors, however nested.
func flatten(err error) []error {
	j, ok := err.(interface{ Unwrap() []error })
	if !ok {
		return []error{err}
	}
	var list []error
	for _, e := range j.Unwrap() {
		list = append(list, flatten(e)...)
	}
	return list
}

// fileError is the problems of a configuration file under a heading naming it: on the heading's line if
// there is one, else one an indented line.
type fileError struct {
	heading string
	err     error
}

func (e *fileError) Error() string {
	if j, ok := e.err.(interface{ Unwrap() []error }); ok && len(j.Unwrap()) > 1 {
		return e.heading + ":\n  " + strings.ReplaceAll(e.err.Error(), "\n", "\n  ")
	}
	return e.heading + ": " + e.err.Error()
}

func (e *fileError) Unwrap() error { return e.err }

// Duration reads "5s"-style durations from the configuration file.
type Duration struct{ time.Duration }

// UnmarshalJSON implements json.Unmarshaler. Its error is what the configuration's message shows after the
// field's name, so it says what a duration looks like: `retryMax: 5` most likely meant seconds.
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if json.Unmarshal(b, &s) == nil {
		if v, err := time.ParseDuration(s); err == nil {
			d.Duration = v
			return nil
		}
	}
	return fmt.Errorf("a duration such as 5s or 1m30s, not %s", b)
}

// MarshalJSON implements json.Marshaler.
func (d Duration) MarshalJSON() ([]byte, error) { return []byte(`"` + d.String() + `"`), nil }
