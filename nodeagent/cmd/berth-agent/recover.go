package main

import (
	"context"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/clustersecrets"
	"github.com/berthlabs/berth/internal/manifest"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/nodeagent/internal/recoveryclient"
)

// maxInputFile bounds the files recover reads (policy, manifest, EK bundle, root key).
const maxInputFile = 4 << 20

// runRecover is the operator's side of a recovery (docs/recovery.md): it attests a node that cannot unlock
// its state disk, checks its measurements, and sends it the disk key derived from the root key. It needs
// no agent configuration: it runs on the operator's machine.
func runRecover(args []string, stdout, stderr io.Writer) int {
	const synopsis = "berth-agent recover --node HOST:PORT --root-key-file FILE|- --ek-ca-bundle FILE (--policy FILE | --manifest FILE --image NAME) [--expect-name NAME]"
	fs := flag.NewFlagSet("berth-agent recover", flag.ContinueOnError)
	node := fs.String("node", "", "the node's recovery server, host:port (port 7451 unless the node's initListen says otherwise)")
	rootKeyFile := fs.String("root-key-file", "", "file holding the cluster's root key (berth_secrets' root_key) in base64; - reads standard input")
	policyFile := fs.String("policy", "", "the join policy (YAML, as berth_join_policy writes it) the node's image must be in")
	manifestFile := fs.String("manifest", "", "or: berth-image.json, with --image naming the image the node must run")
	imageName := fs.String("image", "", "the image of --manifest")
	ekCA := fs.String("ek-ca-bundle", "", "PEM bundle of the EK CAs of the node's TPM vendor")
	expectName := fs.String("expect-name", "", "refuse unless the node names itself so (recommended)")
	timeout := fs.Duration("timeout", recoveryclient.DefaultTimeout, "bound of the whole recovery")
	if code, ok := parseFlags(fs, synopsis, args, stdout, stderr); !ok {
		return code
	}
	if *node == "" || *rootKeyFile == "" || *ekCA == "" || (*policyFile == "") == (*manifestFile == "") {
		fmt.Fprintf(stderr, "berth-agent recover: --node, --root-key-file, --ek-ca-bundle and exactly one of --policy and --manifest are required\nUsage: %s\n", synopsis)
		return exitUsage
	}
	cfg, err := recoverConfig(*node, *rootKeyFile, *policyFile, *manifestFile, *imageName, *ekCA, *timeout)
	if err != nil {
		fmt.Fprintf(stderr, "berth-agent recover: %v\n", err)
		return exitFailure
	}
	cfg.Busy = func(attempt int, wait time.Duration) {
		fmt.Fprintf(stderr, "the node is busy with another exchange; asking again in %s (attempt %d)\n", wait, attempt)
	}
	cfg.Confirm = func(n recoveryclient.Node) error {
		fmt.Fprintf(stdout, "attested: node %q (%s), image %q, disk %s, TPM %s\n", n.Name, n.Role, n.Image, n.Disk, n.EK)
		if *expectName != "" && n.Name != *expectName {
			return fmt.Errorf("the node names itself %q, not %q: nothing was sent to it", n.Name, *expectName)
		}
		return nil
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	n, err := recoveryclient.Recover(ctx, cfg)
	if err != nil {
		fmt.Fprintf(stderr, "berth-agent recover: %v\n", err)
		return exitFailure
	}
	fmt.Fprintf(stdout, "recovered: node %q unlocked its state disk %s with the key of this root key\n", n.Name, n.Disk)
	return exitOK
}

func recoverConfig(node, rootKeyFile, policyFile, manifestFile, imageName, ekCA string, timeout time.Duration) (recoveryclient.Config, error) {
	cfg := recoveryclient.Config{Endpoint: node, Timeout: timeout}
	text, err := readInput(rootKeyFile)
	if err != nil {
		return cfg, fmt.Errorf("root key: %w", err)
	}
	if cfg.RootKey, err = clustersecrets.ParseRootKey(string(text)); err != nil {
		return cfg, fmt.Errorf("root key %s: %w", rootKeyFile, err)
	}
	bundle, err := readInput(ekCA)
	if err != nil {
		return cfg, fmt.Errorf("EK CA bundle: %w", err)
	}
	roots, inters, err := attest.ParseCABundle(bundle)
	if err != nil {
		return cfg, fmt.Errorf("EK CA bundle %s: %w", ekCA, err)
	}
	cfg.Verifier = attest.NewVerifier(attest.NewCertChain(roots, inters, nil))
	if cfg.Policy, err = imagesToCheck(policyFile, manifestFile, imageName); err != nil {
		return cfg, err
	}
	return cfg, nil
}

// imagesToCheck is the policy the node's measurements must be in: the join policy, or the one image of a
// manifest, allowed in either role (the operator chose it).
func imagesToCheck(policyFile, manifestFile, imageName string) (*policy.Policy, error) {
	if policyFile != "" {
		data, err := readInput(policyFile)
		if err != nil {
			return nil, fmt.Errorf("policy: %w", err)
		}
		p, err := policy.Parse(data)
		if err != nil {
			return nil, fmt.Errorf("policy %s: %w", policyFile, err)
		}
		return p, nil
	}
	img, err := manifestImage(manifestFile, imageName)
	if err != nil {
		return nil, err
	}
	pi := policy.Image{Name: img.Name, Roles: []metadata.Role{metadata.RoleControlPlane, metadata.RoleWorker}, PCRs: map[int][]byte{}}
	for idx, v := range img.PCRs {
		i, err := strconv.Atoi(idx)
		if err != nil {
			return nil, fmt.Errorf("image %q of %s: PCR %q: %w", imageName, manifestFile, idx, err)
		}
		if pi.PCRs[i], err = hex.DecodeString(v); err != nil {
			return nil, fmt.Errorf("image %q of %s: PCR %d: %w", imageName, manifestFile, i, err)
		}
	}
	p := &policy.Policy{Images: []policy.Image{pi}}
	if err := p.Validate(); err != nil {
		return nil, fmt.Errorf("image %q of %s: %w", imageName, manifestFile, err)
	}
	return p, nil
}

// manifestImage is the image of a manifest that --manifest and --image name.
func manifestImage(manifestFile, imageName string) (manifest.Image, error) {
	if imageName == "" {
		return manifest.Image{}, errors.New("--manifest needs --image: the image the node must run")
	}
	data, err := readInput(manifestFile)
	if err != nil {
		return manifest.Image{}, fmt.Errorf("manifest: %w", err)
	}
	m, err := manifest.Parse(data)
	if err != nil {
		return manifest.Image{}, fmt.Errorf("manifest %s: %w", manifestFile, err)
	}
	img, ok := m.Image(imageName)
	if !ok {
		return manifest.Image{}, fmt.Errorf("manifest %s has no image %q (it has %v)", manifestFile, imageName, m.Names())
	}
	return img, nil
}

// readInput reads a file, or standard input for "-", bounded.
func readInput(path string) ([]byte, error) {
	var r io.Reader = os.Stdin
	if path != "-" {
		f, err := os.Open(path)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		r = f
	}
	data, err := io.ReadAll(io.LimitReader(r, maxInputFile+1))
	if err != nil {
		return nil, err
	}
	if len(data) > maxInputFile {
		return nil, fmt.Errorf("%s is larger than %d bytes", path, maxInputFile)
	}
	return data, nil
}
