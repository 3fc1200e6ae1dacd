package provider

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-log/tflog"
	"k8s.io/client-go/kubernetes"

	"github.com/berthlabs/berth/internal/backoff"
	"github.com/berthlabs/berth/internal/clusterinfo"
)

// upgradeTimeout is m's upgrade_timeout, or the default; ValidateConfig refused one that does not parse.
func (m *clusterModel) upgradeTimeout() time.Duration {
	d, err := time.ParseDuration(m.UpgradeTimeout.ValueString())
	if err != nil || d <= 0 {
		d, _ = time.ParseDuration(defaultUpgradeTimeout)
	}
	return d
}

// upgradeLook is what one look at the cluster shows of an upgrade.
type upgradeLook struct {
	record clusterinfo.Upgrade
	// release is kubeadm's ClusterConfiguration's, which `kubeadm upgrade apply` raises.
	release string
	// apiServers is each control-plane node's API server release.
	apiServers map[string]string
}

// reached says whether the control plane runs target: kubeadm's configuration and every API server.
func (l upgradeLook) reached(target string) bool {
	return l.release == target && len(l.apiServers) > 0 && len(l.behind(target)) == 0
}

// behind lists the API servers that do not run target yet, as "node (release)", sorted.
func (l upgradeLook) behind(target string) []string {
	var out []string
	for _, node := range slices.Sorted(maps.Keys(l.apiServers)) {
		if v := l.apiServers[node]; v != target {
			out = append(out, fmt.Sprintf("%s (%s)", node, v))
		}
	}
	return out
}

// describe says where the upgrade to target stands, for progress lines and errors.
func (l upgradeLook) describe(target string) string {
	var b strings.Builder
	r := l.record
	switch {
	case r.Target != target:
		fmt.Fprintf(&b, "the cluster record names target %q", r.Target)
	case r.Phase == clusterinfo.PhaseInstructed:
		fmt.Fprintf(&b, "no control-plane node of %s has taken the upgrade up yet", target)
	default:
		fmt.Fprintf(&b, "phase %s", r.Phase)
		if r.Node != "" {
			fmt.Fprintf(&b, " (node %s", r.Node)
			if !r.Time.IsZero() {
				fmt.Fprintf(&b, ", since %s", r.Time.UTC().Format(time.RFC3339))
			}
			b.WriteString(")")
		}
	}
	if r.Target == target && r.Message != "" {
		fmt.Fprintf(&b, ": %s", r.Message)
	}
	release := l.release
	if release == "" {
		release = "unknown"
	}
	fmt.Fprintf(&b, "; kubeadm's configuration: %s; API servers at %s: %d of %d", release, target,
		len(l.apiServers)-len(l.behind(target)), len(l.apiServers))
	if behind := l.behind(target); len(behind) > 0 {
		fmt.Fprintf(&b, " (not yet: %s)", strings.Join(behind, ", "))
	}
	return b.String()
}

// lookUpgrade reads the upgrade's record, kubeadm's configuration and the API servers' releases.
func lookUpgrade(ctx context.Context, kube kubernetes.Interface) (upgradeLook, error) {
	record, err := readUpgrade(ctx, kube)
	if err != nil {
		return upgradeLook{}, fmt.Errorf("reading the upgrade's record: %w", err)
	}
	release, apiServers, err := readVersions(ctx, kube)
	if err != nil {
		return upgradeLook{}, err
	}
	return upgradeLook{record: record, release: release, apiServers: apiServers}, nil
}

// errNotReached makes backoff.Retry look again.
var errNotReached = errors.New("the control plane does not run the target yet")

// upgradeKubernetes instructs the cluster of state to run target and waits up to timeout until its
// control plane does, logging each change it sees. Failures are added to diags, saying what the upgrade
// waits for.
func upgradeKubernetes(ctx context.Context, state *clusterModel, target string, timeout time.Duration, diags *diag.Diagnostics) {
	from := state.KubernetesVersion.ValueString()
	title := fmt.Sprintf("Kubernetes upgrade to %s not finished", target)
	kube, err := stateClient(state.Kubeconfig.ValueString())
	if err == nil {
		_, err = clusterinfo.InstructUpgrade(ctx, kube, target, time.Now())
	}
	if err != nil {
		diags.AddAttributeError(path.Root("kubernetes_version"), "Cannot instruct the Kubernetes upgrade",
			fmt.Sprintf("Writing %s as cluster %s's target failed: %v. Nothing was changed; the cluster runs %s. "+
				"Apply again once the API server at %s answers.", target, state.ClusterID.ValueString(), err, from,
				state.APIServerEndpoint.ValueString()))
		return
	}
	tflog.Info(ctx, "Kubernetes upgrade instructed: waiting for the control plane", map[string]any{
		"from": from, "target": target, "timeout": timeout.String()})
	var (
		last    upgradeLook
		looked  bool
		lastErr error
		seen    string
	)
	waitCtx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	err = backoff.Retry(waitCtx, healthPolling, nil, nil, func(context.Context) error {
		// A look begun before the timeout finishes after it rather than report the deadline (see waitHealthy).
		l, err := lookUpgrade(ctx, kube)
		if lastErr = err; err != nil {
			return err
		}
		last, looked = l, true
		if l.reached(target) {
			return nil
		}
		return errNotReached
	}, func(_ int, err error, _ time.Duration) {
		// One line per change: an upgrade waits minutes in each phase.
		now := last.describe(target)
		if !errors.Is(err, errNotReached) {
			now = "the cluster did not answer: " + err.Error()
		}
		if now != seen {
			seen = now
			tflog.Info(ctx, "Kubernetes upgrade: "+now, map[string]any{"target": target})
		}
	})
	if err == nil {
		tflog.Info(ctx, "Kubernetes upgrade: the control plane runs "+target, map[string]any{"api_servers": len(last.apiServers)})
		return
	}
	where := "no look at the cluster succeeded"
	if looked {
		where = last.describe(target)
	}
	if lastErr != nil {
		where += fmt.Sprintf("; the last look failed: %v", lastErr)
	}
	if ctx.Err() != nil {
		diags.AddAttributeError(path.Root("kubernetes_version"), title,
			fmt.Sprintf("The wait was cancelled (%v); %s. The upgrade goes on without Terraform; apply again to wait for it.",
				ctx.Err(), where))
		return
	}
	diags.AddAttributeError(path.Root("kubernetes_version"), title,
		fmt.Sprintf("Cluster %s was told to run %s (ConfigMap kube-system/%s), but after upgrade_timeout (%s): %s. "+
			"Control-plane nodes booted from an image of %s carry the upgrade out, and each one that cannot go on "+
			"says why in the record's message (data.berth_cluster_health's upgrade) and in its agent's log: roll "+
			"the control-plane nodes to such an image. The upgrade goes on without Terraform; apply again to wait "+
			"for it. State keeps kubernetes_version = %q until the control plane runs %s.",
			state.ClusterID.ValueString(), target, clusterinfo.Name, timeout, where, target, from, target))
}
