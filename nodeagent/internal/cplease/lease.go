// Package cplease is the Lease under which a control-plane node changes its control plane: a certificate
// renewal (package certrenew) or a Kubernetes upgrade (package kubeupgrade). Either restarts the node's
// static pods, so two nodes at once would take two API servers (and on a two-member etcd, the quorum's
// client) away together, and an upgrade and a renewal must never overlap.
package cplease

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// Name is the Lease in kube-system. It keeps the name it had when only renewals took it: agents of older
// images, which know only this name, keep taking the same Lease while an upgrade rolls them out.
const Name = "berth-certificate-renewal"

// Lease is the Lease as one node holds it.
type Lease struct {
	Client kubernetes.Interface
	// Holder is the node's name.
	Holder string
	// Duration outlasts the work done under the Lease, so that only a node that died while working lets it
	// lapse. A node that takes the Lease after it lapsed keeps its own.
	Duration time.Duration
	// Now is the clock; time.Now when nil.
	Now func() time.Time
}

func (l *Lease) now() time.Time {
	if l.Now == nil {
		return time.Now()
	}
	return l.Now()
}

// TryAcquire takes the Lease if nobody holds it, its holder is this node, or its holder let it lapse; else
// it returns the holder. Concurrent takers are kept apart by the API server's optimistic concurrency: the
// loser's update conflicts.
func (l *Lease) TryAcquire(ctx context.Context) (taken bool, holder string, err error) {
	leases := l.Client.CoordinationV1().Leases(metav1.NamespaceSystem)
	now := metav1.NewMicroTime(l.now())
	seconds := int32(l.Duration / time.Second)
	cur, err := leases.Get(ctx, Name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		_, err = leases.Create(ctx, &coordinationv1.Lease{
			ObjectMeta: metav1.ObjectMeta{Name: Name, Namespace: metav1.NamespaceSystem},
			Spec: coordinationv1.LeaseSpec{HolderIdentity: &l.Holder, LeaseDurationSeconds: &seconds,
				AcquireTime: &now, RenewTime: &now},
		}, metav1.CreateOptions{})
		if apierrors.IsAlreadyExists(err) {
			return false, "", nil
		}
		if err != nil {
			return false, "", fmt.Errorf("creating lease %s: %w", Name, err)
		}
		return true, l.Holder, nil
	}
	if err != nil {
		return false, "", fmt.Errorf("reading lease %s: %w", Name, err)
	}
	if h := HolderOf(cur); h != "" && h != l.Holder && !lapsed(cur, l.now()) {
		return false, h, nil
	}
	cur.Spec.HolderIdentity, cur.Spec.LeaseDurationSeconds, cur.Spec.AcquireTime, cur.Spec.RenewTime = &l.Holder, &seconds, &now, &now
	if _, err := leases.Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
		if apierrors.IsConflict(err) {
			return false, "", nil
		}
		return false, "", fmt.Errorf("taking lease %s: %w", Name, err)
	}
	return true, l.Holder, nil
}

// Release gives the Lease up, if this node still holds it.
func (l *Lease) Release(ctx context.Context) error {
	leases := l.Client.CoordinationV1().Leases(metav1.NamespaceSystem)
	cur, err := leases.Get(ctx, Name, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("reading lease %s: %w", Name, err)
	}
	if HolderOf(cur) != l.Holder {
		return nil
	}
	cur.Spec.HolderIdentity = nil
	if _, err := leases.Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("releasing lease %s: %w", Name, err)
	}
	return nil
}

// Do runs work holding the Lease. taken is false, with the holder, when another node holds it; err is work's
// error or the Lease's. The Lease is given up after work, even when work failed or ctx ended, with a client
// from client when it gives one: work may have renewed the certificate l.Client authenticates with. A Lease
// that cannot be given up is logged and left to lapse.
func (l *Lease) Do(ctx context.Context, client func() (kubernetes.Interface, error), log *slog.Logger, work func(ctx context.Context) error) (taken bool, holder string, err error) {
	taken, holder, err = l.TryAcquire(ctx)
	if err != nil || !taken {
		return taken, holder, err
	}
	defer func() {
		if c, err := client(); err == nil {
			l.Client = c
		}
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
		defer cancel()
		if err := l.Release(ctx); err != nil {
			log.Warn("the control-plane lease stays until it lapses", "error", err)
		}
	}()
	return true, l.Holder, work(ctx)
}

// releaseTimeout bounds the release of the Lease after the work, whose own context may have ended.
const releaseTimeout = 30 * time.Second

// HolderOf is the Lease's holder; "" when nobody holds it.
func HolderOf(l *coordinationv1.Lease) string {
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
