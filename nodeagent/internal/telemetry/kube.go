package telemetry

import (
	"context"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"

	"k8s.io/client-go/tools/metrics"

	"github.com/berthlabs/berth/internal/cloud/apicalls"
)

// kubeRequests is where client-go's request results go: client-go takes one hook per process, so the hook
// forwards to whichever counter was set last.
var (
	kubeHook     sync.Once
	kubeRequests atomic.Pointer[apicalls.Counter]
)

// CountKubernetesRequests counts every request of the process's Kubernetes clients in c, each retry
// included, from now on. client-go reports requests through one process-wide hook, so this covers every
// client of the process, and a later call replaces c.
func CountKubernetesRequests(c apicalls.Counter) {
	kubeRequests.Store(&c)
	kubeHook.Do(func() { metrics.Register(metrics.RegisterOpts{RequestResult: kubeResult{}}) })
}

// kubeResult is client-go's RequestResult hook.
type kubeResult struct{}

// Increment receives each attempt's status code, or "<error>" when no answer came.
func (kubeResult) Increment(_ context.Context, code, _, _ string) {
	c := kubeRequests.Load()
	if c == nil || *c == nil {
		return
	}
	(*c).Count(kubeOutcome(code))
}

// kubeOutcome is what an answer with code came to: the API server's 429 is its priority and fairness
// throttling this client; a 404 and a 409 (not found, already exists, changed meanwhile) are answers the
// join service acts on; other failures are errors.
func kubeOutcome(code string) apicalls.Outcome {
	n, err := strconv.Atoi(code)
	switch {
	case err != nil:
		return apicalls.Error
	case n == http.StatusTooManyRequests:
		return apicalls.Throttled
	case n < http.StatusBadRequest, n == http.StatusNotFound, n == http.StatusConflict:
		return apicalls.OK
	}
	return apicalls.Error
}
