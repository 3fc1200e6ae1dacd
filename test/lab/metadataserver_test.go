package lab

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"testing"

	"github.com/berthlabs/berth/internal/metadata"
)

// TestServeMetadataFollowsTheDocument starts the lab's metadata service on an empty document, as StartHost
// writes it, and checks that nodes added to and removed from the file by rename are served at the next
// request, and that a broken document leaves the last good one served.
func TestServeMetadataFollowsTheDocument(t *testing.T) {
	path := filepath.Join(t.TempDir(), "metadata.json")
	if err := writeJSON(path, &metadata.Document{Instances: []metadata.Instance{}}); err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ServeMetadata(ctx, lis, path, slog.New(slog.DiscardHandler)) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("ServeMetadata: %v", err)
		}
	})
	base := "http://" + lis.Addr().String()
	get := func(p string, out any) int {
		t.Helper()
		resp, err := http.Get(base + p)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		if out != nil && resp.StatusCode == http.StatusOK {
			if err := json.Unmarshal(body, out); err != nil {
				t.Fatalf("%s: %v: %s", p, err, body)
			}
		}
		return resp.StatusCode
	}

	var instances []metadata.Instance
	if code := get(metadata.PathInstances, &instances); code != http.StatusOK || len(instances) != 0 {
		t.Fatalf("empty lab: status %d, instances %v", code, instances)
	}
	if code := get(metadata.PathSelf, nil); code != http.StatusNotFound {
		t.Fatalf("self of an unknown caller: status %d", code)
	}

	doc := &metadata.Document{}
	if err := admit(doc, testMachine("node-0", "10.250.0.10", "")); err != nil {
		t.Fatal(err)
	}
	// The caller of this test is 127.0.0.1: a second address makes it the node.
	doc.Instances[0].Addresses = append(doc.Instances[0].Addresses, netip.MustParseAddr("127.0.0.1"))
	if err := writeJSON(path, doc); err != nil {
		t.Fatal(err)
	}
	var self metadata.Self
	if code := get(metadata.PathSelf, &self); code != http.StatusOK || self.Instance.Name != "node-0" || self.Instance.ImageID != "berthlab-a" || self.UserData.ClusterName != "lab" {
		t.Fatalf("after adding a node: status %d, self %+v", code, self)
	}

	if err := os.WriteFile(path, []byte(`{"userData": {}, "instances": [{"name": "x"}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if code := get(metadata.PathSelf, &self); code != http.StatusOK || self.Instance.Name != "node-0" {
		t.Fatalf("after a broken document: status %d, self %+v; want the last good document", code, self)
	}

	doc.Instances = nil
	if err := writeJSON(path, doc); err != nil {
		t.Fatal(err)
	}
	if code := get(metadata.PathSelf, nil); code != http.StatusNotFound {
		t.Fatalf("after removing the node: self status %d", code)
	}
}
