package lab

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

func TestJoinStages(t *testing.T) {
	t0 := time.Date(2026, 11, 25, 10, 0, 0, 0, time.UTC)
	line := func(ms int, msg string) string {
		return fmt.Sprintf(`{"time":%q,"level":"INFO","msg":%q}`+"\n", t0.Add(time.Duration(ms)*time.Millisecond).Format(time.RFC3339Nano), msg)
	}
	full := line(0, "boot started") + line(10, "instance metadata read") + "lab: a line of the lab's own\n" +
		line(300, "state disk formatted") + line(700, "join ticket received") + line(800, "state disk keyed") +
		line(900, "kubeadm") + line(2800, "node joined") + line(2900, "node joined")
	f, err := JoinStages("worker-1", []byte(full), t0.Add(4*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	want := []Stage{{"metadata", 10 * time.Millisecond}, {"disk format", 290 * time.Millisecond},
		{"attestation", 400 * time.Millisecond}, {"key swap", 100 * time.Millisecond},
		{"kubeadm join", 2 * time.Second}, {"kubelet Ready", 1200 * time.Millisecond}}
	if fmt.Sprint(f.Stages) != fmt.Sprint(want) {
		t.Errorf("stages %v, want %v", f.Stages, want)
	}
	if f.Total() != 4*time.Second || f.Largest().Name != "kubeadm join" {
		t.Errorf("total %s, largest %v", f.Total(), f.Largest())
	}
	md := f.Markdown()
	for _, row := range []string{"| stage | seconds |", "| disk format | 0.29 |", "| kubelet Ready | 1.20 |", "| total | 4.00 |"} {
		if !strings.Contains(md, row) {
			t.Errorf("the table has no row %q:\n%s", row, md)
		}
	}

	for name, c := range map[string]struct {
		log   string
		ready time.Time
		want  string
	}{
		"no start":      {strings.Replace(full, `"boot started"`, `"booting"`, 1), t0.Add(4 * time.Second), `no "boot started"`},
		"stage missing": {strings.Replace(full, `"join ticket received"`, `"join ticket refused"`, 1), t0.Add(4 * time.Second), "the attestation stage has no end"},
		"out of order":  {strings.Replace(full, line(800, "state disk keyed"), line(650, "state disk keyed"), 1), t0.Add(4 * time.Second), "comes before"},
		"Ready early":   {full, t0.Add(time.Second), "before the agent's"},
	} {
		if _, err := JoinStages("worker-1", []byte(c.log), c.ready); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: error %v, want one saying %q", name, err, c.want)
		}
	}
}
