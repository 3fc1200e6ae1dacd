// Command probe is the lab's network workload, in the image berthlab.local/probe.
//
//	probe serve ADDR          answers every HTTP request with the pod's name (its hostname)
//	probe fetch URL N WITHIN  asks URL until N different pods have answered, then prints their names
//
// fetch resolves URL's host on every request, as any client of a Service would, so a pod that runs it
// proves the cluster's DNS, the Service's virtual address (kube-proxy) and the pod network from its node to
// each answering pod's node. It exits 1 naming the last error if WITHIN passes first.
package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "probe:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	switch {
	case len(args) == 2 && args[0] == "serve":
		return serve(args[1])
	case len(args) == 4 && args[0] == "fetch":
		n, err := strconv.Atoi(args[2])
		if err != nil || n < 1 {
			return fmt.Errorf("fetch: %q is not a count of pods", args[2])
		}
		within, err := time.ParseDuration(args[3])
		if err != nil {
			return fmt.Errorf("fetch: %w", err)
		}
		return fetch(args[1], n, within)
	}
	return fmt.Errorf("usage: probe serve ADDR | probe fetch URL N WITHIN (got %q)", args)
}

func serve(addr string) error {
	name, err := os.Hostname()
	if err != nil {
		return err
	}
	srv := &http.Server{
		Addr:              addr,
		ReadHeaderTimeout: 5 * time.Second,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			fmt.Fprintln(w, name)
		}),
	}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		<-stop
		srv.Close()
	}()
	if err := srv.ListenAndServe(); err != http.ErrServerClosed {
		return err
	}
	return nil
}

func fetch(url string, n int, within time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	// A new connection per request: kube-proxy picks a backend per connection.
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	var seen []string
	var last error
	for {
		name, err := get(ctx, client, url)
		switch {
		case err != nil:
			last = err
		case !slices.Contains(seen, name):
			seen = append(seen, name)
			fmt.Printf("answered by %s\n", name)
		}
		if len(seen) == n {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%d of %d pods answered %s within %s (last error: %v)", len(seen), n, url, within, last)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func get(ctx context.Context, client *http.Client, url string) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", err
	}
	resp, err := client.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 256))
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("%s: %s", url, resp.Status)
	}
	return strings.TrimSpace(string(body)), nil
}
