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

	"golang.org/x/sys/unix"

	"github.com/berthlabs/berth/nodeagent/internal/agent"
	"github.com/berthlabs/berth/nodeagent/internal/joinserver"
	"github.com/berthlabs/berth/nodeagent/internal/telemetry"
)

// Set at build time with -ldflags "-X main.version=…".
var version = "dev"

// kubernetesVersion is the Kubernetes release this build of the agent is tested with.
const kubernetesVersion = "v1.36.3"

// Exit codes, documented in docs/agent.md so that scripts and systemd units (RestartPreventExitStatus=)
// can tell a node that failed from a machine that was set up wrong.
const (
	exitOK = 0
	// exitFailure: the command ran and failed; boot run again resumes where it stopped.
	exitFailure = 1
	// exitUsage: the command line is wrong; nothing was done.
	exitUsage = 2
	// exitConfig: the configuration file is missing, unreadable or invalid; nothing was done, and running
	// again does not help until the file is fixed.
	exitConfig = 3
	// status answers 0 for a member and these for the other states of agent.Status.
	exitWillJoin = 4
	exitBlocked  = 5
	exitUnknown  = 6
)

const usage = `berth-agent: make this machine a Berth cluster node.

Usage:
  berth-agent boot        [--config FILE]   unlock or create the state disk, attest, join or init, then serve joins on control-plane nodes
  berth-agent joinservice [--config FILE]   serve join tickets from this control-plane node's stored secrets
  berth-agent joinservice --service-config FILE
                                            serve join tickets beside an external control plane (workers
                                            join without kubeadm; see docs/external-control-plane.md)
  berth-agent status      [--config FILE] [--json]   what this node is and why
  berth-agent doctor      [--config FILE] [--manifest FILE --image NAME] [--json]
                                            check the TPM, the boot's PCRs, containerd and the kernel settings
                                            a node needs (docs/node-image.md); exit 1 if one fails
  berth-agent ebs-name    DEVICE            the block device mapping name of an EBS volume (for udev)
  berth-agent measure     --uki FILE [--json]        predict the PCR values booting this UKI produces
  berth-agent recover     --node HOST:PORT --root-key-file FILE|- --ek-ca-bundle FILE (--policy FILE | --manifest FILE --image NAME)
                                            give a node that cannot unlock its state disk its key back, from
                                            the cluster's root key, once it proved its image (docs/recovery.md)
  berth-agent version

"berth-agent COMMAND --help" lists the command's flags.
Exit codes: 0 done, 1 failed, 2 wrong command line, 3 configuration missing or invalid;
status: 0 member, 4 will join at the next boot, 5 blocked, 6 cannot tell.
`

// commands are the subcommands that take flags, each parsing its own.
var commands = map[string]func(args []string, stdout, stderr io.Writer) int{
	"boot":        runBoot,
	"joinservice": runJoinService,
	"status":      runStatus,
	"doctor":      runDoctor,
	"ebs-name":    runEBSName,
	"measure":     runMeasure,
	"recover":     runRecover,
}

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return exitUsage
	}
	cmd, args := args[0], args[1:]
	if runCmd, ok := commands[cmd]; ok {
		return runCmd(args, stdout, stderr)
	}
	switch cmd {
	case "version", "--version":
		fmt.Fprintf(stdout, "berth-agent %s (Kubernetes %s, %s %s/%s)\n", version, kubernetesVersion, runtime.Version(), runtime.GOOS, runtime.GOARCH)
		return exitOK
	case "help", "-h", "--help":
		if len(args) == 1 {
			if runCmd, ok := commands[args[0]]; ok {
				return runCmd([]string{"--help"}, stdout, stderr)
			}
		}
		fmt.Fprint(stdout, usage)
		return exitOK
	default:
		fmt.Fprintf(stderr, "berth-agent: unknown command %q\n\n%s", cmd, usage)
		return exitUsage
	}
}

// parseFlags parses a subcommand's arguments. It returns ok, or the exit code: --help prints the usage on
// stdout and exits 0, as a person asked for it; a wrong flag or a stray argument is a usage error.
func parseFlags(fs *flag.FlagSet, synopsis string, args []string, stdout, stderr io.Writer) (code int, ok bool) {
	fs.SetOutput(stderr)
	// flag's default would print every flag after each mistake; one line saying where to look is enough.
	fs.Usage = func() {}
	err := fs.Parse(args)
	switch {
	case errors.Is(err, flag.ErrHelp):
		fmt.Fprintf(stdout, "Usage: %s\n\nFlags:\n", synopsis)
		fs.SetOutput(stdout)
		fs.PrintDefaults()
		return exitOK, false
	case err != nil:
		fmt.Fprintf(stderr, "Usage: %s\n(%s --help lists the flags)\n", synopsis, fs.Name())
		return exitUsage, false
	case fs.NArg() > 0:
		fmt.Fprintf(stderr, "%s: unexpected argument %q\nUsage: %s\n", fs.Name(), fs.Arg(0), synopsis)
		return exitUsage, false
	}
	return exitOK, true
}

// serviceFlags are the flags boot and joinservice share.
type serviceFlags struct {
	config, logLevel, debugListen *string
}

func addServiceFlags(fs *flag.FlagSet) serviceFlags {
	return serviceFlags{
		config:      fs.String("config", agent.DefaultConfigPath, "agent configuration file"),
		logLevel:    fs.String("log-level", "info", "debug, info, warn or error"),
		debugListen: fs.String("debug-listen", "", "serve Go's pprof profiles on this address, such as 127.0.0.1:6060 (never a public one)"),
	}
}

func runBoot(args []string, stdout, stderr io.Writer) int {
	const synopsis = "berth-agent boot [--config FILE] [--log-level LEVEL] [--debug-listen ADDR]"
	fs := flag.NewFlagSet("berth-agent boot", flag.ContinueOnError)
	f := addServiceFlags(fs)
	if code, ok := parseFlags(fs, synopsis, args, stdout, stderr); !ok {
		return code
	}
	r, code, ok := startService("boot", f, stderr)
	if !ok {
		return code
	}
	defer r.stop()
	a, code, ok := r.newAgent(*f.config)
	if !ok {
		return code
	}
	return r.done(a.Boot(r.ctx))
}

func runJoinService(args []string, stdout, stderr io.Writer) int {
	const synopsis = "berth-agent joinservice [--config FILE | --service-config FILE] [--log-level LEVEL] [--debug-listen ADDR]"
	fs := flag.NewFlagSet("berth-agent joinservice", flag.ContinueOnError)
	f := addServiceFlags(fs)
	serviceConfig := fs.String("service-config", "", "run beside an external control plane with this configuration (e.g. "+joinserver.DefaultServiceConfigPath+") instead of --config's")
	if code, ok := parseFlags(fs, synopsis, args, stdout, stderr); !ok {
		return code
	}
	if *serviceConfig != "" && flagSet(fs, "config") {
		fmt.Fprintf(stderr, "berth-agent joinservice: --config and --service-config exclude each other\nUsage: %s\n", synopsis)
		return exitUsage
	}
	r, code, ok := startService("joinservice", f, stderr)
	if !ok {
		return code
	}
	defer r.stop()
	if *serviceConfig != "" {
		cfg, err := joinserver.LoadServiceConfig(*serviceConfig)
		if err != nil {
			return r.fail(exitConfig, "configuration", err)
		}
		return r.done(joinserver.ServeStandalone(r.ctx, cfg, agent.KubeClient, r.log, build))
	}
	a, code, ok := r.newAgent(*f.config)
	if !ok {
		return code
	}
	return r.done(a.ServeJoinService(r.ctx))
}

func runStatus(args []string, stdout, stderr io.Writer) int {
	const synopsis = "berth-agent status [--config FILE] [--json] [--log-level LEVEL]"
	fs := flag.NewFlagSet("berth-agent status", flag.ContinueOnError)
	configPath := fs.String("config", agent.DefaultConfigPath, "agent configuration file")
	asJSON := fs.Bool("json", false, "print the status as JSON (its state field is the exit code's word)")
	logLevel := fs.String("log-level", "warn", "debug, info, warn or error")
	if code, ok := parseFlags(fs, synopsis, args, stdout, stderr); !ok {
		return code
	}
	level, err := parseLevel(*logLevel)
	if err != nil {
		fmt.Fprintf(stderr, "berth-agent status: %v\n", err)
		return exitUsage
	}
	// status answers a person or a script, never journald: what stops it is a sentence, not a log event.
	fail := func(code int, err error) int {
		fmt.Fprintf(stderr, "berth-agent status: %v\n", err)
		return code
	}
	cfg, err := agent.LoadConfig(*configPath)
	if err != nil {
		return fail(exitConfig, err)
	}
	logger := newLogger(stderr, level)
	a, err := agent.New(cfg, realDeps(cfg, logger))
	if err != nil {
		return fail(exitConfig, fmt.Errorf("agent configuration %s: %w", *configPath, err))
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	s := a.Status(ctx)
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(s); err != nil {
			return fail(exitFailure, fmt.Errorf("writing the status: %w", err))
		}
	} else {
		s.Print(stdout)
	}
	return statusCode(s.State)
}

// statusCode is status's exit code for a node in state.
func statusCode(state string) int {
	switch state {
	case agent.StateMember:
		return exitOK
	case agent.StateWillJoin:
		return exitWillJoin
	case agent.StateBlocked:
		return exitBlocked
	default:
		return exitUnknown
	}
}

// service is a running boot or joinservice: its context, ended by SIGTERM (systemd's stop) or Ctrl-C,
// and how it reports.
type service struct {
	cmd  string
	ctx  context.Context
	stop context.CancelFunc
	log  *slog.Logger
	// human is set when stderr is the controlling terminal: failures are then sentences, not JSON log events.
	human  bool
	stderr io.Writer
}

// startService sets up logging and, if asked, the pprof listener of a boot or joinservice.
func startService(cmd string, f serviceFlags, stderr io.Writer) (*service, int, bool) {
	level, err := parseLevel(*f.logLevel)
	if err != nil {
		fmt.Fprintf(stderr, "berth-agent %s: %v\n", cmd, err)
		return nil, exitUsage, false
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	s := &service{cmd: cmd, ctx: ctx, stop: stop, log: newLogger(stderr, level), human: isTerminal(stderr), stderr: stderr}
	if *f.debugListen != "" {
		if err := serveDebug(ctx, *f.debugListen, s.log); err != nil {
			stop()
			return nil, s.fail(exitFailure, "debug listener", fmt.Errorf("--debug-listen: %w", err)), false
		}
	}
	return s, exitOK, true
}

// build is this build, as the metrics name it.
var build = telemetry.Build{Version: version, KubernetesVersion: kubernetesVersion}

// realDeps are a real node's dependencies, with this build's versions for the metrics.
func realDeps(cfg *agent.Config, log *slog.Logger) agent.Deps {
	deps := agent.RealDeps(cfg, log)
	deps.Build = build
	return deps
}

// newAgent loads the agent configuration at path and wires the agent.
func (s *service) newAgent(path string) (*agent.Agent, int, bool) {
	cfg, err := agent.LoadConfig(path)
	if err != nil {
		return nil, s.fail(exitConfig, "configuration", err), false
	}
	a, err := agent.New(cfg, realDeps(cfg, s.log))
	if err != nil {
		return nil, s.fail(exitConfig, "configuration", fmt.Errorf("agent configuration %s: %w", path, err)), false
	}
	return a, exitOK, true
}

// done is the exit code of the command that ended with err; a stop by signal is no failure.
func (s *service) done(err error) int {
	if err != nil && !errors.Is(err, context.Canceled) {
		return s.fail(exitFailure, s.cmd+" failed", err)
	}
	return exitOK
}

// fail reports err, which ends the command with code: as a sentence on a terminal, else as a JSON log
// event (msg) beside the command's others, which is what journald and the labs' log readers take.
func (s *service) fail(code int, msg string, err error) int {
	if s.human {
		fmt.Fprintf(s.stderr, "berth-agent %s: %v\n", s.cmd, err)
	} else {
		s.log.Error(msg, "error", err.Error())
	}
	return code
}

func parseLevel(name string) (slog.Level, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(name)); err != nil {
		return level, fmt.Errorf("--log-level: %q is not debug, info, warn or error", name)
	}
	return level, nil
}

// newLogger logs JSON lines, one event each, for journald and log collectors, unless w is the terminal a
// person reads, who gets key=value lines.
func newLogger(w io.Writer, level slog.Level) *slog.Logger {
	opts := &slog.HandlerOptions{Level: level}
	if !isTerminal(w) {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	opts.ReplaceAttr = func(groups []string, a slog.Attr) slog.Attr {
		if a.Key == slog.TimeKey && len(groups) == 0 {
			a.Value = slog.StringValue(a.Value.Time().Format(time.TimeOnly))
		}
		return a
	}
	return slog.New(slog.NewTextHandler(w, opts))
}

// isTerminal says whether w is this process's controlling terminal: the one a person typed the command
// at. A terminal that is no process's controlling one, such as the serial console an image's init hands
// the agent, is read by machines (serial console logs, the measured-boot test) and gets JSON.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	// tcgetpgrp(3) succeeds only on the caller's controlling terminal.
	_, err := unix.IoctlGetInt(int(f.Fd()), unix.TIOCGPGRP)
	return err == nil
}

// flagSet says whether the command line set the flag name, even to its default.
func flagSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
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
