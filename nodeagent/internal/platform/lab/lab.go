// Package lab is the platform of nodes that read themselves from a Berth metadata service
// (internal/metadata's Server: the lab's, or one an operator runs for an inventory of machines). The same
// service tells a control-plane node's join service who is at an address, and the TPM vendors' EK CAs in a
// bundle say which TPMs are genuine.
package lab

import (
	"context"
	"net/netip"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/nodeagent/internal/platform"
)

// Platform is a node of a metadata service.
type Platform struct {
	client     *metadata.Client
	ekCABundle string
}

// New is the platform of the metadata service at url, asked from source (if valid); the join service trusts
// the EK CAs of the PEM file ekCABundle.
func New(url string, source netip.Addr, ekCABundle string) *Platform {
	return &Platform{client: &metadata.Client{BaseURL: url, LocalAddr: source}, ekCABundle: ekCABundle}
}

func (p *Platform) Name() string { return "lab" }

func (p *Platform) Node() platform.Node { return p.client }

func (p *Platform) Records(context.Context, *metadata.Self, platform.Env) (platform.Records, error) {
	verifier, err := platform.EKVerifier(p.ekCABundle)
	if err != nil {
		return platform.Records{}, err
	}
	return platform.Records{Instances: p.client, Verifier: verifier}, nil
}
