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
	// State is the answer in one word, for scripts: StateMember, StateWillJoin, StateBlocked or StateUnknown.
	State      string             `json:"state"`
	Node       *metadata.Instance `json:"node,omitempty"`
	NodeError  string             `json:"nodeError,omitempty"`
	Disk       string             `json:"disk"`
	DiskUUID   string             `json:"diskUUID,omitempty"`
	Member     *nodestate.State   `json:"member,omitempty"`
	Summary    string             `json:"summary"`
	JoinCAPin  string             `json:"joinCAPin,omitempty"`
	InitServer bool               `json:"initServer"`
}

// The states of a node, as status reports them.
const (
	// StateMember: the node's membership record is on its state disk.
	StateMember = "member"
	// StateWillJoin: not a member (or not since this boot): the next boot joins, initializes or rejoins.
	StateWillJoin = "will-join"
	// StateBlocked: the next boot cannot join as the node is: its state disk is a volume Berth did not make,
	// which boot refuses to overwrite.
	StateBlocked = "blocked"
	// StateUnknown: the metadata, the state disk or the membership record could not be read, so nothing can
	// be said of the next boot.
	StateUnknown = "unknown"
)

// Status inspects the node without changing anything; it never fails, it reports.
func (a *Agent) Status(ctx context.Context) *Status {
	s := &Status{}
	if self, err := a.platform.Node().Self(ctx); err != nil {
		s.NodeError = err.Error()
	} else {
		s.Node = &self.Instance
		s.JoinCAPin = self.UserData.JoinCAPin
		s.InitServer = self.Instance.Role == metadata.RoleControlPlane && self.UserData.InitSecretHash != ""
	}
	formatted, label, diskErr := a.diskState(ctx, s)
	member, err := nodestate.Read(a.cfg.Paths.State)
	switch {
	case err == nil:
		s.State, s.Member = StateMember, member
		s.Summary = fmt.Sprintf("member of cluster %s as %s %q since %s (via %s)", member.ClusterID, member.Role,
			member.NodeName, member.Since.Format("2006-01-02 15:04:05Z07:00"), member.Via)
	case !errors.Is(err, nodestate.ErrNoState):
		s.State = StateUnknown
		s.Summary = "cannot tell: the node's membership record is unreadable: " + err.Error()
	// Whether the next boot joins depends on the disk (keyed: rejoin, foreign: refused) and on the
	// metadata, without which boot cannot start. A foreign disk blocks whatever the metadata says: it needs
	// an operator, where unreadable metadata may only be late.
	case formatted && diskErr == nil && label != statedisk.LabelKeyed && label != statedisk.LabelFresh:
		s.State = StateBlocked
		s.Summary = fmt.Sprintf("the next boot refuses the state disk %s: it is a LUKS volume labelled %q, which Berth did not make and will not overwrite", a.cfg.StateDisk, label)
	case diskErr != nil || s.NodeError != "":
		var unread []string
		if s.NodeError != "" {
			unread = append(unread, "the instance metadata is unreadable ("+s.NodeError+")")
		}
		if diskErr != nil {
			unread = append(unread, fmt.Sprintf("the state disk %s is unreadable (%v)", a.cfg.StateDisk, diskErr))
		}
		s.State = StateUnknown
		s.Summary = "cannot tell whether the next boot joins: " + strings.Join(unread, "; ")
	case label == statedisk.LabelKeyed:
		s.State = StateWillJoin
		s.Summary = "joined before; the state disk is locked until a rejoin ticket unlocks it at boot"
	default:
		s.State = StateWillJoin
		s.Summary = "not a cluster member yet: the next boot joins (or, on a control-plane node with an init secret, waits for init)"
	}
	return s
}

// diskState sets s.Disk and says whether the state disk is formatted, with which LUKS label, or why it
// could not be read.
func (a *Agent) diskState(ctx context.Context, s *Status) (formatted bool, label string, err error) {
	formatted, label, err = a.diskLabel(ctx, s)
	switch {
	case err != nil:
		s.Disk = "unreadable: " + err.Error()
	case !formatted:
		s.Disk = "not formatted"
	case label == statedisk.LabelKeyed:
		s.Disk = "keyed"
	case label == statedisk.LabelFresh:
		s.Disk = "fresh (formatted, never keyed)"
	default:
		s.Disk = fmt.Sprintf("foreign LUKS volume labelled %q", label)
	}
	return formatted, label, err
}

func (a *Agent) diskLabel(ctx context.Context, s *Status) (bool, string, error) {
	isLUKS, err := a.vol.IsLUKS(ctx)
	if err != nil || !isLUKS {
		return false, "", err
	}
	if id, err := a.vol.UUID(ctx); err == nil {
		s.DiskUUID = id
	}
	label, err := a.vol.Label(ctx)
	return true, label, err
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
