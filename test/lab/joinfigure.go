package lab

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
)

// JoinFigure is where a fresh node's time went, from its agent's start to its Node Ready, by stage.
type JoinFigure struct {
	Node   string
	Stages []Stage
}

// Stage is one stage of a join and how long it took.
type Stage struct {
	Name string
	Took time.Duration
}

// joinMarks are the agent's log lines that end each stage of a first join, in the order they happen; the
// stage before the first mark begins at the agent's "boot started", and the last stage ends at Node Ready.
var joinMarks = []struct{ stage, msg string }{
	{"metadata", "instance metadata read"},
	{"disk format", "state disk formatted"},
	{"attestation", "join ticket received"},
	{"key swap", "state disk keyed"},
	{"kubeadm join", "node joined"},
}

// readyStage is the stage from the agent's "node joined" to the Node's Ready condition.
const readyStage = "kubelet Ready"

// JoinStages computes a first join's figure from the agent's log of that boot (JSON lines, as berth-agent
// writes them; other lines are skipped) and the time its Node became Ready. It fails when a stage's mark is
// missing or out of order, so that a figure never hides a stage it did not find.
func JoinStages(node string, agentLog []byte, ready time.Time) (JoinFigure, error) {
	start, marks, err := logMarks(agentLog)
	if err != nil {
		return JoinFigure{}, err
	}
	f := JoinFigure{Node: node}
	prev := start
	for _, m := range joinMarks {
		at, ok := marks[m.msg]
		if !ok {
			return JoinFigure{}, fmt.Errorf("%s: the agent's log has no %q line: the %s stage has no end", node, m.msg, m.stage)
		}
		if at.Before(prev) {
			return JoinFigure{}, fmt.Errorf("%s: %q at %s comes before the stage it ends began (%s)", node, m.msg, at.Format(time.StampMicro), prev.Format(time.StampMicro))
		}
		f.Stages = append(f.Stages, Stage{m.stage, at.Sub(prev)})
		prev = at
	}
	if ready.Before(prev) {
		return JoinFigure{}, fmt.Errorf("%s: Ready at %s, before the agent's %q at %s", node, ready.Format(time.StampMicro), joinMarks[len(joinMarks)-1].msg, prev.Format(time.StampMicro))
	}
	f.Stages = append(f.Stages, Stage{readyStage, ready.Sub(prev)})
	return f, nil
}

// logMarks reads when the boot in log started and, for each message of joinMarks, when it was first logged.
func logMarks(log []byte) (start time.Time, marks map[string]time.Time, err error) {
	wanted := map[string]bool{}
	for _, m := range joinMarks {
		wanted[m.msg] = true
	}
	marks = map[string]time.Time{}
	sc := bufio.NewScanner(bytes.NewReader(log))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var e struct {
			Time time.Time `json:"time"`
			Msg  string    `json:"msg"`
		}
		if json.Unmarshal(sc.Bytes(), &e) != nil {
			continue
		}
		switch {
		case e.Msg == "boot started" && start.IsZero():
			start = e.Time
		case wanted[e.Msg] && !start.IsZero():
			if _, seen := marks[e.Msg]; !seen {
				marks[e.Msg] = e.Time
			}
		}
	}
	if err := sc.Err(); err != nil {
		return time.Time{}, nil, fmt.Errorf("reading the agent's log: %w", err)
	}
	if start.IsZero() {
		return time.Time{}, nil, errors.New(`the agent's log has no "boot started" line`)
	}
	return start, marks, nil
}

// Total is the time from the agent's start to the Node's Ready.
func (f JoinFigure) Total() time.Duration {
	var d time.Duration
	for _, s := range f.Stages {
		d += s.Took
	}
	return d
}

// Largest is the stage that took longest.
func (f JoinFigure) Largest() Stage {
	var big Stage
	for _, s := range f.Stages {
		if s.Took > big.Took {
			big = s
		}
	}
	return big
}

// Markdown is the figure as a Markdown table under a heading line that says what it is.
func (f JoinFigure) Markdown() string {
	var b strings.Builder
	fmt.Fprintf(&b, "A fresh worker (%s) joining a running lab cluster: its agent's start to its Node Ready, by stage\n\n", f.Node)
	b.WriteString("| stage | seconds |\n| --- | --- |\n")
	for _, s := range f.Stages {
		fmt.Fprintf(&b, "| %s | %.2f |\n", s.Name, s.Took.Seconds())
	}
	fmt.Fprintf(&b, "| total | %.2f |\n", f.Total().Seconds())
	return b.String()
}

// GrowTimed adds one node to a lab Up made, as Grow does, and returns its join's figure: the stages from its
// agent's log, and its Node's Ready as the API server's watch reports it (the Ready condition's transition
// time is kept to the second only).
func (l *Lab) GrowTimed(ctx context.Context, spec NodeSpec) (JoinFigure, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ready, err := l.watchReady(ctx, spec.Name)
	if err != nil {
		return JoinFigure{}, err
	}
	n, err := l.grow(ctx, spec)
	if err != nil {
		return JoinFigure{}, err
	}
	// The node is Ready: the watch has seen it, or sees it at its next event.
	var at time.Time
	select {
	case t, ok := <-ready:
		if !ok {
			return JoinFigure{}, fmt.Errorf("%s: the watch of its Node ended before it saw it Ready", spec.Name)
		}
		at = t
	case <-time.After(time.Minute):
		return JoinFigure{}, fmt.Errorf("%s: Ready, but its Node's watch did not see it within a minute", spec.Name)
	}
	log, err := os.ReadFile(n.path("logs/agent.log"))
	if err != nil {
		return JoinFigure{}, err
	}
	return JoinStages(n.Name, log[min(n.bootLog, int64(len(log))):], at)
}

// watchReady watches the Node called name and sends the time its Ready condition is first seen True.
func (l *Lab) watchReady(ctx context.Context, name string) (<-chan time.Time, error) {
	rc, err := clientcmd.BuildConfigFromFlags("", l.Kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("watching node %s: %w", name, err)
	}
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("watching node %s: %w", name, err)
	}
	opts := metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("metadata.name", name).String()}
	w, err := client.CoreV1().Nodes().Watch(ctx, opts)
	if err != nil {
		return nil, fmt.Errorf("watching node %s: %w", name, err)
	}
	ready := make(chan time.Time, 1)
	go func() {
		defer close(ready)
		for {
			for ev := range w.ResultChan() {
				if node, isNode := ev.Object.(*corev1.Node); isNode && nodeReady(node) {
					w.Stop()
					ready <- time.Now()
					return
				}
			}
			// The API server ends a watch after a while; a new one begins with the Node as it is now.
			var err error
			if w, err = client.CoreV1().Nodes().Watch(ctx, opts); err != nil {
				return
			}
		}
	}()
	return ready, nil
}

func nodeReady(n *corev1.Node) bool {
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}
