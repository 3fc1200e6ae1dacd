package lab

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/test/gcemetadatatest"
)

// ServeMetadata serves the metadata document in the file document on lis until ctx ends. Nodes come and go
// while it runs (AddNode and RemoveNode replace the file by rename), so every request first checks whether
// the file changed and serves the new document if so; a document that does not parse is logged and the
// last good one served.
func ServeMetadata(ctx context.Context, lis net.Listener, document string, logger *slog.Logger) error {
	h := &reloadingDocument{path: document, logger: logger}
	doc, stamp, err := h.read()
	if err != nil {
		return err
	}
	h.srv, h.stamp = metadata.NewServer(doc, logger), stamp
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 10 * time.Second,
		WriteTimeout: 10 * time.Second, MaxHeaderBytes: 16 << 10}
	go func() {
		<-ctx.Done()
		srv.Close()
	}()
	if err := srv.Serve(lis); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// fileStamp tells one version of a file from the next: a rename gives a new inode, a rewrite in place a
// new time or size.
type fileStamp struct {
	ino   uint64
	size  int64
	mtime time.Time
}

type reloadingDocument struct {
	path   string
	logger *slog.Logger
	srv    *metadata.Server

	mu    sync.Mutex
	stamp fileStamp
}

func (h *reloadingDocument) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h.reload()
	h.srv.ServeHTTP(w, r)
}

func (h *reloadingDocument) reload() {
	h.mu.Lock()
	defer h.mu.Unlock()
	fi, err := os.Stat(h.path)
	if err != nil {
		h.logger.Error("metadata document unreadable; serving the last one", "path", h.path, "error", err)
		return
	}
	if stampOf(fi) == h.stamp {
		return
	}
	doc, stamp, err := h.read()
	if err != nil {
		h.logger.Error("metadata document changed but does not parse; serving the last one", "path", h.path, "error", err)
		return
	}
	h.srv.Replace(doc)
	h.stamp = stamp
}

// read reads the document with the stamp of the version read.
func (h *reloadingDocument) read() (*metadata.Document, fileStamp, error) {
	fi, err := os.Stat(h.path)
	if err != nil {
		return nil, fileStamp{}, err
	}
	doc, err := readDocument(h.path)
	return doc, stampOf(fi), err
}

func stampOf(fi os.FileInfo) fileStamp {
	st := fileStamp{size: fi.Size(), mtime: fi.ModTime()}
	if sys, ok := fi.Sys().(*syscall.Stat_t); ok {
		st.ino = sys.Ino
	}
	return st
}

// ServeGCEMetadata serves, on lis until ctx ends, one Compute Engine instance's metadata server as the
// instance in the JSON file config describes it (gcemetadatatest.Instance): a GCP lab node's, on
// 169.254.169.254:80 inside its network namespace.
func ServeGCEMetadata(ctx context.Context, lis net.Listener, config string) error {
	data, err := os.ReadFile(config)
	if err != nil {
		return err
	}
	var inst gcemetadatatest.Instance
	if err := json.Unmarshal(data, &inst); err != nil {
		return fmt.Errorf("reading %s: %w", config, err)
	}
	srv := &http.Server{Handler: gcemetadatatest.NewHandler(inst), ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout: 10 * time.Second, WriteTimeout: 10 * time.Second, MaxHeaderBytes: 16 << 10}
	go func() {
		<-ctx.Done()
		srv.Close()
	}()
	if err := srv.Serve(lis); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
