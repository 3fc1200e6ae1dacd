package agent

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"sigs.k8s.io/yaml"

	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/repotest"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
	"github.com/berthlabs/berth/nodeagent/internal/telemetry"
)

// The operator artefacts: Prometheus alerting rules with their promtool unit tests, and a Grafana dashboard.
const (
	alertsFile     = "docs/alerts.yaml"
	alertTestsFile = "docs/alerts_test.yaml"
	dashboardFile  = "docs/grafana-dashboard.json"
	metricsDoc     = "docs/metrics.md"
)

type alertRules struct {
	Groups []struct {
		Rules []struct {
			Alert string `json:"alert"`
			Expr  string `json:"expr"`
		} `json:"rules"`
	} `json:"groups"`
}

type dashboard struct {
	Panels []struct {
		Title   string `json:"title"`
		Targets []struct {
			Expr string `json:"expr"`
		} `json:"targets"`
	} `json:"panels"`
}

// artefactQueries are the PromQL expressions of the alerting rules (by alert) and of the dashboard (by panel).
func artefactQueries(t *testing.T) (alerts, panels map[string]string) {
	t.Helper()
	root := repotest.Root(t)
	var rules alertRules
	data, err := os.ReadFile(filepath.Join(root, alertsFile))
	if err != nil {
		t.Fatal(err)
	}
	// Only the alerts' names and expressions: promtool checks the rest.
	if err := yaml.Unmarshal(data, &rules); err != nil {
		t.Fatalf("%s: %v", alertsFile, err)
	}
	alerts = map[string]string{}
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			alerts[r.Alert] = r.Expr
		}
	}
	var dash dashboard
	if data, err = os.ReadFile(filepath.Join(root, dashboardFile)); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(data, &dash); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	panels = map[string]string{}
	for _, p := range dash.Panels {
		for i, target := range p.Targets {
			panels[fmt.Sprintf("%s #%d", p.Title, i+1)] = target.Expr
		}
	}
	if len(alerts) == 0 || len(panels) == 0 {
		t.Fatalf("%d alerts and %d dashboard queries read", len(alerts), len(panels))
	}
	return alerts, panels
}

// exposed is every series family the agent process exposes, as a scrape sees it: name → label → the
// values its series carry. Each server's metrics are made to show (a policy loaded, a certificate on disk),
// so that a family that only appears once its server runs is there too.
func exposed(t *testing.T) (families map[string]map[string][]string, histograms map[string]bool) {
	t.Helper()
	paths := nodestate.Paths{KubernetesDir: t.TempDir(), KubeletDir: t.TempDir(), State: t.TempDir()}
	ca, err := pki.NewCA("kubernetes", time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if err := nodestate.WriteFile(filepath.Join(paths.PKIDir(), "ca.crt"), ca.CertPEM(), 0o644); err != nil {
		t.Fatal(err)
	}
	a := &Agent{cfg: &Config{Paths: paths}, deps: Deps{Build: telemetry.Build{Version: "test"}}}
	m := a.newMetrics(slog.New(slog.DiscardHandler))
	m.PolicyLoaded(1, "0123456789ab", time.Now())
	gathered, err := m.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	families, histograms = map[string]map[string][]string{}, map[string]bool{}
	for _, f := range gathered {
		labels := map[string][]string{}
		for _, s := range f.GetMetric() {
			for _, l := range s.GetLabel() {
				labels[l.GetName()] = append(labels[l.GetName()], l.GetValue())
			}
		}
		families[f.GetName()] = labels
		histograms[f.GetName()] = f.GetType() == dto.MetricType_HISTOGRAM
	}
	return families, histograms
}

var (
	selectorRE = regexp.MustCompile(`\b(berth_[a-z0-9_]+)(\{[^}]*\})?`)
	matcherRE  = regexp.MustCompile(`([a-z_]+)\s*(=~|!~|!=|=)\s*"([^"]*)"`)
	scrapeRE   = regexp.MustCompile(`^up\{job="[a-z-]+"\} == 0$`)
)

// queryProblems are the berth_ series that query selects and the agent does not expose: an unknown name,
// a label the family lacks, or a matcher no series satisfies; named are the families it selects. instance
// and job come from Prometheus's scrape, le from a histogram's buckets; values with Grafana's variables are
// the dashboard's user's to choose.
func queryProblems(query string, families map[string]map[string][]string, histograms map[string]bool) (named, problems []string) {
	selectors := selectorRE.FindAllStringSubmatch(query, -1)
	// up is the scrape's own series, the one thing an alert on a silent agent can read.
	if len(selectors) == 0 && !scrapeRE.MatchString(query) {
		problems = append(problems, "names no berth_ metric")
	}
	for _, sel := range selectors {
		name := sel[1]
		family, ok := families[name]
		for _, suffix := range []string{"_bucket", "_count", "_sum"} {
			if base, cut := strings.CutSuffix(name, suffix); !ok && cut && histograms[base] {
				name, family, ok = base, families[base], true
			}
		}
		if !ok {
			problems = append(problems, sel[1]+" is not a metric the agent exposes")
			continue
		}
		named = append(named, name)
		for _, m := range matcherRE.FindAllStringSubmatch(sel[2], -1) {
			label, op, value := m[1], m[2], m[3]
			if label == "instance" || label == "job" || (label == "le" && histograms[name]) {
				continue
			}
			values, ok := family[label]
			switch {
			case !ok:
				problems = append(problems, fmt.Sprintf("%s has no label %q", name, label))
			case op == "=" && !slices.Contains(values, value):
				problems = append(problems, fmt.Sprintf("no series of %s has %s=%q (it has %q)", name, label, value, values))
			case (op == "=~" || op == "!~") && !strings.Contains(value, "$"):
				if re, err := regexp.Compile("^(?:" + value + ")$"); err != nil || !slices.ContainsFunc(values, re.MatchString) {
					problems = append(problems, fmt.Sprintf("%s: %s=~%q matches none of %q (%v)", name, label, value, values, err))
				}
			}
		}
	}
	return named, problems
}

// TestOperatorArtefactsUseRealMetrics: every alert and dashboard query selects metrics, labels and label
// values the agent really exposes; together they show every berth_ family; and docs/metrics.md's table lists
// exactly the families there are.
func TestOperatorArtefactsUseRealMetrics(t *testing.T) {
	families, histograms := exposed(t)
	alerts, panels := artefactQueries(t)
	shown := map[string]bool{}
	for where, queries := range map[string]map[string]string{alertsFile: alerts, dashboardFile: panels} {
		for name, query := range queries {
			named, problems := queryProblems(query, families, histograms)
			for _, p := range problems {
				t.Errorf("%s: %s: %s", where, name, p)
			}
			for _, f := range named {
				shown[f] = true
			}
		}
	}
	doc, err := os.ReadFile(filepath.Join(repotest.Root(t), metricsDoc))
	if err != nil {
		t.Fatal(err)
	}
	documented := map[string]bool{}
	for _, m := range regexp.MustCompile("(?m)^\\| `(berth_[a-z0-9_]+)` \\|").FindAllSubmatch(doc, -1) {
		documented[string(m[1])] = true
	}
	for name := range families {
		if !strings.HasPrefix(name, "berth_") {
			continue
		}
		if !shown[name] {
			t.Errorf("%s is in neither %s nor %s", name, alertsFile, dashboardFile)
		}
		if !documented[name] {
			t.Errorf("%s has no row in %s's table", name, metricsDoc)
		}
	}
	for name := range documented {
		if _, ok := families[name]; !ok {
			t.Errorf("%s documents %s, which the agent does not expose", metricsDoc, name)
		}
	}

	// The check finds a name, a label and a value the agent does not have, and a query of none of its metrics.
	for _, bad := range []string{`rate(berth_boot_steps[5m])`, `berth_boot_step{phase="tpm"}`, `berth_boot_step{job="x",step="dancing"}`,
		`berth_seals_total{result=~"fine|great"}`, `sum(up)`} {
		if _, problems := queryProblems(bad, families, histograms); len(problems) != 1 {
			t.Errorf("%s: problems %q, want one", bad, problems)
		}
	}
}

// TestOperatorArtefactsPromtool: the real promtool finds the alerting rules valid and their unit tests
// passing, every alert has a unit test, and every dashboard query parses as PromQL (each becomes a recording
// rule, Grafana's variables replaced by values a user could choose).
func TestOperatorArtefactsPromtool(t *testing.T) {
	promtool := filepath.Join(repotest.BinDir(t, "BERTH_PROMTOOL_BIN", "build-promtool.sh", "it needs go and the Go module proxy or cache"), "promtool")
	root := repotest.Root(t)
	run := func(args ...string) {
		t.Helper()
		out, err := exec.Command(promtool, args...).CombinedOutput()
		if err != nil {
			t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	run("check", "rules", "--lint=all", "--lint-fatal", filepath.Join(root, alertsFile))
	run("test", "rules", filepath.Join(root, alertTestsFile))

	alerts, panels := artefactQueries(t)
	tests, err := os.ReadFile(filepath.Join(root, alertTestsFile))
	if err != nil {
		t.Fatal(err)
	}
	for alert := range alerts {
		if !regexp.MustCompile(`(?m)^\s*alertname: ` + alert + `$`).Match(tests) {
			t.Errorf("%s has no unit test in %s", alert, alertTestsFile)
		}
	}

	grafana := strings.NewReplacer("$__rate_interval", "5m", "$__range", "6h", "$__interval", "1m", "$instance", ".*")
	var recording strings.Builder
	recording.WriteString("groups:\n  - name: dashboard\n    rules:\n")
	for i, title := range slices.Sorted(maps.Keys(panels)) {
		expr, err := json.Marshal(grafana.Replace(panels[title]))
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(&recording, "      # %s\n      - record: dashboard:query%d\n        expr: %s\n", title, i, expr)
	}
	rules := filepath.Join(t.TempDir(), "dashboard.yaml")
	if err := os.WriteFile(rules, []byte(recording.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	run("check", "rules", rules)
}
