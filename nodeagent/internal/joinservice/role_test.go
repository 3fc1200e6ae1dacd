package joinservice

import (
	"context"
	"errors"
	"net/netip"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/repotest"
	"github.com/berthlabs/berth/test/kubetest"
)

// TestDocumentedRole runs what a join service beside an external control plane does to its disk records on
// a real API server, as the identity whose Role and RoleBinding docs/external-control-plane.md gives (read
// from the document): the watch of the records, a node that comes back with a new disk (its earlier disk's
// record is removed), and the sweep of a node gone from the inventory (its record marked, then removed).
func TestDocumentedRole(t *testing.T) {
	api := kubetest.Start(t)
	api.CreateRBAC(t, repotest.MarkdownBlock(t, "docs/external-control-plane.md", "kind: Role"))
	rc, err := clientcmd.RESTConfigFromKubeConfig(api.ClientKubeconfig(t, "berth-join-service"))
	if err != nil {
		t.Fatal(err)
	}
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	records, err := WatchNodeRecords(ctx, client, false)
	if err != nil {
		t.Fatal(err)
	}
	disks := &KubeDisks{Client: client, Records: records}
	addr := netip.MustParseAddr("10.0.0.30")
	metal := &metadata.Instance{Name: "metal-1", Role: metadata.RoleWorker, Addresses: []netip.Addr{addr}}

	if err := disks.Claim(ctx, testDisk, ekAlice, metal); err != nil {
		t.Fatalf("the first disk's record: %v", err)
	}
	waitForWatch(t, "the watch to hold metal-1's first disk", func() bool {
		names, ok := records.names(configMapsOf, metal.Name)
		return ok && len(names) == 1
	})
	if err := disks.Claim(ctx, otherDisk, ekAlice, metal); err != nil {
		t.Fatalf("metal-1 back with a new disk: %v", err)
	}
	if _, err := disks.Owner(ctx, testDisk); !errors.Is(err, ErrDiskUnknown) {
		t.Errorf("the earlier disk's record: %v, want it removed", err)
	}

	now := time.Now()
	if removed, err := disks.Collect(ctx, fixedLookup{}, DefaultRetention, now); err != nil || len(removed) != 0 {
		t.Fatalf("the sweep that first misses metal-1: removed %v, %v; want it marked", removed, err)
	}
	cm, err := api.Client.CoreV1().ConfigMaps(Namespace).Get(ctx, "berth-disk-"+otherDisk, metav1.GetOptions{})
	if err != nil || cm.Annotations[absentSinceAnnotation] == "" {
		t.Fatalf("metal-1's record after it left the inventory: %v (annotations %v), want it marked absent", err, cm.GetAnnotations())
	}
	removed, err := disks.Collect(ctx, fixedLookup{}, DefaultRetention, now.Add(DefaultRetention+time.Minute))
	if err != nil || len(removed) != 1 || removed[0] != otherDisk {
		t.Fatalf("the sweep after the retention: removed %v, %v; want metal-1's disk", removed, err)
	}
}
