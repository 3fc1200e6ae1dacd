// Package baremetal is the platform of machines without a metadata service (bare metal booted by PXE): a node
// reads its user-data from the file cloud-init wrote and names itself by its hostname. Such a node is a
// worker; the join service that admits it runs beside the control plane with an inventory of machines
// (berth-agent joinservice), not on this platform.
package baremetal

import (
	"context"
	"errors"
	"net/netip"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/nodeagent/internal/platform"
)

// Platform is a machine whose user-data is a file.
type Platform struct {
	local *metadata.Local
}

// New is the platform of a machine whose user-data is userDataFile, with address source if valid (else the
// address of its route to the join endpoints).
func New(userDataFile string, source netip.Addr) *Platform {
	return &Platform{local: &metadata.Local{UserDataFile: userDataFile, Address: source}}
}

func (p *Platform) Name() string { return "bare-metal" }

func (p *Platform) Node() platform.Node { return p.local }

func (p *Platform) Records(context.Context, *metadata.Self, platform.Env) (platform.Records, error) {
	return platform.Records{}, errors.New("a node without a metadata service (userDataFile) serves no joins")
}
