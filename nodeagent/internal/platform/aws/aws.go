// Package aws is the platform of EC2 instances: a node reads itself from IMDSv2 (its user-data is
// berth_node_config's json), and a control-plane node's join service looks nodes up through the EC2 API,
// takes their role from their autoscaling group, and trusts their NitroTPMs by the EK that EC2 reports for
// each instance.
package aws

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"

	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/cloud/aws/ec2instances"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/nodeagent/internal/platform"
	"github.com/berthlabs/berth/nodeagent/internal/platform/aws/imds"
	"github.com/berthlabs/berth/nodeagent/internal/telemetry"
)

// Config is agent.yaml's aws block: the EC2 side of a node and of its join service.
type Config struct {
	// AutoscalingGroups maps the autoscaling groups whose instances may join to their role. Only AWS sets an
	// instance's aws:autoscaling:groupName tag, so no node can pick its own role; instances of other groups,
	// or of none, are refused. Control-plane nodes, which serve joins, take them from their user-data
	// (berth_node_config autoscaling_groups) unless set here.
	AutoscalingGroups map[string]metadata.Role `json:"autoscalingGroups,omitempty"`
	// Region and VPCID are where the join service looks nodes up; the control-plane node's own by default
	// (from IMDS). Instances of other VPCs are never found.
	Region string `json:"region,omitempty"`
	VPCID  string `json:"vpcID,omitempty"`
	// IMDSEndpoint and EC2Endpoint replace AWS's own endpoints, for emulators (tests, labs).
	IMDSEndpoint string `json:"imdsEndpoint,omitempty"`
	EC2Endpoint  string `json:"ec2Endpoint,omitempty"`
}

// Validate says everything wrong with the block at once, each problem under its key in agent.yaml.
func (c *Config) Validate() []error {
	var errs []error
	for group, role := range c.AutoscalingGroups {
		if group == "" || !role.Valid() {
			errs = append(errs, fmt.Errorf("aws.autoscalingGroups: %q: %q is not %q or %q", group, role, metadata.RoleControlPlane, metadata.RoleWorker))
		}
	}
	return append(errs, platform.CheckEndpoints("aws", map[string]string{"imdsEndpoint": c.IMDSEndpoint, "ec2Endpoint": c.EC2Endpoint})...)
}

// Platform is an EC2 instance.
type Platform struct {
	cfg  Config
	imds *imds.Client
}

// New is the platform of cfg.
func New(cfg Config) *Platform {
	return &Platform{cfg: cfg, imds: &imds.Client{Endpoint: cfg.IMDSEndpoint}}
}

func (p *Platform) Name() string { return "aws" }

func (p *Platform) Node() platform.Node { return p.imds }

// Records looks nodes up in the EC2 API (instance by address, role by autoscaling group) and trusts the EK
// EC2 reports for the instance.
func (p *Platform) Records(ctx context.Context, self *metadata.Self, env platform.Env) (platform.Records, error) {
	// The image's agent.yaml may fix the groups; usually the cluster's Terraform names them in the
	// control-plane nodes' user-data (berth_node_config autoscaling_groups).
	groups := p.cfg.AutoscalingGroups
	if len(groups) == 0 {
		groups = self.UserData.AutoscalingGroups
	}
	if len(groups) == 0 {
		return platform.Records{}, errors.New("no autoscaling group may join: a control-plane node on EC2 admits the instances of the groups in its user-data (berth_node_config autoscaling_groups) or in agent.yaml's aws.autoscalingGroups, with their roles")
	}
	region, vpc := p.cfg.Region, p.cfg.VPCID
	if region == "" || vpc == "" {
		r, v, err := p.imds.Placement(ctx)
		if err != nil {
			return platform.Records{}, fmt.Errorf("finding this node's region and VPC: %w", err)
		}
		region, vpc = cmp.Or(region, r), cmp.Or(vpc, v)
	}
	log := env.Log()
	api, err := ec2instances.NewAPI(ctx, region, p.cfg.EC2Endpoint, log)
	if err != nil {
		return platform.Records{}, err
	}
	lookup, err := ec2instances.New(ec2instances.Config{API: api, VPCID: vpc, Roles: groups, Logger: log,
		Calls: env.Counter(telemetry.APIEC2)})
	if err != nil {
		return platform.Records{}, err
	}
	log.Info("nodes are looked up in EC2", "region", region, "vpc", vpc, "autoscaling_groups", slices.Sorted(maps.Keys(groups)))
	return platform.Records{Instances: lookup, Verifier: attest.NewVerifier(attest.CloudEK{Cloud: "EC2", Source: lookup})}, nil
}
