package ec2instances

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/url"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/aws/retry"
	"github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/smithy-go"
	"github.com/aws/smithy-go/logging"
)

// Retries of one EC2 call. EC2 throttles per account and region with token buckets that refill at a fixed
// rate, shared with every other user of the account: a join storm, an autoscaling group launching, a
// Terraform plan. Throttling there is normal and short, so a call is tried up to 8 times (the SDK's default
// is 3), with full-jitter exponential backoff: a random wait below a ceiling that doubles from 400 ms
// (base·2^attempt) to a cap of 5 s (the SDK's cap is 20 s). The retries of one call then spread over about
// 10 s on average and never more than 21 s, about the join service's exchange timeout, and concurrent
// callers do not retry in step. The SDK's retry quota stays on: when EC2 fails everything, it stops
// retrying instead of multiplying the load.
const (
	maxAttempts = 8
	baseBackoff = 200 * time.Millisecond
	maxBackoff  = 5 * time.Second
)

// newRetryer returns the SDK retryer described above, with the given backoff bounds (tests shorten them).
func newRetryer(base, limit time.Duration) func() aws.Retryer {
	return func() aws.Retryer {
		return retry.NewStandard(func(o *retry.StandardOptions) {
			o.MaxAttempts = maxAttempts
			o.MaxBackoff = limit
			o.Backoff = fullJitter{base: base, limit: limit}
		})
	}
}

// fullJitter waits a uniformly random time up to base·2^attempt, at most limit. The SDK's own backoff stops
// jittering once it reaches its cap, which would make throttled callers retry in step.
type fullJitter struct{ base, limit time.Duration }

func (j fullJitter) BackoffDelay(attempt int, _ error) (time.Duration, error) {
	ceiling := j.limit
	if attempt >= 0 && attempt < 32 {
		if d := j.base << attempt; d > 0 && d < j.limit {
			ceiling = d
		}
	}
	if ceiling <= 0 {
		return 0, nil
	}
	return time.Duration(rand.Int64N(int64(ceiling))) + 1, nil
}

// NewAPI returns an EC2 client for region with the SDK's default credential chain (on EC2, the instance
// profile's role, through IMDS), the retryer above and its HTTP client behind GuardBodies. endpoint,
// if set, replaces AWS's endpoint (a VPC endpoint's DNS name, or a test endpoint); it must be https, or http
// on a loopback address. The SDK's own warnings go to log (nil discards them), as structured lines like
// every other.
func NewAPI(ctx context.Context, region, endpoint string, log *slog.Logger) (*ec2.Client, error) {
	if region == "" {
		return nil, errors.New("EC2 client: region is empty")
	}
	if endpoint != "" {
		if err := checkEndpoint(endpoint); err != nil {
			return nil, fmt.Errorf("EC2 client: %w", err)
		}
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	cfg, err := config.LoadDefaultConfig(ctx,
		config.WithRegion(region),
		config.WithRetryer(newRetryer(baseBackoff, maxBackoff)),
		config.WithLogger(sdkLogger{log.With("subsystem", "aws-sdk")}),
	)
	if err != nil {
		return nil, fmt.Errorf("EC2 client: loading the AWS configuration: %w", err)
	}
	return ec2.NewFromConfig(cfg, GuardBodies, func(o *ec2.Options) {
		if endpoint != "" {
			o.BaseEndpoint = aws.String(endpoint)
		}
	}), nil
}

// sdkLogger writes the SDK's log lines (warnings such as a response body it could not drain) to slog.
type sdkLogger struct{ log *slog.Logger }

func (l sdkLogger) Logf(c logging.Classification, format string, v ...any) {
	level := slog.LevelInfo
	if c == logging.Warn {
		level = slog.LevelWarn
	}
	l.log.Log(context.Background(), level, fmt.Sprintf(format, v...))
}

// checkEndpoint refuses endpoints whose answers anyone on the path could forge: the answers give roles.
func checkEndpoint(endpoint string) error {
	u, err := url.Parse(endpoint)
	if err != nil {
		return fmt.Errorf("endpoint %q is not a URL: %w", bounded(endpoint), err)
	}
	if u.Host == "" || u.User != nil || u.RawQuery != "" || u.Fragment != "" {
		return fmt.Errorf("endpoint %q is not scheme://host[:port][/path]", bounded(endpoint))
	}
	switch u.Scheme {
	case "https":
		return nil
	case "http":
		if ip := net.ParseIP(u.Hostname()); ip != nil && ip.IsLoopback() || u.Hostname() == "localhost" {
			return nil
		}
		return fmt.Errorf("endpoint %q is plain http to a host that is not loopback: anyone on the path could answer", bounded(endpoint))
	}
	return fmt.Errorf("endpoint %q: scheme is not https", bounded(endpoint))
}

// APIError is an error EC2 answered, after the retries.
type APIError struct {
	// Action is the EC2 action (DescribeInstances, GetInstanceTpmEkPub).
	Action string
	// Code is EC2's error code, such as UnauthorizedOperation or RequestLimitExceeded.
	Code string
	// Message is EC2's message, shortened.
	Message string
	// Hint says what to do, where the code tells.
	Hint string
	err  error
}

func (e *APIError) Error() string {
	s := fmt.Sprintf("EC2 %s: %s: %s", e.Action, e.Code, e.Message)
	if e.Hint != "" {
		s += " (" + e.Hint + ")"
	}
	return s
}

// Unwrap gives the SDK's error, for errors.As.
func (e *APIError) Unwrap() error { return e.err }

// apiError turns an SDK error into one whose text is bounded and says what to do. EC2's messages can be
// long (UnauthorizedOperation carries an encoded authorization message); the SDK's error keeps them whole.
func apiError(action string, err error) error {
	var ae smithy.APIError
	if !errors.As(err, &ae) {
		// A transport failure, a timeout or the retry quota: the SDK's text names the operation already.
		return err
	}
	e := &APIError{Action: action, Code: bounded(ae.ErrorCode()), Message: bounded(ae.ErrorMessage()), err: err}
	switch code := ae.ErrorCode(); {
	case code == "UnauthorizedOperation":
		e.Hint = "the join service's IAM role must allow ec2:" + action
	case code == "AuthFailure" || code == "InvalidClientTokenId" || code == "SignatureDoesNotMatch":
		e.Hint = "EC2 refused the join service's AWS credentials"
	case isThrottle(code):
		e.Hint = fmt.Sprintf("EC2 still throttled the account after %d attempts", maxAttempts)
	case code == "InvalidInstanceID.NotFound":
		e.Hint = "no such instance in this account and region"
	case action == "GetInstanceTpmEkPub" && code == "UnsupportedOperation":
		// EC2's documentation names no error code for an instance without NitroTPM; this is the code EC2 uses
		// for operations an instance does not support. Other codes pass through as they are.
		e.Hint = "an instance launched without NitroTPM has no EK to report"
	}
	return e
}

func isThrottle(code string) bool {
	_, ok := retry.DefaultThrottleErrorCodes[code]
	return ok
}
