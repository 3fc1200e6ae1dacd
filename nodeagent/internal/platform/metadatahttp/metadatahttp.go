// Package metadatahttp is what the clients of cloud metadata servers (EC2's IMDS, the GCE metadata server)
// share: every request bounded in time and in the bytes read, and an answer that never came told apart from
// the caller giving up, so that a node can say "the metadata server is unreachable" only when it is.
package metadatahttp

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"time"
)

// Client sends the requests of one metadata server's client.
type Client struct {
	HTTP    *http.Client
	Timeout time.Duration
	// Unreachable is the error that every failure to get an answer wraps (imds.ErrUnreachable, …).
	Unreachable error
}

// Do sends req, within Timeout, and reads at most limit+1 bytes of the answer, so that the caller sees an
// answer too long. A request that gets no answer is Unreachable, with "no answer from <server>" and, when
// Timeout ran out, "within <Timeout>" and then hint (a reason the answer may never come, or ""). When req's
// own context ended first, the error is that context's.
func (c Client) Do(req *http.Request, server string, limit int64, hint string) (*http.Response, []byte, error) {
	ctx := req.Context()
	rctx, cancel := context.WithTimeout(ctx, c.Timeout)
	defer cancel()
	resp, err := c.HTTP.Do(req.WithContext(rctx))
	if err != nil {
		if ctx.Err() != nil {
			return nil, nil, err
		}
		var ne net.Error
		if rctx.Err() == nil && !(errors.As(err, &ne) && ne.Timeout()) {
			return nil, nil, fmt.Errorf("%w: no answer from %s: %w", c.Unreachable, server, err)
		}
		return nil, nil, fmt.Errorf("%w: no answer from %s within %s%s: %w", c.Unreachable, server, c.Timeout, hint, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, limit+1))
	if err != nil {
		if ctx.Err() != nil {
			return nil, nil, err
		}
		return nil, nil, fmt.Errorf("%w: reading the answer from %s: %w", c.Unreachable, server, err)
	}
	return resp, body, nil
}
