package provider

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/diag"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/berthlabs/berth/internal/clusterinfo"
	"github.com/berthlabs/berth/internal/clustersecrets"
	"github.com/berthlabs/berth/internal/keys"
	"github.com/berthlabs/berth/internal/kubeadm"
	"github.com/berthlabs/berth/internal/pki"
)

// An import rebuilds berth_secrets or berth_cluster from what an operator still has once Terraform state is
// lost: the root key (the provider's root_key) and the cluster's address (the import ID). The cluster is
// asked, not trusted. The provider reaches its API server with admin credentials it mints from the root key
// and accepts the server only if its certificate chains to the Kubernetes CA key the root key derives; it
// keeps CA certificates only if their keys are the derived ones, and the cluster record only if its ID is
// the one the root key makes.

const (
	// importAdminValidity bounds the credentials an import mints to read the cluster.
	importAdminValidity = 10 * time.Minute
	// importedKubeconfigValidity is that of the admin kubeconfig an imported berth_cluster keeps, a year as
	// kubeadm's admin.conf, which berth_cluster keeps after an init.
	importedKubeconfigValidity = 365 * 24 * time.Hour
	// importedKey marks, in a resource's private state, a berth_secrets imported and not applied since.
	importedKey = "imported"
	// rootCAConfigMap is where every namespace gets the cluster's CA certificate (kube-controller-manager's
	// root CA publisher), kube-system included.
	rootCAConfigMap = "kube-root-ca.crt"
)

// importedCluster is a running cluster as the root key proves it.
type importedCluster struct {
	secrets        *clustersecrets.Secrets
	record         clusterinfo.Info
	kubeCA, joinCA *pki.CA
	// release is the Kubernetes release the cluster runs: the init's, or the one an upgrade took it to.
	release string
}

// importRootKey is the provider's root_key, or a diagnostic that says how to give it.
func importRootKey(data *providerData, resourceType string, diags *diag.Diagnostics) (string, bool) {
	if data == nil || data.rootKey == "" {
		diags.AddError("Importing "+resourceType+" needs the root key",
			"Set root_key in the provider block, from an ephemeral variable or an ephemeral read of the secret store "+
				"that keeps the root key (docs/guides/import.md). The import ID cannot carry it: Terraform prints "+
				"import IDs.")
		return "", false
	}
	return data.rootKey, true
}

// readImportedCluster reads the cluster at apiServer (host:port or an https URL) with credentials made from
// rootKey, and checks that it is the root key's cluster.
func readImportedCluster(ctx context.Context, rootKey, apiServer string) (*importedCluster, error) {
	host, err := apiServerURL(apiServer)
	if err != nil {
		return nil, err
	}
	secrets, err := deriveSecrets(rootKey)
	if err != nil {
		return nil, err
	}
	// The cluster's CA certificate is not known yet. One made now for the derived key stands in for it: the
	// same name and key verify the API server's certificate and sign a client certificate it accepts.
	now := time.Now()
	standIn, _, err := secrets.NewCAs(now, 2*importAdminValidity)
	if err != nil {
		return nil, err
	}
	key, err := pki.NewKey()
	if err != nil {
		return nil, err
	}
	cert, err := standIn.IssueClient(pki.ClientTemplate{CommonName: defaultAdminUser, Organization: []string{adminGroup}},
		key.Public(), now, importAdminValidity)
	if err != nil {
		return nil, err
	}
	keyPEM, err := pki.EncodeKeyPEM(key)
	if err != nil {
		return nil, err
	}
	kube, err := kubernetes.NewForConfig(&rest.Config{Host: host, Timeout: probeTimeout, TLSClientConfig: rest.TLSClientConfig{
		CAData: standIn.CertPEM(), CertData: pki.EncodeCertPEM(cert), KeyData: keyPEM}})
	if err != nil {
		return nil, err
	}
	record, err := clusterinfo.Read(ctx, kube)
	switch {
	case anotherCluster(err):
		return nil, fmt.Errorf("the API server at %s is not of this root key's cluster: its certificate is not from "+
			"the root key's Kubernetes CA, or it refuses credentials from it (%v)", host, err)
	case err != nil:
		return nil, err
	}
	if id, err := keys.ClusterIDOf(secrets.MasterSecret, secrets.Salt); err != nil {
		return nil, err
	} else if record.ID != id {
		return nil, fmt.Errorf("the API server at %s holds the record of cluster %s, but this root key makes cluster %s", host, record.ID, id)
	}
	if record.Init.JoinCACertificate == "" {
		return nil, fmt.Errorf("cluster %s was initialized before its record (ConfigMap %s/%s) kept the join CA "+
			"certificate and the init settings, which an import needs: it cannot be imported", record.ID,
			clusterinfo.Namespace, clusterinfo.Name)
	}
	cm, err := kube.CoreV1().ConfigMaps(metav1.NamespaceSystem).Get(ctx, rootCAConfigMap, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("reading the cluster's CA certificate (ConfigMap %s/%s): %w", metav1.NamespaceSystem, rootCAConfigMap, err)
	}
	kubeCA, joinCA, err := secrets.CAs([]byte(cm.Data["ca.crt"]), []byte(record.Init.JoinCACertificate))
	if err != nil {
		return nil, fmt.Errorf("the cluster's CA certificates: %w", err)
	}
	// After an upgrade the cluster runs another release than the init did: kubeadm's configuration, which
	// `kubeadm upgrade apply` raises, says which. A state with the init's would plan the upgrade again, or,
	// two minors on, refuse the configuration's release as a skipped minor.
	release := record.Init.KubernetesVersion
	if current, found, err := kubeadm.ClusterRelease(ctx, kube); err != nil {
		return nil, err
	} else if found && current != "" {
		release = current
	}
	return &importedCluster{secrets: secrets, record: record, kubeCA: kubeCA, joinCA: joinCA, release: release}, nil
}

// clusterImportID takes berth_cluster's import ID apart: "<endpoint>" when the API server listens on the
// node's own address (no control_plane_endpoint), "<endpoint>,<API server host:port>" otherwise.
func clusterImportID(id string) (endpoint, apiServer string, err error) {
	endpoint, apiServer, _ = strings.Cut(id, ",")
	if msg := hostPortError(endpoint); msg != "" {
		return "", "", fmt.Errorf("%q does not start with the init endpoint as host:port (berth_cluster's endpoint): %s", id, msg)
	}
	if apiServer == "" {
		host, _, _ := net.SplitHostPort(endpoint)
		return endpoint, net.JoinHostPort(host, fmt.Sprint(kubeadm.DefaultBindPort)), nil
	}
	if _, err := apiServerURL(apiServer); err != nil {
		return "", "", errors.New("after the comma comes the API server's host:port: " + err.Error())
	}
	return endpoint, apiServer, nil
}

// importError reports a failed import with what the operator gave, never the root key.
func importError(diags *diag.Diagnostics, resourceType, id string, err error) {
	diags.AddError("Importing "+resourceType+" from "+id+" failed", err.Error())
}
