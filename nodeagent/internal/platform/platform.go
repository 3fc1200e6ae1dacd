// Package platform is the seam between berth-agent and the environment a node runs in: a lab's metadata
// service, bare metal, EC2, Compute Engine. Each environment is one package below this one that implements
// Platform; the agent's configuration chooses one, in one place (agentconfig's Config.Platform), and nothing
// else in the agent knows which it runs on. A new environment is a new package and a line there.
package platform

import (
	"context"
	"crypto/x509"
	"fmt"
	"log/slog"
	"maps"
	"net/url"
	"os"
	"slices"

	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/cloud/apicalls"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/nodeagent/internal/joinservice"
)

// Platform is one environment a node runs in.
type Platform interface {
	// Name names the environment in logs and errors ("lab", "bare-metal", "aws", "gcp").
	Name() string
	// Node is the node's view of itself.
	Node() Node
	// Records is the join service's view of the other nodes, on a control-plane node whose own record is
	// self. It is called once, when the service starts.
	Records(ctx context.Context, self *metadata.Self, env Env) (Records, error)
}

// Node is how a node learns who it is (its instance record and user-data) and which control-plane nodes
// exist.
type Node interface {
	Self(ctx context.Context) (*metadata.Self, error)
	ControlPlanes(ctx context.Context) ([]metadata.Instance, error)
}

// Records is who a connecting node is, by its address, and whether its TPM is genuine: what a join service
// must know before it gives anything away.
type Records struct {
	Instances joinservice.InstanceLookup
	Verifier  *attest.Verifier
}

// Env is what a platform's Records may use from the process.
type Env struct {
	// Calls counts the requests to one of the cloud's APIs (telemetry.APIEC2, telemetry.APICompute); nil,
	// or a nil result, counts nothing.
	Calls  func(api string) apicalls.Counter
	Logger *slog.Logger
}

// Counter is env's counter for api, nil when there is none.
func (env Env) Counter(api string) apicalls.Counter {
	if env.Calls == nil {
		return nil
	}
	return env.Calls(api)
}

// Log is env's logger, or one that discards.
func (env Env) Log() *slog.Logger {
	if env.Logger == nil {
		return slog.New(slog.DiscardHandler)
	}
	return env.Logger
}

// EKVerifier trusts the TPM vendors' EK CAs in the PEM file bundle.
func EKVerifier(bundle string) (*attest.Verifier, error) {
	roots, inters, err := ReadCABundle(bundle)
	if err != nil {
		return nil, err
	}
	return attest.NewVerifier(attest.NewCertChain(roots, inters, nil)), nil
}

// ReadCABundle reads a PEM file of EK CAs: its self-signed certificates are roots, the others intermediates.
func ReadCABundle(bundle string) (roots, intermediates *x509.CertPool, err error) {
	data, err := os.ReadFile(bundle)
	if err != nil {
		return nil, nil, fmt.Errorf("EK CA bundle: %w", err)
	}
	roots, intermediates, err = attest.ParseCABundle(data)
	if err != nil {
		return nil, nil, fmt.Errorf("EK CA bundle %s: %w", bundle, err)
	}
	return roots, intermediates, nil
}

// CheckEndpoints says which of the endpoints, set in the configuration block named section (empty: the top
// level), are not http(s) URLs.
func CheckEndpoints(section string, endpoints map[string]string) []error {
	var errs []error
	for _, name := range slices.Sorted(maps.Keys(endpoints)) {
		ep := endpoints[name]
		if ep == "" {
			continue
		}
		if section != "" {
			name = section + "." + name
		}
		if u, err := url.Parse(ep); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			errs = append(errs, fmt.Errorf("%s %q is not an http(s) URL", name, ep))
		}
	}
	return errs
}
