package clusterinfo

import (
	"context"
	"fmt"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/berthlabs/berth/internal/kubeadm"
)

// The Kubernetes upgrade the provider instructs, and how far the control plane's agents got with it: keys of
// the same record, which only holders of cluster-admin credentials write (the provider, with credentials
// from the root key; control-plane nodes, which hold the cluster's CA keys anyway). Publish never writes
// them, and the init's own kubernetesVersion stays what the init ran.
const (
	keyUpgradeTarget  = "upgradeTarget"
	keyUpgradePhase   = "upgradePhase"
	keyUpgradeNode    = "upgradeNode"
	keyUpgradeTime    = "upgradeTime"
	keyUpgradeMessage = "upgradeMessage"
)

// Phase is where an upgrade stands (docs/kubernetes-upgrades.md).
type Phase string

const (
	// PhaseInstructed: the provider set the target; no control-plane node has acted on it yet.
	PhaseInstructed Phase = "instructed"
	// PhaseApplying: Node runs `kubeadm upgrade apply` under the control-plane Lease.
	PhaseApplying Phase = "applying"
	// PhaseApplied: kubeadm-config names the target; the other control-plane nodes follow, and the roll
	// replaces the nodes of the previous image.
	PhaseApplied Phase = "applied"
	// PhaseAddons: every node runs the target; Node upgrades kube-proxy and CoreDNS.
	PhaseAddons Phase = "addons"
	// PhaseDone: the control plane, every node and the addons run the target.
	PhaseDone Phase = "done"
)

func (p Phase) valid() bool {
	switch p {
	case PhaseInstructed, PhaseApplying, PhaseApplied, PhaseAddons, PhaseDone:
		return true
	}
	return false
}

// Upgrade is the upgrade part of the record. Its zero value is a cluster that was never told to upgrade.
type Upgrade struct {
	// Target is the Kubernetes release the cluster is to run.
	Target string
	Phase  Phase
	// Node is the control-plane node that moved the upgrade to Phase, at Time; Message says what it last
	// reported (a failure it will retry, or what the phase waits for).
	Node    string
	Time    time.Time
	Message string
	// resourceVersion is the record's version when read: a write from it fails if anyone wrote in between.
	resourceVersion string
}

// ReadUpgrade returns the upgrade part of the record; an error wrapping ErrNotFound if there is no record.
func ReadUpgrade(ctx context.Context, kube kubernetes.Interface) (Upgrade, error) {
	cm, err := readConfigMap(ctx, kube)
	if err != nil {
		return Upgrade{}, err
	}
	d := cm.Data
	u := Upgrade{Target: d[keyUpgradeTarget], Phase: Phase(d[keyUpgradePhase]), Node: d[keyUpgradeNode],
		Message: d[keyUpgradeMessage], resourceVersion: cm.ResourceVersion}
	if u.Target == "" {
		return Upgrade{resourceVersion: cm.ResourceVersion}, nil
	}
	if !kubeadm.IsRelease(u.Target) || !u.Phase.valid() {
		return Upgrade{}, fmt.Errorf("the cluster record %s/%s is damaged: upgrade target %q, phase %q", Namespace, Name, u.Target, u.Phase)
	}
	if t := d[keyUpgradeTime]; t != "" {
		if u.Time, err = time.Parse(time.RFC3339, t); err != nil {
			return Upgrade{}, fmt.Errorf("the cluster record %s/%s is damaged: upgrade time: %w", Namespace, Name, err)
		}
	}
	return u, nil
}

// InstructUpgrade sets the cluster's target release, as the provider does when kubernetes_version changes.
// A target already set is left as it is, with its phase, so that an apply run again does not restart an
// upgrade under way.
func InstructUpgrade(ctx context.Context, kube kubernetes.Interface, target string, now time.Time) (Upgrade, error) {
	if !kubeadm.IsRelease(target) {
		return Upgrade{}, fmt.Errorf("instructing an upgrade: %q is not a release such as v1.36.3", target)
	}
	u, err := ReadUpgrade(ctx, kube)
	if err != nil {
		return Upgrade{}, fmt.Errorf("instructing an upgrade: %w", err)
	}
	if u.Target == target {
		return u, nil
	}
	next := Upgrade{Target: target, Phase: PhaseInstructed, Time: now, resourceVersion: u.resourceVersion}
	if err := next.write(ctx, kube); err != nil {
		return Upgrade{}, fmt.Errorf("instructing an upgrade to %s: %w", target, err)
	}
	return next, nil
}

// Record moves the upgrade u, as read, to phase, by node. It fails when the record changed since u was read:
// another node or the provider moved it, and the caller reads it again.
func (u Upgrade) Record(ctx context.Context, kube kubernetes.Interface, phase Phase, node, message string, now time.Time) (Upgrade, error) {
	if u.Target == "" || !phase.valid() {
		return Upgrade{}, fmt.Errorf("recording upgrade phase %q: no upgrade instructed, or no such phase", phase)
	}
	next := Upgrade{Target: u.Target, Phase: phase, Node: node, Time: now, Message: message, resourceVersion: u.resourceVersion}
	if err := next.write(ctx, kube); err != nil {
		return Upgrade{}, fmt.Errorf("recording upgrade phase %s: %w", phase, err)
	}
	return next, nil
}

// write stores u's keys into the record at u's resourceVersion, and takes the new one.
func (u *Upgrade) write(ctx context.Context, kube kubernetes.Interface) error {
	cm, err := readConfigMap(ctx, kube)
	if err != nil {
		return err
	}
	cm.ResourceVersion = u.resourceVersion
	if cm.Data == nil {
		cm.Data = map[string]string{}
	}
	at := ""
	if !u.Time.IsZero() {
		at = u.Time.UTC().Format(time.RFC3339)
	}
	for key, v := range map[string]string{keyUpgradeTarget: u.Target, keyUpgradePhase: string(u.Phase),
		keyUpgradeNode: u.Node, keyUpgradeTime: at, keyUpgradeMessage: u.Message} {
		if v == "" {
			delete(cm.Data, key)
			continue
		}
		cm.Data[key] = v
	}
	cm, err = kube.CoreV1().ConfigMaps(Namespace).Update(ctx, cm, metav1.UpdateOptions{})
	if err != nil {
		return fmt.Errorf("writing the cluster record: %w", err)
	}
	u.resourceVersion = cm.ResourceVersion
	return nil
}
