package joinservice

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// GoneNodes removes the Nodes of instances that were deleted, where the instance inventory says so: an
// instance the lookup no longer finds at the Node's addresses is one whose machine is gone for good (the
// lab's metadata service, an operator's inventory for bare metal), not one that is only powered off, which
// the inventory still lists. A cloud's API does not list a stopped instance either: there this is for the
// cloud's controller manager, which can tell the two apart.
type GoneNodes struct {
	Client kubernetes.Interface
	Lookup InstanceLookup
}

// Collect marks each Node that is not Ready and whose instance the lookup does not find, and removes a Node
// that has stayed so for grace on every sweep since. A Ready Node is alive whatever the inventory says; a
// Node found again, or Ready again, loses its mark; a lookup that fails marks nothing. It returns the Nodes
// it removed.
func (g *GoneNodes) Collect(ctx context.Context, grace time.Duration, now time.Time) ([]string, error) {
	nodes, err := g.Client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("listing nodes: %w", err)
	}
	var removed []string
	var errs []error
	for _, n := range nodes.Items {
		gone := false
		if !ready(&n) {
			var addrs []string
			for _, a := range n.Status.Addresses {
				if a.Type == corev1.NodeInternalIP || a.Type == corev1.NodeExternalIP {
					addrs = append(addrs, a.Address)
				}
			}
			if len(addrs) == 0 {
				continue
			}
			present, err := instancePresent(ctx, g.Lookup, n.Name, strings.Join(addrs, ","))
			if err != nil {
				errs = append(errs, fmt.Errorf("node %s: %w", n.Name, err))
				continue
			}
			gone = !present
		}
		since, marked := n.Annotations[absentSinceAnnotation]
		switch {
		case !gone && !marked:
		case !gone:
			delete(n.Annotations, absentSinceAnnotation)
			_, err = g.Client.CoreV1().Nodes().Update(ctx, &n, metav1.UpdateOptions{})
		case !marked:
			if n.Annotations == nil {
				n.Annotations = map[string]string{}
			}
			n.Annotations[absentSinceAnnotation] = now.UTC().Format(time.RFC3339)
			_, err = g.Client.CoreV1().Nodes().Update(ctx, &n, metav1.UpdateOptions{})
		default:
			t, perr := time.Parse(time.RFC3339, since)
			if perr == nil && now.Sub(t) < grace {
				continue
			}
			// Only as it was read: a node that came back meanwhile changed it.
			err = g.Client.CoreV1().Nodes().Delete(ctx, n.Name, metav1.DeleteOptions{
				Preconditions: &metav1.Preconditions{ResourceVersion: &n.ResourceVersion}})
			if err == nil {
				removed = append(removed, n.Name)
			}
		}
		if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
			errs = append(errs, fmt.Errorf("node %s: %w", n.Name, err))
		}
	}
	return removed, errors.Join(errs...)
}

// ready says whether the Node's kubelet reports it Ready.
func ready(n *corev1.Node) bool {
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}
