package certrenew

import (
	"context"
	"fmt"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// LeaseName is the Lease in kube-system that lets one control-plane node at a time renew its certificates and
// restart its control plane: two at once would take two API servers (and on a two-member etcd, the quorum's
// client) away together.
const LeaseName = "berth-certificate-renewal"

// lease is the renewal Lease as one node holds it.
type lease struct {
	client   kubernetes.Interface
	holder   string
	duration time.Duration
	now      func() time.Time
}

// tryAcquire takes the Lease if nobody holds it, its holder is this node, or its holder let it lapse; else
// it returns the holder. Concurrent takers are kept apart by the API server's optimistic concurrency: the
// loser's update conflicts.
func (l *lease) tryAcquire(ctx context.Context) (taken bool, holder string, err error) {
	leases := l.client.CoordinationV1().Leases(metav1.NamespaceSystem)
	now := metav1.NewMicroTime(l.now())
	seconds := int32(l.duration / time.Second)
	cur, err := leases.Get(ctx, LeaseName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		_, err = leases.Create(ctx, &coordinationv1.Lease{
			ObjectMeta: metav1.ObjectMeta{Name: LeaseName, Namespace: metav1.NamespaceSystem},
			Spec: coordinationv1.LeaseSpec{HolderIdentity: &l.holder, LeaseDurationSeconds: &seconds,
				AcquireTime: &now, RenewTime: &now},
		}, metav1.CreateOptions{})
		if apierrors.IsAlreadyExists(err) {
			return false, "", nil
		}
		if err != nil {
			return false, "", fmt.Errorf("creating lease %s: %w", LeaseName, err)
		}
		return true, l.holder, nil
	}
	if err != nil {
		return false, "", fmt.Errorf("reading lease %s: %w", LeaseName, err)
	}
	if h := holderOf(cur); h != "" && h != l.holder && !lapsed(cur, l.now()) {
		return false, h, nil
	}
	cur.Spec.HolderIdentity, cur.Spec.LeaseDurationSeconds, cur.Spec.AcquireTime, cur.Spec.RenewTime = &l.holder, &seconds, &now, &now
	if _, err := leases.Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
		if apierrors.IsConflict(err) {
			return false, "", nil
		}
		return false, "", fmt.Errorf("taking lease %s: %w", LeaseName, err)
	}
	return true, l.holder, nil
}

// release gives the Lease up, if this node still holds it.
func (l *lease) release(ctx context.Context) error {
	leases := l.client.CoordinationV1().Leases(metav1.NamespaceSystem)
	cur, err := leases.Get(ctx, LeaseName, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("reading lease %s: %w", LeaseName, err)
	}
	if holderOf(cur) != l.holder {
		return nil
	}
	cur.Spec.HolderIdentity = nil
	if _, err := leases.Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("releasing lease %s: %w", LeaseName, err)
	}
	return nil
}

func holderOf(l *coordinationv1.Lease) string {
	if l.Spec.HolderIdentity == nil {
		return ""
	}
	return *l.Spec.HolderIdentity
}

// lapsed says whether the Lease's holder let it run out: a node that died while renewing does not block the
// others for longer than the Lease's duration.
func lapsed(l *coordinationv1.Lease, now time.Time) bool {
	if l.Spec.RenewTime == nil || l.Spec.LeaseDurationSeconds == nil {
		return true
	}
	return now.After(l.Spec.RenewTime.Add(time.Duration(*l.Spec.LeaseDurationSeconds) * time.Second))
}
