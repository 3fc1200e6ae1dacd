package kubeupgrade

import (
	"strings"
	"testing"

	"github.com/berthlabs/berth/internal/clusterinfo"
)

func TestDecide(t *testing.T) {
	const from, to = "v1.36.3", "v1.37.0"
	instructed := clusterinfo.Upgrade{Target: to, Phase: clusterinfo.PhaseInstructed}
	applied := clusterinfo.Upgrade{Target: to, Phase: clusterinfo.PhaseApplied}
	tests := []struct {
		name string
		s    state
		want action
		why  string
	}{
		{"no upgrade instructed", state{own: from, cluster: from}, idle, "no upgrade"},
		{"a node of the old image", state{own: from, rec: instructed, cluster: from}, idle, "carried by nodes of an image with kubeadm v1.37.0"},
		{"a node of an image newer than the target", state{own: "v1.38.0", rec: instructed, cluster: from}, idle, "kubeadm v1.38.0"},
		{"the first node of the new image", state{own: to, rec: instructed, cluster: from,
			apiServers: map[string]string{"cp-0": from, "cp-1": from}}, apply, "kubeadm-config names v1.36.3"},
		{"a leader that died mid-apply: the next one applies again", state{own: to, rec: clusterinfo.Upgrade{Target: to, Phase: clusterinfo.PhaseApplying, Node: "cp-3"},
			cluster: from, apiServers: map[string]string{"cp-1": from}}, apply, "kubeadm-config names"},
		{"a patch", state{own: "v1.36.4", rec: clusterinfo.Upgrade{Target: "v1.36.4", Phase: clusterinfo.PhaseInstructed}, cluster: from}, apply, ""},
		{"a target two minors ahead (a record written by hand)", state{own: "v1.38.0", rec: clusterinfo.Upgrade{Target: "v1.38.0", Phase: clusterinfo.PhaseInstructed},
			cluster: from}, idle, "skips a minor"},
		{"a target below the cluster", state{own: from, rec: clusterinfo.Upgrade{Target: from, Phase: clusterinfo.PhaseInstructed}, cluster: to}, idle, "downgrade"},
		{"a node that joined while another led", state{own: to, rec: applied, cluster: to,
			apiServers: map[string]string{"cp-0": from, "cp-1": from, "cp-2": to}}, upgradeNode, "this node's API server runs v1.36.3"},
		{"this node's API server not listed yet", state{own: to, rec: applied, cluster: to, apiServers: map[string]string{"cp-0": from}}, wait, "no kube-apiserver pod"},
		{"an old control-plane node still runs", state{own: to, rec: applied, cluster: to,
			apiServers: map[string]string{"cp-0": from, "cp-1": to}}, wait, "API servers of cp-0"},
		{"workers of the old image still run", state{own: to, rec: applied, cluster: to, apiServers: map[string]string{"cp-1": to},
			kubelets: map[string]string{"cp-1": to, "w-0": from, "w-1": from, "w-2": from, "w-3": from, "w-4": from, "w-5": from, "w-6": to}},
			wait, "6 nodes whose kubelet is not at v1.37.0: w-0, w-1, w-2, w-3, w-4 and 1 more"},
		{"the roll is over", state{own: to, rec: applied, cluster: to, apiServers: map[string]string{"cp-1": to},
			kubelets: map[string]string{"cp-1": to, "w-6": to}}, addons, "every API server and every kubelet"},
		{"an addon step that failed is taken again", state{own: to, rec: clusterinfo.Upgrade{Target: to, Phase: clusterinfo.PhaseAddons, Message: "boom"},
			cluster: to, apiServers: map[string]string{"cp-1": to}, kubelets: map[string]string{"cp-1": to}}, addons, ""},
		{"done", state{own: to, rec: clusterinfo.Upgrade{Target: to, Phase: clusterinfo.PhaseDone}, cluster: to}, idle, "done"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, why := decide("cp-1", tt.s)
			if got != tt.want || !strings.Contains(why, tt.why) {
				t.Errorf("decide = %v (%q), want %v with %q", got, why, tt.want, tt.why)
			}
		})
	}
}
