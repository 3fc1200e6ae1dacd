package agent

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestMetricsListenChecked: metricsListen must be host:port; it is off unless set.
func TestMetricsListenChecked(t *testing.T) {
	base := "metadataURL: http://169.254.169.254/berth\nstateDisk: /dev/vdb\n"
	for listen, ok := range map[string]bool{"": true, "0.0.0.0:9452": true, "[::1]:9452": true, "9452": false, "host:": false} {
		path := filepath.Join(t.TempDir(), "agent.yaml")
		content := base
		if listen != "" {
			content += "metricsListen: " + `"` + listen + `"` + "\n"
		}
		if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		c, err := LoadConfig(path)
		switch {
		case ok && err != nil:
			t.Errorf("metricsListen %q: %v", listen, err)
		case !ok && (err == nil || !strings.Contains(err.Error(), "metricsListen")):
			t.Errorf("metricsListen %q: %v, want an error naming metricsListen", listen, err)
		case ok && c.MetricsListen != listen:
			t.Errorf("metricsListen %q read as %q", listen, c.MetricsListen)
		}
	}
}

// TestTelemetryStartsOnce: the process's metrics server starts at the first server that asks and is shared
// with the next; it is not ready before a join service adds its checks; without metricsListen there is none.
func TestTelemetryStartsOnce(t *testing.T) {
	off := &Agent{cfg: &Config{}}
	if tel, err := off.startTelemetry(t.Context()); err != nil || tel.metrics != nil || tel.server != nil {
		t.Fatalf("without metricsListen: %+v, %v", tel, err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	lis.Close()
	a := &Agent{cfg: &Config{MetricsListen: addr}, log: slog.New(slog.DiscardHandler)}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	first, err := a.startTelemetry(ctx)
	if err != nil {
		t.Fatal(err)
	}
	second, err := a.startTelemetry(ctx)
	if err != nil || second.server != first.server || second.metrics != first.metrics {
		t.Fatalf("the second server of the process got other metrics: %v", err)
	}
	code, body := fetch(t, "http://"+addr+"/readyz")
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "not serving joins") {
		t.Errorf("/readyz before the join service: %d %q", code, body)
	}
	if code, _ := fetch(t, "http://"+addr+"/healthz"); code != http.StatusOK {
		t.Errorf("/healthz: %d", code)
	}
}

func fetch(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(body)
}
