package clusterinfo

import (
	"errors"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/berthlabs/berth/test/kubetest"
)

func TestUpgradeRecord(t *testing.T) {
	api := kubetest.Start(t)
	ctx := t.Context()
	now := time.Date(2026, 11, 29, 8, 0, 0, 0, time.UTC)

	if _, err := InstructUpgrade(ctx, api.Client, "v1.37.0", now); !errors.Is(err, ErrNotFound) {
		t.Fatalf("an upgrade instructed without a record: %v, want ErrNotFound", err)
	}
	if err := Publish(ctx, api.Client, Info{ID: idA, Name: "prod", Init: InitSettings{KubernetesVersion: "v1.36.3"}}); err != nil {
		t.Fatal(err)
	}
	if u, err := ReadUpgrade(ctx, api.Client); err != nil || u.Target != "" || u.Phase != "" {
		t.Fatalf("the upgrade of a fresh record: %+v, %v; want none", u, err)
	}
	if _, err := InstructUpgrade(ctx, api.Client, "1.37.0", now); err == nil {
		t.Error("an upgrade to a version without its v was instructed")
	}

	instructed, err := InstructUpgrade(ctx, api.Client, "v1.37.0", now)
	if err != nil {
		t.Fatal(err)
	}
	// Two nodes read the instruction; the first to record its phase wins, the second learns it lost.
	seenByA, err := ReadUpgrade(ctx, api.Client)
	if err != nil {
		t.Fatal(err)
	}
	seenByB := seenByA
	if seenByA.Target != "v1.37.0" || seenByA.Phase != PhaseInstructed || !seenByA.Time.Equal(now) || seenByA.Node != "" {
		t.Errorf("ReadUpgrade = %+v, want v1.37.0 instructed at %s", seenByA, now)
	}
	applying, err := seenByA.Record(ctx, api.Client, PhaseApplying, "cp-3", "", now.Add(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := seenByB.Record(ctx, api.Client, PhaseApplying, "cp-4", "", now.Add(time.Minute)); err == nil {
		t.Error("a node recorded its phase over another's it had not read")
	}
	if _, err := applying.Record(ctx, api.Client, PhaseApplied, "cp-3", "waiting for 2 control-plane nodes", now.Add(5*time.Minute)); err != nil {
		t.Errorf("the leader recording its next phase: %v", err)
	}
	// The instruction given again (terraform apply run twice) keeps the upgrade where it is.
	again, err := InstructUpgrade(ctx, api.Client, "v1.37.0", now.Add(time.Hour))
	if err != nil || again.Phase != PhaseApplied || again.Node != "cp-3" || again.Message != "waiting for 2 control-plane nodes" {
		t.Errorf("the same instruction again: %+v, %v; want the upgrade left applied by cp-3", again, err)
	}
	if _, err := instructed.Record(ctx, api.Client, PhaseDone, "cp-3", "", now); err == nil {
		t.Error("a phase recorded from a stale read")
	}
	// A new target starts over, and the record's other keys are left alone.
	next, err := InstructUpgrade(ctx, api.Client, "v1.37.1", now.Add(2*time.Hour))
	if err != nil || next.Phase != PhaseInstructed || next.Node != "" || next.Message != "" {
		t.Errorf("a new target: %+v, %v; want it instructed afresh", next, err)
	}
	if info, err := Read(ctx, api.Client); err != nil || info.ID != idA || info.Init.KubernetesVersion != "v1.36.3" {
		t.Errorf("the record after upgrades: %+v, %v; want the init's settings as they were", info, err)
	}

	cms := api.Client.CoreV1().ConfigMaps(Namespace)
	cm, err := cms.Get(ctx, Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cm.Data[keyUpgradePhase] = "halfway"
	if _, err := cms.Update(ctx, cm, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadUpgrade(ctx, api.Client); err == nil || !strings.Contains(err.Error(), "damaged") {
		t.Errorf("ReadUpgrade of a hand-edited phase: %v, want the record called damaged", err)
	}
}
