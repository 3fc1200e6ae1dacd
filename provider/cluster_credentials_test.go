package provider

import (
	"context"
	"encoding/base64"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/tfsdk"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-go/tftypes"

	"github.com/berthlabs/berth/internal/pki"
)

// stateWithAdmin is the state of the cluster c with an admin kubeconfig for user that c's CA issued at
// issued for validity.
func stateWithAdmin(t *testing.T, c rootCluster, user string, issued time.Time, validity time.Duration) clusterModel {
	t.Helper()
	admin, err := mintAdmin(c.kubeCA, adminRequest{host: "https://" + c.apiServer, user: user, validity: validity}, issued)
	if err != nil {
		t.Fatal(err)
	}
	return clusterModel{
		Endpoint: types.StringValue("127.0.0.1:1"), ClusterName: types.StringValue("lab"), KubernetesVersion: types.StringValue("v1.36.3"),
		PodNetwork: types.StringValue("flannel"), PCRs: types.MapNull(types.StringType),
		KubernetesCACertificate: types.StringValue(string(c.kubeCA.CertPEM())), JoinCACertificate: types.StringValue(string(c.joinCA.CertPEM())),
		ID: types.StringValue(c.id), ClusterID: types.StringValue(c.id), APIServerEndpoint: types.StringValue(c.apiServer),
		Kubeconfig: types.StringValue(string(admin.kubeconfig)), ClientCertificate: types.StringValue(string(admin.certPEM)),
		ClientKey: types.StringValue(string(admin.keyPEM)),
	}
}

// notAfter is when the admin certificate in m ends.
func notAfter(t *testing.T, m clusterModel) time.Time {
	t.Helper()
	cert, err := pki.ParseCertPEM([]byte(m.ClientCertificate.ValueString()))
	if err != nil {
		t.Fatal(err)
	}
	return cert.NotAfter
}

func TestRenewAdmin(t *testing.T) {
	t.Parallel()
	root := testRoot(11)
	c := startRootCluster(t, root)
	now := time.Now()
	rootKey := base64.StdEncoding.EncodeToString(root)
	for _, tc := range []struct {
		name             string
		issued           time.Time
		validity         time.Duration
		rootKey          string
		renewed, expired bool
		warning          string
	}{
		{name: "far from its end", issued: now, validity: 365 * 24 * time.Hour, rootKey: rootKey},
		{name: "ending soon, no root key", issued: now, validity: 10 * 24 * time.Hour,
			warning: "ends at " + now.Add(10*24*time.Hour).UTC().Format("2006-01-02")},
		{name: "ended, no root key", issued: now.Add(-2 * time.Hour), validity: time.Hour, expired: true,
			warning: "ended at " + now.Add(-time.Hour).UTC().Format("2006-01-02")},
		{name: "ended, another cluster's root key", issued: now.Add(-2 * time.Hour), validity: time.Hour, rootKey: base64.StdEncoding.EncodeToString(testRoot(12)),
			expired: true, warning: "and a new one could not be minted: the provider's root_key did not make this cluster's Kubernetes CA."},
		{name: "ending soon", issued: now, validity: 10 * 24 * time.Hour, rootKey: rootKey, renewed: true},
		{name: "ended", issued: now.Add(-2 * time.Hour), validity: time.Hour, rootKey: rootKey, renewed: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := stateWithAdmin(t, c, "kubernetes-admin", tc.issued, tc.validity)
			before := m
			renewed, expired, warning := renewAdmin(t.Context(), &m, tc.rootKey, now)
			if renewed != tc.renewed || expired != tc.expired || !strings.Contains(warning, tc.warning) || (tc.warning == "") != (warning == "") {
				t.Fatalf("renewed %v, expired %v, warning %q; want %v, %v, %q", renewed, expired, warning, tc.renewed, tc.expired, tc.warning)
			}
			if !renewed {
				if !m.Kubeconfig.Equal(before.Kubeconfig) || !m.ClientCertificate.Equal(before.ClientCertificate) || !m.ClientKey.Equal(before.ClientKey) {
					t.Error("the state changed without a renewal")
				}
				return
			}
			if got, want := notAfter(t, m), now.Add(importedKubeconfigValidity); got.Before(want.Add(-time.Minute)) || got.After(want.Add(time.Minute)) {
				t.Errorf("renewed certificate ends at %s, want a year from now", got)
			}
			// The renewed kubeconfig reaches the cluster as an admin.
			if info, err := readClusterInfo(t.Context(), m.Kubeconfig.ValueString()); err != nil || info.ID != c.id {
				t.Errorf("reading the record with the renewed kubeconfig: %+v, %v", info, err)
			}
		})
	}
}

// readState runs berth_cluster's Read, as a refresh does, on m with the provider's root key.
func readState(t *testing.T, m clusterModel, rootKey string) (*resource.ReadResponse, clusterModel) {
	t.Helper()
	ctx := context.Background()
	r := &clusterResource{data: &providerData{rootKey: rootKey}}
	var schema resource.SchemaResponse
	r.Schema(ctx, resource.SchemaRequest{}, &schema)
	state := tfsdk.State{Schema: schema.Schema, Raw: tftypes.NewValue(schema.Schema.Type().TerraformType(ctx), nil)}
	for name, o := range map[string]*types.Object{"aws": &m.Trust.AWS, "gcp": &m.Trust.GCP} {
		*o = types.ObjectNull(schema.Schema.Attributes[name].GetType().(types.ObjectType).AttrTypes)
	}
	if diags := state.Set(ctx, &m); diags.HasError() {
		t.Fatal(diags)
	}
	resp := &resource.ReadResponse{State: state}
	r.Read(ctx, resource.ReadRequest{State: state}, resp)
	var got clusterModel
	if !resp.State.Raw.IsNull() {
		if diags := resp.State.Get(ctx, &got); diags.HasError() {
			t.Fatal(diags)
		}
	}
	return resp, got
}

// TestReadKeepsClusterWithEndedKubeconfig refreshes a cluster whose admin kubeconfig in state has ended: the
// API server refuses it as it would another cluster's, which must not remove the cluster from state. With the
// root key the refresh renews it.
func TestReadKeepsClusterWithEndedKubeconfig(t *testing.T) {
	t.Parallel()
	root := testRoot(13)
	c := startRootCluster(t, root)
	ended := stateWithAdmin(t, c, "kubernetes-admin", time.Now().Add(-2*time.Hour), time.Hour)

	resp, got := readState(t, ended, "")
	if resp.State.Raw.IsNull() {
		t.Fatalf("the cluster was removed from state: %v", resp.Diagnostics)
	}
	if got.Kubeconfig != ended.Kubeconfig || resp.Diagnostics.WarningsCount() != 1 ||
		!strings.Contains(resp.Diagnostics.Warnings()[0].Detail(), "The cluster stays in state. Set root_key") {
		t.Errorf("diagnostics %v, want the state kept as it was and one warning saying to set root_key", resp.Diagnostics)
	}

	resp, got = readState(t, ended, base64.StdEncoding.EncodeToString(root))
	if resp.Diagnostics.HasError() || resp.Diagnostics.WarningsCount() != 0 || resp.State.Raw.IsNull() {
		t.Fatalf("refresh with the root key: %v", resp.Diagnostics)
	}
	if got.Kubeconfig == ended.Kubeconfig || !notAfter(t, got).After(time.Now().Add(300*24*time.Hour)) {
		t.Error("the refresh with the root key kept the ended kubeconfig")
	}
	if info, err := readClusterInfo(t.Context(), got.Kubeconfig.ValueString()); err != nil || info.ID != c.id {
		t.Errorf("reading the record with the renewed kubeconfig: %+v, %v", info, err)
	}
}
