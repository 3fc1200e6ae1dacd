package cplease

import (
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/berthlabs/berth/test/kubetest"
)

// TestLeaseLapses: a holder that let its Lease run out (a node that died while it worked) does not keep the
// others out.
func TestLeaseLapses(t *testing.T) {
	api := kubetest.Start(t)
	now := time.Now()
	dead := &Lease{Client: api.Client, Holder: "cp-0", Duration: time.Minute, Now: func() time.Time { return now }}
	alive := &Lease{Client: api.Client, Holder: "cp-1", Duration: time.Minute, Now: func() time.Time { return now.Add(30 * time.Second) }}
	if taken, _, err := dead.TryAcquire(t.Context()); !taken || err != nil {
		t.Fatalf("first take: %v, %v", taken, err)
	}
	if taken, holder, err := alive.TryAcquire(t.Context()); taken || holder != "cp-0" || err != nil {
		t.Fatalf("take of a held lease: %v by %q, %v; want refused, held by cp-0", taken, holder, err)
	}
	alive.Now = func() time.Time { return now.Add(2 * time.Minute) }
	if taken, _, err := alive.TryAcquire(t.Context()); !taken || err != nil {
		t.Fatalf("take of a lapsed lease: %v, %v", taken, err)
	}
	// The node that came back late does not take it from the new holder, nor release it.
	if err := dead.Release(t.Context()); err != nil {
		t.Fatal(err)
	}
	l, err := api.Client.CoordinationV1().Leases(metav1.NamespaceSystem).Get(t.Context(), Name, metav1.GetOptions{})
	if err != nil || HolderOf(l) != "cp-1" {
		t.Errorf("lease held by %q (%v), want cp-1", HolderOf(l), err)
	}
}
