package provider

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-log/tflog"

	"github.com/berthlabs/berth/internal/clustersecrets"
	"github.com/berthlabs/berth/internal/pki"
)

// adminRenewBefore is how long before its end a refresh renews the admin kubeconfig in state, when the
// provider has the root key. It ends with kubeadm's admin.conf (a year, or certificate_validity), and
// afterwards the API server refuses it as it refuses another cluster's credentials: the provider could no
// longer check the cluster, plan an upgrade, or configure a provider from it. A month leaves room for
// clusters applied monthly.
const adminRenewBefore = 30 * 24 * time.Hour

// renewAdmin looks at the admin kubeconfig in m at a refresh. One that ends within adminRenewBefore is
// replaced by one minted from rootKey, the provider's (renewed); without the root key, or with another
// cluster's, warning says why it was not. expired is whether the kubeconfig m holds afterwards has ended. A
// kubeconfig that does not parse is left to the cluster check, which reports it.
func renewAdmin(ctx context.Context, m *clusterModel, rootKey string, now time.Time) (renewed, expired bool, warning string) {
	creds, err := parseKubeconfig([]byte(m.Kubeconfig.ValueString()))
	if err != nil {
		return false, false, ""
	}
	cert, err := pki.ParseCertPEM(creds.certPEM)
	if err != nil || now.Before(cert.NotAfter.Add(-adminRenewBefore)) {
		return false, false, ""
	}
	ends := cert.NotAfter.UTC().Format(time.RFC3339)
	expired = !now.Before(cert.NotAfter)
	if rootKey == "" {
		if expired {
			return false, true, fmt.Sprintf("The admin kubeconfig in state ended at %s. The API server refuses it, so the "+
				"provider can neither check the cluster nor plan its upgrades, and providers configured from it fail. "+
				"The cluster stays in state. Set root_key in the provider block (docs/guides/import.md shows how to "+
				"read it from your secret store) and refresh: the provider then mints a new kubeconfig.", ends)
		}
		return false, false, fmt.Sprintf("The admin kubeconfig in state ends at %s. Set root_key in the provider block "+
			"(docs/guides/import.md shows how to read it from your secret store) before then, and a refresh mints a new "+
			"one.", ends)
	}
	ca, err := kubernetesCA(rootKey, m.KubernetesCACertificate.ValueString())
	if errors.Is(err, clustersecrets.ErrWrongRootKey) {
		err = errors.New("the provider's root_key did not make this cluster's Kubernetes CA")
	}
	validity := time.Duration(0)
	if err == nil {
		// A certificate cannot outlive its CA.
		if validity = min(importedKubeconfigValidity, ca.Cert.NotAfter.Sub(now).Truncate(time.Hour)); validity <= 0 {
			err = fmt.Errorf("the cluster's Kubernetes CA ended at %s", ca.Cert.NotAfter.UTC().Format(time.RFC3339))
		}
	}
	var admin adminCredentials
	if err == nil {
		admin, err = mintAdmin(ca, adminRequest{host: creds.server, user: defaultAdminUser, validity: validity}, now)
	}
	if err != nil {
		verb := "ends"
		if expired {
			verb = "ended"
		}
		return false, expired, fmt.Sprintf("The admin kubeconfig in state %s at %s, and a new one could not be minted: %v.", verb, ends, err)
	}
	m.Kubeconfig = types.StringValue(string(admin.kubeconfig))
	m.ClientCertificate = types.StringValue(string(admin.certPEM))
	m.ClientKey = types.StringValue(string(admin.keyPEM))
	tflog.Info(ctx, "renewed the admin kubeconfig in state", map[string]any{"cluster_id": m.ClusterID.ValueString(),
		"old_expires_at": ends, "expires_at": admin.notAfter.UTC().Format(time.RFC3339), "user": defaultAdminUser})
	return true, false, ""
}
