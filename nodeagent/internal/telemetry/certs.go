package telemetry

import (
	"errors"
	"io/fs"
	"log/slog"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/berthlabs/berth/nodeagent/internal/kubecerts"
)

// certificateCollector reads the certificates at each scrape, so that a certificate renewed on disk (by the
// agent, the kubelet or an operator) shows its new expiry at once. A file that is absent has no series: a
// worker has no API server certificate, and a control-plane node only gets its certificates at its init or
// join. A file that is there but unreadable has none either, and is logged once, since a scrape cannot fail
// for it and the alert on expiry would otherwise go quiet without a word.
type certificateCollector struct {
	desc *prometheus.Desc

	mu     sync.Mutex
	files  []kubecerts.File
	log    *slog.Logger
	warned map[string]bool
}

func (c *certificateCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *certificateCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	files := c.files
	c.mu.Unlock()
	for _, f := range files {
		cert, err := kubecerts.Read(f.Path)
		switch {
		case errors.Is(err, fs.ErrNotExist):
			continue
		case err != nil:
			c.warnOnce(f, err)
			continue
		}
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(cert.NotAfter.Unix()), f.Name)
	}
}

func (c *certificateCollector) warnOnce(f kubecerts.File, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.warned[f.Name] {
		return
	}
	if c.warned == nil {
		c.warned = map[string]bool{}
	}
	c.warned[f.Name] = true
	c.log.Warn("certificate unreadable: berth_certificate_expiry_timestamp_seconds leaves it out", "certificate", f.Name, "path", f.Path, "error", err)
}
