// Package gcp is the platform of Compute Engine instances: a node reads itself from the GCE metadata server
// (its berth-node-config attribute is berth_node_config's json), and a control-plane node's join service
// looks nodes up through the Compute API, takes their role from their managed instance group, and trusts
// their vTPMs by Google's EK certificate and the EK the Compute API reports for each instance.
package gcp

import (
	"cmp"
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"

	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/cloud/gcp/computeinstances"
	"github.com/berthlabs/berth/internal/cloud/gcp/shieldedvm"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/nodeagent/internal/platform"
	"github.com/berthlabs/berth/nodeagent/internal/platform/gcp/gcemetadata"
	"github.com/berthlabs/berth/nodeagent/internal/telemetry"
)

// Config is agent.yaml's gcp block: the Compute Engine side of a node and of its join service.
type Config struct {
	// InstanceGroups maps the managed instance groups whose instances may join, as "<region or
	// zone>/<name>", to their role. Membership of a group is Compute Engine's own record, so no node can pick
	// its own role; instances of other groups, or of none, are refused. Control-plane nodes take them from
	// their user-data (berth_node_config instance_groups) unless set here.
	InstanceGroups map[string]metadata.Role `json:"instanceGroups,omitempty"`
	// Project and Network are where the join service looks nodes up; the control-plane node's own by
	// default (from the metadata server). Instances of other networks are never found.
	Project string `json:"project,omitempty"`
	Network string `json:"network,omitempty"`
	// MetadataEndpoint and ComputeEndpoint replace Google's own endpoints, for emulators (tests, labs).
	MetadataEndpoint string `json:"metadataEndpoint,omitempty"`
	ComputeEndpoint  string `json:"computeEndpoint,omitempty"`
	// EKCABundle replaces Google's vTPM EK CAs with the ones in this PEM file, for labs whose TPMs Google
	// did not make.
	EKCABundle string `json:"ekCABundle,omitempty"`
	// ExtraEKCAs adds the CAs in this PEM file to Google's (or to EKCABundle's): an intermediate Google
	// starts issuing vTPM EK certificates from before a Berth release carries it.
	ExtraEKCAs string `json:"extraEKCAs,omitempty"`
}

// Validate says everything wrong with the block at once, each problem under its key in agent.yaml.
func (c *Config) Validate() []error {
	var errs []error
	for group, role := range c.InstanceGroups {
		if err := metadata.ValidateInstanceGroup(group); err != nil {
			errs = append(errs, fmt.Errorf("gcp.instanceGroups: %w", err))
		}
		if !role.Valid() {
			errs = append(errs, fmt.Errorf("gcp.instanceGroups: %q: %q is not %q or %q", group, role, metadata.RoleControlPlane, metadata.RoleWorker))
		}
	}
	return append(errs, platform.CheckEndpoints("gcp", map[string]string{"metadataEndpoint": c.MetadataEndpoint, "computeEndpoint": c.ComputeEndpoint})...)
}

// Platform is a Compute Engine instance.
type Platform struct {
	cfg  Config
	meta *gcemetadata.Client
}

// New is the platform of cfg.
func New(cfg Config) *Platform {
	return &Platform{cfg: cfg, meta: &gcemetadata.Client{Endpoint: cfg.MetadataEndpoint}}
}

func (p *Platform) Name() string { return "gcp" }

func (p *Platform) Node() platform.Node { return p.meta }

// Records looks nodes up in the Compute API (instances by address, roles by managed instance group), called
// as this node's service account, and trusts vTPMs by Google's EK certificate and the Shielded identity the
// API reports for the instance.
func (p *Platform) Records(ctx context.Context, self *metadata.Self, env platform.Env) (platform.Records, error) {
	// As on EC2: the image's agent.yaml may fix the groups; usually the cluster's Terraform names them in
	// the control-plane nodes' user-data (berth_node_config instance_groups).
	groups := p.cfg.InstanceGroups
	if len(groups) == 0 {
		groups = self.UserData.InstanceGroups
	}
	if len(groups) == 0 {
		return platform.Records{}, errors.New("no managed instance group may join: a control-plane node on Compute Engine admits the instances of the groups in its user-data (berth_node_config instance_groups) or in agent.yaml's gcp.instanceGroups, with their roles")
	}
	project, network := p.cfg.Project, p.cfg.Network
	if project == "" || network == "" {
		pr, _, n, err := p.meta.Placement(ctx)
		switch {
		case errors.Is(err, gcemetadata.ErrSharedVPC) && network == "":
			return platform.Records{}, fmt.Errorf("finding this node's network: %w; the join service looks nodes up on it by the host project's id, which the metadata server does not give: set gcp.network in agent.yaml to projects/<host project id>/global/networks/<name>", err)
		case err != nil && !errors.Is(err, gcemetadata.ErrSharedVPC):
			return platform.Records{}, fmt.Errorf("finding this node's project and network: %w", err)
		}
		project, network = cmp.Or(project, pr), cmp.Or(network, n)
	}
	log := env.Log()
	svc, err := computeinstances.NewService(ctx, p.cfg.ComputeEndpoint, p.meta.TokenSource(ctx), log, env.Counter(telemetry.APICompute))
	if err != nil {
		return platform.Records{}, err
	}
	lookup, err := computeinstances.New(computeinstances.Config{Service: svc, Project: project, Network: network, Groups: groups, Logger: log})
	if err != nil {
		return platform.Records{}, err
	}
	roots, inters, err := p.cfg.ekCAs()
	if err != nil {
		return platform.Records{}, err
	}
	log.Info("nodes are looked up in Compute Engine", "project", project, "network", network,
		"instance_groups", slices.Sorted(maps.Keys(groups)), "ek_cas", cmp.Or(p.cfg.EKCABundle, "Google's"),
		"extra_ek_cas", p.cfg.ExtraEKCAs)
	trust := shieldedvm.NewTrust(roots, inters, computeinstances.NewIdentities(svc, log), nil)
	return platform.Records{Instances: lookup, Verifier: attest.NewVerifier(trust)}, nil
}

// ekCAs are the CAs a vTPM's EK certificate must chain to: Google's, or EKCABundle's, and ExtraEKCAs'.
func (c Config) ekCAs() (roots, intermediates *x509.CertPool, err error) {
	roots, intermediates, err = shieldedvm.GoogleCAs()
	if c.EKCABundle != "" {
		roots, intermediates, err = platform.ReadCABundle(c.EKCABundle)
	}
	if err != nil || c.ExtraEKCAs == "" {
		return roots, intermediates, err
	}
	data, err := os.ReadFile(c.ExtraEKCAs)
	if err != nil {
		return nil, nil, fmt.Errorf("gcp.extraEKCAs: %w", err)
	}
	if err := attest.AddCABundle(roots, intermediates, data); err != nil {
		return nil, nil, fmt.Errorf("gcp.extraEKCAs %s: %w", c.ExtraEKCAs, err)
	}
	return roots, intermediates, nil
}
