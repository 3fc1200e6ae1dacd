package rpc_test

import (
	"bytes"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc"

	"github.com/berthlabs/berth/internal/rpc"
)

// A client that ignores the server's advertised header limit and sends a 64 KiB header is cut off by the
// server, not served: the bound holds against peers that do not play along, not only against gRPC clients
// that read the server's settings.
func TestServerBoundsHeaders(t *testing.T) {
	j := newJoinCA(t)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(rpc.ServerOptions(j.cert)...)
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)

	send := func(headerBytes int) (http2.Frame, error) {
		t.Helper()
		conn, err := tls.Dial("tcp", lis.Addr().String(), &tls.Config{InsecureSkipVerify: true, NextProtos: []string{"h2"}, MinVersion: tls.VersionTLS13})
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		conn.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.WriteString(conn, http2.ClientPreface); err != nil {
			t.Fatal(err)
		}
		fr := http2.NewFramer(conn, conn)
		if err := fr.WriteSettings(); err != nil {
			t.Fatal(err)
		}
		var block bytes.Buffer
		enc := hpack.NewEncoder(&block)
		for _, f := range []hpack.HeaderField{
			{Name: ":method", Value: "POST"}, {Name: ":scheme", Value: "https"}, {Name: ":path", Value: "/berth.v1.JoinService/IssueJoinTicket"},
			{Name: ":authority", Value: "join"}, {Name: "content-type", Value: "application/grpc"}, {Name: "te", Value: "trailers"},
			{Name: "x-filler", Value: strings.Repeat("a", headerBytes)},
		} {
			if err := enc.WriteField(f); err != nil {
				t.Fatal(err)
			}
		}
		data := block.Bytes()
		const chunk = 16 << 10
		first := data[:min(chunk, len(data))]
		if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: first, EndHeaders: len(data) <= chunk}); err != nil {
			return nil, err
		}
		for rest := data[len(first):]; len(rest) > 0; {
			n := min(chunk, len(rest))
			if err := fr.WriteContinuation(1, n == len(rest), rest[:n]); err != nil {
				return nil, err
			}
			rest = rest[n:]
		}
		// The server answers a stream's headers (RST_STREAM, HEADERS) or the connection (GOAWAY).
		for {
			f, err := fr.ReadFrame()
			if err != nil {
				return nil, err
			}
			switch f.(type) {
			case *http2.RSTStreamFrame, *http2.GoAwayFrame, *http2.HeadersFrame:
				return f, nil
			}
		}
	}

	// Refused means a reset stream, a GOAWAY, or the connection closed under the client (while it still
	// writes the header, or before it reads an answer); only a timeout or an answer is not.
	f, err := send(64 << 10)
	var ne net.Error
	switch {
	case errors.As(err, &ne) && ne.Timeout():
		t.Fatalf("the server neither answered nor refused a 64 KiB header: %v", err)
	case err == nil:
		if h, ok := f.(*http2.HeadersFrame); ok {
			t.Fatalf("a 64 KiB header was answered with headers on stream %d, want the stream or connection refused", h.StreamID)
		}
	}
	// A small header gets an answer of gRPC's own (an error status in response headers), showing the
	// refusal above is the size's.
	if f, err := send(100); err != nil {
		t.Fatalf("a 100-byte header: %v", err)
	} else if _, ok := f.(*http2.HeadersFrame); !ok {
		t.Fatalf("a 100-byte header was answered with %T, want response headers", f)
	}
}
