package joinservice

import (
	"context"
	"errors"
	"net/netip"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/berthlabs/berth/internal/metadata"
)

func node(name, addr string, isReady bool) *corev1.Node {
	status := corev1.ConditionFalse
	if isReady {
		status = corev1.ConditionTrue
	}
	return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}, Status: corev1.NodeStatus{
		Addresses:  []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: addr}},
		Conditions: []corev1.NodeCondition{{Type: corev1.NodeReady, Status: status}},
	}}
}

// TestGoneNodesCollect: a NotReady Node whose instance the inventory no longer lists is removed after the
// grace; one the inventory still lists (powered off) stays, and so does a Ready one the inventory lost; a
// Node that comes back starts its grace anew; a failing lookup removes nothing.
func TestGoneNodesCollect(t *testing.T) {
	ctx := context.Background()
	client := fake.NewClientset(
		node("deleted", "10.0.0.5", false), node("powered-off", "10.0.0.6", false),
		node("ready", "10.0.0.7", true), node("back", "10.0.0.8", false))
	a6, a8 := netip.MustParseAddr("10.0.0.6"), netip.MustParseAddr("10.0.0.8")
	now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	grace := 30 * time.Minute
	sweep := func(lookup InstanceLookup, at time.Duration) []string {
		t.Helper()
		removed, err := (&GoneNodes{Client: client, Lookup: lookup}).Collect(ctx, grace, now.Add(at))
		if err != nil {
			t.Fatal(err)
		}
		return removed
	}
	left := func() []string {
		t.Helper()
		list, err := client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, n := range list.Items {
			names = append(names, n.Name)
		}
		slices.Sort(names)
		return names
	}
	inventory := fixedLookup{a6: "powered-off"}
	if removed := sweep(inventory, 0); len(removed) != 0 {
		t.Fatalf("the first sweep removed %v; it only marks", removed)
	}
	if removed := sweep(inventory, 10*time.Minute); len(removed) != 0 {
		t.Fatalf("a sweep within the grace removed %v", removed)
	}
	// "back" is listed again (its machine was only moved): its mark goes.
	inventory[a8] = "back"
	if removed := sweep(inventory, 40*time.Minute); !slices.Equal(removed, []string{"deleted"}) {
		t.Fatalf("after the grace: removed %v, want the deleted instance's Node", removed)
	}
	if got, want := left(), []string{"back", "powered-off", "ready"}; !slices.Equal(got, want) {
		t.Fatalf("Nodes left %v, want %v", got, want)
	}
	delete(inventory, a8)
	if removed := sweep(inventory, 50*time.Minute); len(removed) != 0 {
		t.Fatalf("removed %v: the absence of back counts from its new mark", removed)
	}
	failing := lookupFunc(func(context.Context, netip.Addr) (*metadata.Instance, error) {
		return nil, errors.New("inventory down")
	})
	if _, err := (&GoneNodes{Client: client, Lookup: failing}).Collect(ctx, grace, now.Add(10*time.Hour)); err == nil {
		t.Fatal("a failing lookup gave no error")
	}
	if got := left(); len(got) != 3 {
		t.Fatalf("a failing lookup removed Nodes: %v left", got)
	}
	if removed := sweep(inventory, 2*time.Hour); !slices.Equal(removed, []string{"back"}) {
		t.Fatalf("back, gone for longer than the grace since its new mark: removed %v", removed)
	}
}
