package configfile

import (
	"encoding/json"
	"testing"
	"time"
)

func TestDurationRoundTrip(t *testing.T) {
	d := Duration{90 * time.Second}
	b, err := json.Marshal(d)
	if err != nil {
		t.Fatal(err)
	}
	if string(b) != `"1m30s"` {
		t.Errorf("marshalled %s, want \"1m30s\"", b)
	}
	var back Duration
	if err := json.Unmarshal(b, &back); err != nil || back != d {
		t.Errorf("round trip gave %v (%v), want %v", back, err, d)
	}
}
