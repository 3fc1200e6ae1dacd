package ec2instances

import (
	"context"
	"errors"
	"slices"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/smithy-go"
	"github.com/aws/smithy-go/middleware"

	"github.com/berthlabs/berth/internal/cloud/apicalls"
)

// countedAPI is an API whose every call counts its attempts: the SDK retries a throttled request up to
// maxAttempts times, so counting calls alone would hide the throttling an operator needs to see.
type countedAPI struct {
	API
	count func(*ec2.Options)
}

func (a countedAPI) DescribeInstances(ctx context.Context, in *ec2.DescribeInstancesInput, optFns ...func(*ec2.Options)) (*ec2.DescribeInstancesOutput, error) {
	return a.API.DescribeInstances(ctx, in, append(slices.Clip(optFns), a.count)...)
}

func (a countedAPI) GetInstanceTpmEkPub(ctx context.Context, in *ec2.GetInstanceTpmEkPubInput, optFns ...func(*ec2.Options)) (*ec2.GetInstanceTpmEkPubOutput, error) {
	return a.API.GetInstanceTpmEkPub(ctx, in, append(slices.Clip(optFns), a.count)...)
}

// countAttempts is a call option that puts a middleware right inside the SDK's retry loop ("Retry" in the
// finalize step), where it sees each attempt's own result. The SDK copies its options before applying a
// call's, so the client's own middleware stack is untouched.
func countAttempts(calls apicalls.Counter) func(*ec2.Options) {
	mw := middleware.FinalizeMiddlewareFunc("BerthCountAttempts", func(ctx context.Context, in middleware.FinalizeInput, next middleware.FinalizeHandler) (middleware.FinalizeOutput, middleware.Metadata, error) {
		out, md, err := next.HandleFinalize(ctx, in)
		calls.Count(attemptOutcome(err))
		return out, md, err
	})
	return func(o *ec2.Options) {
		o.APIOptions = append(o.APIOptions, func(s *middleware.Stack) error {
			return s.Finalize.Insert(mw, "Retry", middleware.After)
		})
	}
}

// attemptOutcome is what one attempt came to: EC2's throttling codes (RequestLimitExceeded and the SDK's
// other throttle codes) are throttled, every other failure an error.
func attemptOutcome(err error) apicalls.Outcome {
	if err == nil {
		return apicalls.OK
	}
	var ae smithy.APIError
	if errors.As(err, &ae) && isThrottle(ae.ErrorCode()) {
		return apicalls.Throttled
	}
	return apicalls.Error
}
