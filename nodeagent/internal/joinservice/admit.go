package joinservice

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"time"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/rpc"
)

// DefaultTimeout bounds one exchange when Config.Timeout is zero: slow TPMs included.
const DefaultTimeout = 30 * time.Second

// Listen wraps inner in the admission every join service needs (see docs/agent.md, "Limits"): a connection
// from an address without an instance record is closed before its TLS handshake; an address holds at most
// perAddress connections (rpc.DefaultPerAddress if zero); at most slots are served at once; each serves one
// exchange, whose first request must come within rpc.DefaultFirstStream and which ends within the service's
// Timeout.
func (s *Server) Listen(inner net.Listener, slots, perAddress int) *rpc.AdmitListener {
	return rpc.Admit(inner, rpc.AdmitConfig{
		Slots: slots, PerAddress: perAddress, Admit: s.admit, Exchange: s.cfg.Timeout, Logger: s.cfg.Logger,
	})
}

// admit lets in an address that has an instance record: a node's attestation is checked against that record,
// so an address without one could only ever be refused, after a TLS handshake and an EK chain's worth of CPU.
func (s *Server) admit(ctx context.Context, addr netip.Addr) error {
	_, err := s.cfg.Instances.InstanceByAddress(ctx, addr)
	if errors.Is(err, metadata.ErrNotFound) {
		return fmt.Errorf("%w: %w", rpc.ErrNotAdmitted, err)
	}
	return err
}
