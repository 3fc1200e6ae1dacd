// Command berth-lab runs a local attested Berth cluster: `make lab` and `make lab-down`, and the machines
// Terraform's lab example creates, one process per node. It needs root.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"log/slog"
	"maps"
	"net"
	"net/netip"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/test/lab"
)

const usage = `berth-lab: a local attested Berth cluster.

  berth-lab up   --dir DIR --kube-bin DIR --agent FILE
        host, one control-plane node and two workers, attested init, wait until Ready (all in this process)
  berth-lab down --dir DIR
        remove everything the lab made, nodes added by "node up" included

  berth-lab host --dir DIR --kube-bin DIR --agent FILE [--upgrade-kube-bin DIR[,DIR]]
        the lab's host only: bridge, images, EK CA, image manifest, metadata service; prints the paths of
        the image manifest (berth-image.json) and the EK CA bundle. Each --upgrade-kube-bin directory holds
        the binaries of a release to upgrade to, in order, and adds an image of it (berthlab-up1, …)
  berth-lab node up --dir DIR --name NAME --role control-plane|worker --addr 10.250.0.X
                    --image berthlab-a|berthlab-b|berthlab-upN --user-data JSON [--kube-bin DIR]
        add a machine to the host and power it on (JSON: berth_node_config's json); returns once its agent runs.
        --kube-bin gives it Kubernetes binaries of its own, of another release than the lab's
  berth-lab node reimage --dir DIR --name NAME --image IMAGE
        power a machine off, put another image on it and power it on: a reinstall in place that keeps its
        TPM and state disk, as a bare-metal roll does
  berth-lab node down --dir DIR --name NAME
        power a machine off and remove it; removing a machine that is not there
        (or from a lab that is gone) is no error
  berth-lab wait --dir DIR --kubeconfig FILE [--timeout 10m]
        wait until every machine of the lab is Ready, then print them

  berth-lab e2e-images --dir DIR --e2e-bin DIR --k8s-source DIR
        make the images Kubernetes' e2e suite (e2e.test in --e2e-bin, scripts/build-e2e.sh) lists, from the
        Kubernetes module's test images in --k8s-source and Debian's programs, and load them into every node;
        writes DIR/e2e-images/repo-list.yaml for KUBE_TEST_REPO_LIST and lists the images it cannot make

  berth-lab metadata --document FILE --listen ADDR
        the lab's instance-metadata service (started by host and up)
  berth-lab gce-metadata --config FILE --listen ADDR
        a GCP lab node's GCE metadata server (started at the node's power-on, in its network namespace)
`

func main() {
	args := os.Args[1:]
	if len(args) == 0 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	command := args[0]
	args = args[1:]
	if command == "node" {
		if len(args) == 0 {
			fmt.Fprint(os.Stderr, usage)
			os.Exit(2)
		}
		command, args = "node "+args[0], args[1:]
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	fs := flag.NewFlagSet(command, flag.ExitOnError)
	fs.Usage = func() { fmt.Fprint(os.Stderr, usage) }
	dir := fs.String("dir", "/var/tmp/berth-lab", "the lab's directory")
	kubeBin := fs.String("kube-bin", "", "directory of the Kubernetes binaries (make k8s-tools)")
	upgradeKubeBins := fs.String("upgrade-kube-bin", "", "host: directories of the binaries of releases to upgrade to, comma-separated")
	agent := fs.String("agent", "bin/berth-agent", "the berth-agent binary")
	name := fs.String("name", "", "node: the machine's name")
	role := fs.String("role", "", "node up: control-plane or worker")
	addr := fs.String("addr", "", "node up: the machine's address in 10.250.0.0/24")
	image := fs.String("image", "", "node up, node reimage: the machine's image")
	userData := fs.String("user-data", "", "node up: the machine's user-data JSON")
	kubeconfig := fs.String("kubeconfig", "", "wait: the cluster's admin kubeconfig")
	timeout := fs.Duration("timeout", 10*time.Minute, "wait: how long to wait")
	document := fs.String("document", "", "metadata: the instance document")
	listen := fs.String("listen", "", "metadata, gce-metadata: listen address")
	gceConfig := fs.String("config", "", "gce-metadata: the instance, as JSON")
	e2eBin := fs.String("e2e-bin", "", "e2e-images: the directory of e2e.test, agnhost and nnp")
	k8sSource := fs.String("k8s-source", "", "e2e-images: the k8s.io/kubernetes module's directory")
	fs.Parse(args)
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "berth-lab %s: unexpected argument %q\n", command, fs.Arg(0))
		os.Exit(2)
	}
	var err error
	switch command {
	case "up":
		err = up(ctx, *dir, *kubeBin, *agent)
	case "down":
		err = lab.Down(ctx, *dir)
		if err == nil {
			fmt.Println("lab removed; nothing left:", len(lab.Leftovers(*dir)) == 0)
		}
	case "host":
		err = host(ctx, *dir, *kubeBin, *upgradeKubeBins, *agent)
	case "node up":
		err = nodeUp(ctx, *dir, *name, *role, *addr, *image, *userData, *kubeBin)
	case "node reimage":
		err = nodeReimage(ctx, *dir, *name, *image)
	case "node down":
		err = nodeDown(ctx, *dir, *name)
	case "wait":
		err = wait(ctx, *dir, *kubeconfig, *timeout)
	case "e2e-images":
		err = e2eImages(ctx, *dir, *e2eBin, *k8sSource)
	case "metadata":
		err = serveMetadata(ctx, *document, *listen)
	case "gce-metadata":
		err = serveGCEMetadata(ctx, *gceConfig, *listen)
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
	l, err := lab.Up(ctx, lab.Config{HostConfig: lab.HostConfig{Dir: dir, KubeBin: kubeBin, AgentBinary: agent,
		LabBinary: self, Progress: os.Stdout}, Nodes: lab.DefaultNodes})
	if err != nil {
		return fmt.Errorf("%w\n(the lab stays up for inspection: make lab-down removes it)", err)
	}
	fmt.Printf("\nlab up in %.1fs\n\n", time.Since(start).Seconds())
	return report(ctx, l)
}

func host(ctx context.Context, dir, kubeBin, upgradeKubeBins, agent string) error {
	self, err := os.Executable()
	if err != nil {
		return err
	}
	if kubeBin == "" {
		return errors.New("--kube-bin is required (make k8s-tools prints it)")
	}
	cfg := lab.HostConfig{Dir: dir, KubeBin: kubeBin, AgentBinary: agent, LabBinary: self, Progress: os.Stdout}
	if upgradeKubeBins != "" {
		cfg.UpgradeKubeBins = strings.Split(upgradeKubeBins, ",")
	}
	l, err := lab.StartHost(ctx, cfg)
	if err != nil {
		return fmt.Errorf("%w\n(berth-lab down --dir %s removes what was made)", err, dir)
	}
	fmt.Println("manifest:", l.ManifestPath())
	fmt.Println("ek-ca:", l.EKCAPath())
	return nil
}

func nodeUp(ctx context.Context, dir, name, role, addr, image, userData, kubeBin string) error {
	if name == "" || role == "" || addr == "" || image == "" || userData == "" {
		return errors.New("node up needs --name, --role, --addr, --image and --user-data")
	}
	a, err := netip.ParseAddr(addr)
	if err != nil {
		return fmt.Errorf("--addr: %w", err)
	}
	ud, err := metadata.ParseUserData([]byte(userData))
	if err != nil {
		return fmt.Errorf("--user-data: %w", err)
	}
	l, err := lab.Open(dir)
	if err != nil {
		return err
	}
	l.Progress = os.Stdout
	_, err = l.AddNode(ctx, lab.Machine{Name: name, Role: metadata.Role(role), Addr: a, Image: image, UserData: ud, KubeBin: kubeBin})
	return err
}

func nodeReimage(ctx context.Context, dir, name, image string) error {
	if name == "" || image == "" {
		return errors.New("node reimage needs --name and --image")
	}
	l, err := lab.Open(dir)
	if err != nil {
		return err
	}
	l.Progress = os.Stdout
	n := l.Node(name)
	if n == nil {
		return fmt.Errorf("the lab in %s has no machine %s", dir, name)
	}
	return n.Reimage(ctx, image)
}

func nodeDown(ctx context.Context, dir, name string) error {
	if name == "" {
		return errors.New("node down needs --name")
	}
	// Removing is idempotent down to the lab itself: a lab taken down has no nodes left to remove.
	if _, err := os.Stat(dir); errors.Is(err, fs.ErrNotExist) {
		fmt.Printf("no lab in %s: node %s is not there\n", dir, name)
		return nil
	}
	l, err := lab.Open(dir)
	if err != nil {
		return err
	}
	l.Progress = os.Stdout
	return l.RemoveNode(ctx, name)
}

func wait(ctx context.Context, dir, kubeconfig string, timeout time.Duration) error {
	if kubeconfig == "" {
		return errors.New("wait needs --kubeconfig")
	}
	l, err := lab.Open(dir)
	if err != nil {
		return err
	}
	l.Progress, l.Kubeconfig = os.Stdout, kubeconfig
	waitCtx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if err := l.WaitReady(waitCtx, l.Nodes); err != nil {
		return err
	}
	return report(ctx, l)
}

// report prints the cluster's nodes and, per node, the time from boot to Ready and its memory.
func report(ctx context.Context, l *lab.Lab) error {
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
	if document == "" || listen == "" {
		return errors.New("metadata needs --document and --listen")
	}
	lis, err := net.Listen("tcp", listen)
	if err != nil {
		return err
	}
	return lab.ServeMetadata(ctx, lis, document, slog.New(slog.NewJSONHandler(os.Stderr, nil)))
}

func serveGCEMetadata(ctx context.Context, config, listen string) error {
	if config == "" || listen == "" {
		return errors.New("gce-metadata needs --config and --listen")
	}
	lis, err := net.Listen("tcp", listen)
	if err != nil {
		return err
	}
	return lab.ServeGCEMetadata(ctx, lis, config)
}

func e2eImages(ctx context.Context, dir, bin, k8sSource string) error {
	if bin == "" || k8sSource == "" {
		return errors.New("--e2e-bin and --k8s-source are required (scripts/conformance.sh passes both)")
	}
	l, err := lab.Open(dir)
	if err != nil {
		return err
	}
	l.Progress = os.Stdout
	images, err := l.BuildE2EImages(ctx, bin, k8sSource, filepath.Join(dir, "e2e-images"))
	if err != nil {
		return err
	}
	if err := l.LoadImages(ctx, images.Tars); err != nil {
		return err
	}
	fmt.Printf("%d images of the e2e suite made and loaded into %d nodes\n", len(images.Tars), len(l.Nodes))
	for _, ref := range slices.Sorted(maps.Keys(images.Missing)) {
		fmt.Printf("not made: %s (%s)\n", ref, images.Missing[ref])
	}
	return nil
}
