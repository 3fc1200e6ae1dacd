package telemetry

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Bounds of the health and metrics port: plain HTTP that anyone who reaches it may ask, so nothing there
// may hold a connection or memory for long. A scrape of these metrics is a few tens of KiB.
const (
	readHeaderTimeout = 5 * time.Second
	readTimeout       = 10 * time.Second
	writeTimeout      = 30 * time.Second
	// idleTimeout frees a keep-alive connection's place soon: scrapers and probes come back every few
	// seconds at most, and connecting again costs them little.
	idleTimeout    = 15 * time.Second
	maxHeaderBytes = 8 << 10
	// scrapesInFlight bounds concurrent /metrics requests; more are answered 503 at once.
	scrapesInFlight = 4
	scrapeTimeout   = 10 * time.Second
	// shutdownGrace is how long running requests get when the server stops.
	shutdownGrace = 2 * time.Second
)

// Check is one condition of readiness: nil when met, else why not. It runs on every /readyz, so it must
// only read state kept current elsewhere (a flag, a Probe), never call anything.
type Check func() error

// Server serves /metrics, /healthz and /readyz.
type Server struct {
	m   *Metrics
	log *slog.Logger

	mu     sync.Mutex
	checks []namedCheck
}

type namedCheck struct {
	name  string
	check Check
}

// NewServer serves m; it is not ready until a check is added (AddCheck), so that a process that serves no
// join service yet (the init server's phase) is never taken for one.
func NewServer(m *Metrics, log *slog.Logger) *Server {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Server{m: m, log: log}
}

// AddCheck makes c a condition of readiness, under name in /readyz's answer.
func (s *Server) AddCheck(name string, c Check) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.checks = append(s.checks, namedCheck{name, c})
}

// ready runs the checks and says which failed.
func (s *Server) ready() (bool, string) {
	s.mu.Lock()
	checks := s.checks
	s.mu.Unlock()
	if len(checks) == 0 {
		return false, "not serving joins yet\n"
	}
	var b strings.Builder
	ok := true
	for _, c := range checks {
		if err := c.check(); err != nil {
			ok = false
			fmt.Fprintf(&b, "%s: %v\n", c.name, err)
		} else {
			fmt.Fprintf(&b, "%s: ok\n", c.name)
		}
	}
	return ok, b.String()
}

// Handler is the server's HTTP handler.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(s.m.reg, promhttp.HandlerOpts{
		ErrorLog: slogLogger{s.log}, MaxRequestsInFlight: scrapesInFlight, Timeout: scrapeTimeout,
	}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		ok, why := s.ready()
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Header().Set("Cache-Control", "no-store")
		if !ok {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		_, _ = w.Write([]byte(why))
	})
	return mux
}

// Serve serves on lis until ctx ends, at most maxConnsPerAddress connections from one address and
// maxConns in all.
func (s *Server) Serve(ctx context.Context, lis net.Listener) error {
	lis = newLimitListener(lis, maxConnsPerAddress, maxConns, s.log)
	srv := &http.Server{
		Handler:           s.Handler(),
		ReadHeaderTimeout: readHeaderTimeout,
		ReadTimeout:       readTimeout,
		WriteTimeout:      writeTimeout,
		IdleTimeout:       idleTimeout,
		MaxHeaderBytes:    maxHeaderBytes,
		ErrorLog:          slog.NewLogLogger(s.log.Handler(), slog.LevelDebug),
	}
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), shutdownGrace)
		defer cancel()
		if srv.Shutdown(sctx) != nil {
			srv.Close()
		}
	}()
	err := srv.Serve(lis)
	if errors.Is(err, http.ErrServerClosed) {
		<-stopped
		return nil
	}
	return fmt.Errorf("metrics server: %w", err)
}

// slogLogger is promhttp's error log.
type slogLogger struct{ log *slog.Logger }

func (l slogLogger) Println(v ...any) { l.log.Warn("serving metrics", "error", fmt.Sprint(v...)) }

// Probe is a check that runs in the background every interval and keeps its last result, so that /readyz
// reads a flag instead of calling out at each probe of a load balancer.
type Probe struct {
	last atomic.Pointer[error]
}

// errNotProbed is a Probe's result before its first run ends.
var errNotProbed = errors.New("not checked yet")

// StartProbe runs check now and then every interval, each run bounded by timeout, until ctx ends; onResult,
// if set, is told each result.
func StartProbe(ctx context.Context, interval, timeout time.Duration, check func(context.Context) error, onResult func(error)) *Probe {
	p := &Probe{}
	p.last.Store(&errNotProbed)
	go func() {
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			cctx, cancel := context.WithTimeout(ctx, timeout)
			err := check(cctx)
			cancel()
			if ctx.Err() != nil {
				return
			}
			p.last.Store(&err)
			if onResult != nil {
				onResult(err)
			}
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}()
	return p
}

// Err is the last run's result.
func (p *Probe) Err() error { return *p.last.Load() }

// APIReachable records a probe's result of the Kubernetes API in berth_kubernetes_api_reachable.
func (m *Metrics) APIReachable(err error) {
	if err == nil {
		m.apiReachGauge.Set(1)
	} else {
		m.apiReachGauge.Set(0)
	}
}
