package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
	"github.com/berthlabs/berth/nodeagent/internal/statedisk"
)

// Status is what `berth-agent status` reports: what this node is, and why.
type Status struct {
	Node       *metadata.Instance `json:"node,omitempty"`
	NodeError  string             `json:"nodeError,omitempty"`
	Disk       string             `json:"disk"`
	DiskUUID   string             `json:"diskUUID,omitempty"`
	Member     *nodestate.State   `json:"member,omitempty"`
	Summary    string             `json:"summary"`
	JoinCAPin  string             `json:"joinCAPin,omitempty"`
	InitServer bool               `json:"initServer"`
}

// Status inspects the node without changing anything; it never fails, it reports.
func (a *Agent) Status(ctx context.Context) *Status {
	s := &Status{}
	if self, err := a.meta.Self(ctx); err != nil {
		s.NodeError = err.Error()
	} else {
		s.Node = &self.Instance
		s.JoinCAPin = self.UserData.JoinCAPin
		s.InitServer = self.Instance.Role == metadata.RoleControlPlane && self.UserData.InitSecretHash != ""
	}
	s.Disk = a.diskState(ctx, s)
	member, err := nodestate.Read(a.cfg.Paths.State)
	switch {
	case err == nil:
		s.Member = member
		s.Summary = fmt.Sprintf("member of cluster %s as %s %q since %s (via %s)", member.ClusterID, member.Role,
			member.NodeName, member.Since.Format("2006-01-02 15:04:05Z07:00"), member.Via)
	case errors.Is(err, nodestate.ErrNoState) && s.Disk == "keyed":
		s.Summary = "joined before; the state disk is locked until a rejoin ticket unlocks it at boot"
	case errors.Is(err, nodestate.ErrNoState):
		s.Summary = "not a cluster member yet: the next boot joins (or, on a control-plane node with an init secret, waits for init)"
	default:
		s.Summary = "node state unreadable: " + err.Error()
	}
	return s
}

func (a *Agent) diskState(ctx context.Context, s *Status) string {
	isLUKS, err := a.vol.IsLUKS(ctx)
	if err != nil {
		return "unreadable: " + err.Error()
	}
	if !isLUKS {
		return "not formatted"
	}
	if id, err := a.vol.UUID(ctx); err == nil {
		s.DiskUUID = id
	}
	switch label, err := a.vol.Label(ctx); {
	case err != nil:
		return "unreadable: " + err.Error()
	case label == statedisk.LabelKeyed:
		return "keyed"
	case label == statedisk.LabelFresh:
		return "fresh (formatted, never keyed)"
	default:
		return fmt.Sprintf("foreign LUKS volume labelled %q", label)
	}
}

// Print writes the status for people.
func (s *Status) Print(w io.Writer) {
	var b strings.Builder
	if s.Node != nil {
		addrs := make([]string, len(s.Node.Addresses))
		for i, a := range s.Node.Addresses {
			addrs[i] = a.String()
		}
		fmt.Fprintf(&b, "node:        %s (%s) at %s\n", s.Node.Name, s.Node.Role, strings.Join(addrs, ", "))
	} else {
		fmt.Fprintf(&b, "node:        unknown: %s\n", s.NodeError)
	}
	fmt.Fprintf(&b, "state disk:  %s", s.Disk)
	if s.DiskUUID != "" {
		fmt.Fprintf(&b, " (uuid %s)", s.DiskUUID)
	}
	b.WriteString("\n")
	if s.JoinCAPin != "" {
		fmt.Fprintf(&b, "join CA pin: %s\n", s.JoinCAPin)
	}
	fmt.Fprintf(&b, "status:      %s\n", s.Summary)
	io.WriteString(w, b.String())
}
