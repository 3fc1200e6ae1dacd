package joinserver

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/nodeagent/internal/telemetry"
)

// TestPolicyLoadsWatched: the readiness check passes once a source set the store, not before, and the
// metrics show the policy.
func TestPolicyLoadsWatched(t *testing.T) {
	m := telemetry.New(telemetry.Labels{})
	store := policy.NewStore(nil)
	ctx, cancel := context.WithCancel(t.Context())
	var running sync.WaitGroup
	defer running.Wait()
	defer cancel()
	check := watchPolicyLoads(ctx, &running, store, m)
	if check() == nil {
		t.Fatal("ready before any policy was loaded")
	}
	store.Set(&policy.Policy{Images: []policy.Image{{Name: "img", PCRs: map[int][]byte{4: make([]byte, 32)}}}})
	deadline := time.Now().Add(time.Minute)
	for check() != nil {
		if time.Now().After(deadline) {
			t.Fatal("the loaded policy was never noticed")
		}
		time.Sleep(10 * time.Millisecond)
	}
	families, err := m.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	images := -1.0
	for _, f := range families {
		if f.GetName() == "berth_join_policy_images" {
			images = f.GetMetric()[0].GetGauge().GetValue()
		}
	}
	if images != 1 {
		t.Errorf("berth_join_policy_images = %v, want 1", images)
	}
}
