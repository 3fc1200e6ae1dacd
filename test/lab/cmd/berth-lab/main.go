// Command berth-lab brings a local attested Berth cluster up and takes it down again: `make lab` and
// `make lab-down`. It needs root.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/test/lab"
)

const usage = `berth-lab: a local attested Berth cluster.

  berth-lab up   --dir DIR --kube-bin DIR --agent FILE   one control-plane node and two workers
  berth-lab down --dir DIR                               remove everything the lab made
  berth-lab metadata --document FILE --listen ADDR       the lab's instance-metadata service (run by up)
`

func main() {
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	fs := flag.NewFlagSet(os.Args[1], flag.ExitOnError)
	dir := fs.String("dir", "/var/tmp/berth-lab", "the lab's directory")
	kubeBin := fs.String("kube-bin", "", "directory of the Kubernetes binaries (make k8s-tools)")
	agent := fs.String("agent", "bin/berth-agent", "the berth-agent binary")
	document := fs.String("document", "", "metadata: the instance document")
	listen := fs.String("listen", "", "metadata: listen address")
	fs.Parse(os.Args[2:])
	var err error
	switch os.Args[1] {
	case "up":
		err = up(ctx, *dir, *kubeBin, *agent)
	case "down":
		err = lab.Down(ctx, *dir)
		if err == nil {
			fmt.Println("lab removed; nothing left:", len(lab.Leftovers(*dir)) == 0)
		}
	case "metadata":
		err = serveMetadata(ctx, *document, *listen)
	default:
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "berth-lab:", err)
		os.Exit(1)
	}
}

func up(ctx context.Context, dir, kubeBin, agent string) error {
	self, err := os.Executable()
	if err != nil {
		return err
	}
	if kubeBin == "" {
		return errors.New("--kube-bin is required (make k8s-tools prints it)")
	}
	start := time.Now()
	l, err := lab.Up(ctx, lab.Config{Dir: dir, KubeBin: kubeBin, AgentBinary: agent, LabBinary: self,
		Nodes: lab.DefaultNodes, Progress: os.Stdout})
	if err != nil {
		return fmt.Errorf("%w\n(the lab stays up for inspection: make lab-down removes it)", err)
	}
	fmt.Printf("\nlab up in %.1fs\n\n", time.Since(start).Seconds())
	out, err := l.Kubectl(ctx, "get", "nodes", "-o", "wide")
	if err != nil {
		return err
	}
	fmt.Println(out)
	fmt.Println()
	fmt.Printf("%-10s %-14s %-14s %s\n", "NODE", "BOOT TO READY", "RESIDENT", "PEAK WITH CACHE")
	for _, n := range l.Nodes {
		rss, peak := "?", "?"
		if p, r, err := n.Memory(); err == nil {
			rss, peak = fmt.Sprintf("%d MiB", r>>20), fmt.Sprintf("%d MiB", p>>20)
		}
		fmt.Printf("%-10s %-14s %-14s %s\n", n.Name, l.Timings["ready/"+n.Name].Round(100*time.Millisecond), rss, peak)
	}
	fmt.Printf("\nkubectl --kubeconfig %s get nodes\n", l.Kubeconfig)
	return nil
}

func serveMetadata(ctx context.Context, document, listen string) error {
	data, err := os.ReadFile(document)
	if err != nil {
		return err
	}
	doc, err := metadata.ParseDocument(data)
	if err != nil {
		return err
	}
	lis, err := net.Listen("tcp", listen)
	if err != nil {
		return err
	}
	logger := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	srv := &http.Server{Handler: metadata.NewServer(doc, logger), ReadHeaderTimeout: 5 * time.Second,
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
