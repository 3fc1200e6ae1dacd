package kubeupgrade

import (
	"fmt"
	"slices"
	"strings"

	"github.com/berthlabs/berth/internal/clusterinfo"
	"github.com/berthlabs/berth/internal/kubeadm"
)

// action is what a control-plane node does next about an upgrade.
type action int

const (
	// idle: nothing for this node to do, now or until the record changes.
	idle action = iota
	// wait: the upgrade is this node's to carry on, but something else has to happen first.
	wait
	// apply: `kubeadm upgrade apply`, the step that moves kubeadm-config and this node to the target.
	apply
	// upgradeNode: `kubeadm upgrade node`, this node's static pods to the target kubeadm-config names.
	upgradeNode
	// addons: kube-proxy and CoreDNS to the target, once every node runs it; then the upgrade is done.
	addons
)

func (a action) String() string {
	return [...]string{"idle", "wait", "upgrade apply", "upgrade node", "addons"}[a]
}

// state is the cluster as one control-plane node sees it.
type state struct {
	// own is the release of the node's kubeadm, which its attested image carries.
	own string
	rec clusterinfo.Upgrade
	// cluster is the release kubeadm-config names.
	cluster string
	// apiServers is each control-plane node's kube-apiserver release, kubelets each Node's kubelet release.
	apiServers, kubelets map[string]string
}

// decide says what node does next, and why. Only a node whose own kubeadm is the target's acts: its image
// proved at its join that it carries that kubeadm, and kubeadm upgrades only to its own release.
func decide(node string, s state) (action, string) {
	target := s.rec.Target
	switch {
	case target == "":
		return idle, "no upgrade is instructed"
	case s.rec.Phase == clusterinfo.PhaseDone:
		return idle, "the upgrade to " + target + " is done"
	case s.own != target:
		return idle, fmt.Sprintf("this node's image carries kubeadm %s: the upgrade to %s is carried by nodes of an image with kubeadm %s", s.own, target, target)
	}
	step, err := kubeadm.UpgradeStep(s.cluster, target)
	if err != nil {
		return idle, fmt.Sprintf("the cluster cannot go from %s, as kubeadm-config says, to %s: %v", s.cluster, target, err)
	}
	if step != kubeadm.StepNone {
		return apply, fmt.Sprintf("kubeadm-config names %s", s.cluster)
	}
	switch own, found := s.apiServers[node]; {
	case !found:
		return wait, "no kube-apiserver pod of this node is listed yet"
	case own != target:
		return upgradeNode, fmt.Sprintf("this node's API server runs %s", own)
	}
	if behind := notAt(s.apiServers, target); len(behind) > 0 {
		return wait, fmt.Sprintf("waiting for the API servers of %s to run %s", names(behind), target)
	}
	if behind := notAt(s.kubelets, target); len(behind) > 0 {
		return wait, fmt.Sprintf("waiting for the roll to replace %d nodes whose kubelet is not at %s: %s", len(behind), target, names(behind))
	}
	return addons, "every API server and every kubelet runs " + target
}

// notAt names, sorted, the nodes of releases whose release is not target.
func notAt(releases map[string]string, target string) []string {
	var behind []string
	for node, r := range releases {
		if r != target {
			behind = append(behind, node)
		}
	}
	slices.Sort(behind)
	return behind
}

// names lists nodes for a log line: the first few of a large cluster's, and how many more.
func names(nodes []string) string {
	const shown = 5
	if len(nodes) <= shown {
		return strings.Join(nodes, ", ")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(nodes[:shown], ", "), len(nodes)-shown)
}
