// Package apicalls is how the join service's clients of other services' APIs (EC2, Compute Engine,
// Kubernetes) report what each request came to, for the service's metrics, without depending on a metrics
// library: the client is handed a Counter and calls it, once per request that went out.
package apicalls

// Outcome is what one request came to. The set is fixed, so that a metric labelled by it stays small.
type Outcome string

// Outcomes of a request.
const (
	// OK is an answer the caller can use, a "not found" included: the API answered.
	OK Outcome = "ok"
	// Throttled is the API refusing the request for the caller's request rate (EC2's RequestLimitExceeded,
	// Compute Engine's 429 or 403 rateLimitExceeded, the API server's 429).
	Throttled Outcome = "throttled"
	// Error is every other failure: a refusal, the API's own error, or no answer at all.
	Error Outcome = "error"
)

// Counter counts requests by outcome. It is called for every request, each attempt of a retried one
// included (retries are where throttling shows), so it must be cheap and safe for concurrent use.
type Counter interface {
	Count(Outcome)
}
