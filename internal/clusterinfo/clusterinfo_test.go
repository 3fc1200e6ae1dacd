package clusterinfo

import (
	"context"
	"errors"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/berthlabs/berth/test/kubetest"
)

const (
	idA = "0123456789abcdef0123456789abcdef"
	idB = "fedcba9876543210fedcba9876543210"
)

func TestPublishAndRead(t *testing.T) {
	api := kubetest.Start(t)
	ctx := context.Background()

	if _, err := Read(ctx, api.Client); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Read before Publish: got %v, want ErrNotFound", err)
	}
	// An unset control-plane endpoint stays empty: an import gives it back as the unset argument it was.
	want := Info{ID: idA, Name: "prod", Init: InitSettings{KubernetesVersion: "v1.36.3", PodSubnet: "10.244.0.0/16",
		PodNetwork: "flannel", APIServerEndpoint: "10.0.0.10:6443", JoinCACertificate: "-----BEGIN CERTIFICATE-----\n"}}
	if err := Publish(ctx, api.Client, want); err != nil {
		t.Fatal(err)
	}
	got, err := Read(ctx, api.Client)
	if err != nil {
		t.Fatal(err)
	}
	if got != want {
		t.Errorf("Read = %+v, want %+v", got, want)
	}
	if err := Publish(ctx, api.Client, Info{ID: idA, Name: "prod"}); err != nil {
		t.Errorf("publishing the same record again: %v", err)
	}
	err = Publish(ctx, api.Client, Info{ID: idB, Name: "prod"})
	if err == nil || !strings.Contains(err.Error(), "already belongs to cluster "+idA) {
		t.Errorf("publishing another cluster's record: got %v", err)
	}

	cms := api.Client.CoreV1().ConfigMaps(Namespace)
	cm, err := cms.Get(ctx, Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cm.Data[keyID] = "not-an-id"
	if _, err := cms.Update(ctx, cm, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := Read(ctx, api.Client); err == nil || !strings.Contains(err.Error(), "damaged") {
		t.Errorf("Read of a hand-edited record: got %v", err)
	}
}

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		info Info
		ok   bool
	}{
		{Info{ID: idA, Name: "prod"}, true},
		{Info{ID: strings.ToUpper(idA), Name: "prod"}, false},
		{Info{ID: idA[:31], Name: "prod"}, false},
		{Info{ID: idA, Name: ""}, false},
		{Info{ID: idA, Name: "Prod"}, false},
	} {
		if err := tc.info.Validate(); (err == nil) != tc.ok {
			t.Errorf("Validate(%+v) = %v, want ok=%v", tc.info, err, tc.ok)
		}
	}
}
