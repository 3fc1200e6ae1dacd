package ec2instances

import (
	"io"
	"net/http"

	"github.com/aws/aws-sdk-go-v2/aws"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/service/ec2"
)

// GuardBodies is an option of ec2.New and ec2.NewFromConfig that puts the client's HTTP client behind a
// guardedClient. As an option it applies after the SDK's configuration has built the HTTP client (with
// a custom CA bundle from AWS_CA_BUNDLE, say, which the SDK adds only to a client of its own type).
func GuardBodies(o *ec2.Options) {
	if o.HTTPClient == nil {
		o.HTTPClient = awshttp.NewBuildableClient()
	}
	o.HTTPClient = guardedClient{o.HTTPClient}
}

// guardedClient keeps the SDK from closing a connection under the response it is reading, which makes
// it send the same request again: one API call more, each time.
//
// How: smithy-go closes a request's body as soon as the response's headers are in, while net/http's
// connection writer may still be checking that the body has no bytes beyond its Content-Length. It checks
// with io.Copy, which prefers the body's WriteTo; smithy-go's body answers WriteTo after its close with
// io.EOF, an error from WriteTo, where Read would have given a clean end. net/http then treats the request
// as failed and closes the connection, the response body's read fails with "use of closed network
// connection", and the SDK retries a request EC2 has already answered. On loopback this happened to one
// DescribeInstances page in about fifty under the race detector (TestPagination). Hiding WriteTo leaves
// Read, which ends cleanly after the close.
type guardedClient struct{ aws.HTTPClient }

func (c guardedClient) Do(r *http.Request) (*http.Response, error) {
	if r.Body != nil && r.Body != http.NoBody {
		r.Body = readCloserOnly{r.Body}
	}
	return c.HTTPClient.Do(r)
}

// readCloserOnly has Read and Close and nothing else of the body it wraps, WriteTo above all.
type readCloserOnly struct{ io.ReadCloser }
