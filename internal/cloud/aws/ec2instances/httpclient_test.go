package ec2instances

import (
	"bytes"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
)

// eofAfterClose is a request body as smithy-go makes it: WriteTo after Close answers io.EOF.
type eofAfterClose struct {
	r      *bytes.Reader
	closed bool
}

func (b *eofAfterClose) Read(p []byte) (int, error) {
	if b.closed {
		return 0, io.EOF
	}
	return b.r.Read(p)
}

func (b *eofAfterClose) WriteTo(w io.Writer) (int64, error) {
	if b.closed {
		return 0, io.EOF
	}
	return b.r.WriteTo(w)
}

func (b *eofAfterClose) Close() error {
	b.closed = true
	return nil
}

type doFunc func(*http.Request) (*http.Response, error)

func (f doFunc) Do(r *http.Request) (*http.Response, error) { return f(r) }

// TestGuardedBodyEndsCleanlyAfterClose: net/http's check for bytes beyond Content-Length is an io.Copy of
// the body after the SDK may have closed it; through the guard that copy ends without an error, as net/http
// needs to keep the connection, where the unguarded body fails it.
func TestGuardedBodyEndsCleanlyAfterClose(t *testing.T) {
	var sent io.ReadCloser
	client := guardedClient{doFunc(func(r *http.Request) (*http.Response, error) {
		sent = r.Body
		return &http.Response{StatusCode: http.StatusOK, Body: http.NoBody}, nil
	})}
	body := &eofAfterClose{r: bytes.NewReader([]byte("Action=DescribeInstances"))}
	req, err := http.NewRequest(http.MethodPost, "http://127.0.0.1/", strings.NewReader(""))
	if err != nil {
		t.Fatal(err)
	}
	req.Body = body
	if _, err := client.Do(req); err != nil {
		t.Fatal(err)
	}
	if _, ok := sent.(io.WriterTo); ok {
		t.Fatal("the body handed to the transport still has WriteTo")
	}
	body.Close()
	if _, err := io.Copy(io.Discard, body); !errors.Is(err, io.EOF) {
		t.Fatalf("unguarded copy after close: %v, want io.EOF (else this test no longer shows the failure)", err)
	}
	if n, err := io.Copy(io.Discard, sent); n != 0 || err != nil {
		t.Fatalf("guarded copy after close: %d bytes, %v; want 0, nil", n, err)
	}
}

func TestGuardLeavesEmptyBodies(t *testing.T) {
	client := guardedClient{doFunc(func(r *http.Request) (*http.Response, error) {
		if r.Body != http.NoBody {
			t.Errorf("body %T, want http.NoBody", r.Body)
		}
		return &http.Response{StatusCode: http.StatusOK, Body: http.NoBody}, nil
	})}
	req, err := http.NewRequest(http.MethodGet, "http://127.0.0.1/", http.NoBody)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client.Do(req); err != nil {
		t.Fatal(err)
	}
}
