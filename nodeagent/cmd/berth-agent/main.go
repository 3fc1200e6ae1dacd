// Command berth-agent runs on every Berth node at every boot: it unlocks or creates the encrypted state
// disk, attests with the TPM, joins the cluster (or initializes it) and, on control-plane nodes, serves
// the join service.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"os/signal"
	"runtime"
	"syscall"
	"time"

	"github.com/berthlabs/berth/nodeagent/internal/agent"
)

// Set at build time with -ldflags "-X main.version=…".
var version = "dev"

// kubernetesVersion is the Kubernetes release this build of the agent is tested with.
const kubernetesVersion = "v1.36.3"

const usage = `berth-agent: make this machine a Berth cluster node.

Usage:
  berth-agent boot        [--config FILE]   unlock or create the state disk, attest, join or init, then serve joins on control-plane nodes
  berth-agent joinservice [--config FILE]   serve join tickets from this control-plane node's stored secrets
  berth-agent joinservice --service-config FILE
                                            serve join tickets beside an external control plane (workers
                                            join without kubeadm; see docs/external-control-plane.md)
  berth-agent status      [--config FILE] [--json]   what this node is and why
  berth-agent measure     --uki FILE [--json]        predict the PCR values booting this UKI produces
  berth-agent recover     --node HOST:PORT --root-key-file FILE|- --ek-ca-bundle FILE (--policy FILE | --manifest FILE --image NAME)
                                            give a node that cannot unlock its state disk its key back, from
                                            the cluster's root key, once it proved its image (docs/recovery.md)
  berth-agent version

Flags of boot, joinservice and status: --log-level debug|info|warn|error, --debug-listen ADDR (pprof on a
loopback address, for profiling).
`

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	cmd, args := args[0], args[1:]
	fs := flag.NewFlagSet("berth-agent "+cmd, flag.ContinueOnError)
	fs.SetOutput(stderr)
	configPath := fs.String("config", agent.DefaultConfigPath, "agent configuration file")
	logLevel := fs.String("log-level", "info", "debug, info, warn or error")
	asJSON := fs.Bool("json", false, "status: print JSON")
	serviceConfig := fs.String("service-config", "", "joinservice: run beside an external control plane with this configuration (e.g. "+agent.DefaultServiceConfigPath+")")
	debugListen := fs.String("debug-listen", "", "serve Go's pprof profiles on this address, such as 127.0.0.1:6060 (never a public one)")
	switch cmd {
	case "version", "--version":
		fmt.Fprintf(stdout, "berth-agent %s (Kubernetes %s, %s %s/%s)\n", version, kubernetesVersion, runtime.Version(), runtime.GOOS, runtime.GOARCH)
		return 0
	case "measure":
		return runMeasure(args, stdout, stderr)
	case "recover":
		return runRecover(args, stdout, stderr)
	case "boot", "joinservice", "status":
	case "help", "-h", "--help":
		fmt.Fprint(stdout, usage)
		return 0
	default:
		fmt.Fprintf(stderr, "berth-agent: unknown command %q\n\n%s", cmd, usage)
		return 2
	}
	if err := fs.Parse(args); err != nil {
		return 2
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(*logLevel)); err != nil {
		fmt.Fprintf(stderr, "berth-agent: --log-level: %v\n", err)
		return 2
	}
	logger := slog.New(slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: level}))
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if *debugListen != "" {
		if err := serveDebug(ctx, *debugListen, logger); err != nil {
			logger.Error("debug listener", "error", err)
			return 1
		}
	}
	if *serviceConfig != "" {
		if cmd != "joinservice" {
			fmt.Fprintf(stderr, "berth-agent %s: --service-config is a flag of joinservice\n", cmd)
			return 2
		}
		cfg, err := agent.LoadServiceConfig(*serviceConfig)
		if err != nil {
			logger.Error("configuration", "error", err)
			return 1
		}
		return exit(cmd, agent.ServeStandalone(ctx, cfg, agent.KubeClient, logger), logger)
	}
	cfg, err := agent.LoadConfig(*configPath)
	if err != nil {
		logger.Error("configuration", "error", err)
		return 1
	}
	a, err := agent.New(cfg, agent.RealDeps(cfg, logger))
	if err != nil {
		logger.Error("configuration", "error", err)
		return 1
	}
	switch cmd {
	case "status":
		s := a.Status(ctx)
		if *asJSON {
			enc := json.NewEncoder(stdout)
			enc.SetIndent("", "  ")
			if err := enc.Encode(s); err != nil {
				return 1
			}
			return 0
		}
		s.Print(stdout)
		return 0
	case "boot":
		err = a.Boot(ctx)
	case "joinservice":
		err = a.ServeJoinService(ctx)
	}
	return exit(cmd, err, logger)
}

// exit is the exit code of a command that ended with err; a stop by signal is no failure.
func exit(cmd string, err error, logger *slog.Logger) int {
	if err != nil && !errors.Is(err, context.Canceled) {
		logger.Error(cmd+" failed", "error", err)
		return 1
	}
	return 0
}

// serveDebug serves net/http/pprof's profiles until ctx ends, for profiling a node's join service under load.
func serveDebug(ctx context.Context, addr string, logger *slog.Logger) error {
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(lis)
	go func() {
		<-ctx.Done()
		srv.Close()
	}()
	logger.Info("serving pprof", "address", lis.Addr().String())
	return nil
}
