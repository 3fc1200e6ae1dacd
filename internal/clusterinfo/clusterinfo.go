// Package clusterinfo is the record a Berth cluster keeps of itself in its own API server: its ID and name,
// the settings of its init and its join CA certificate, in the ConfigMap kube-system/berth-cluster.
//
// The first control-plane node writes it during init, before the init client gets its result, so the
// record exists as soon as anyone holds the admin kubeconfig. The Terraform provider reads it to tell
// whether the API server behind a kubeconfig is still the cluster it initialized: a cluster that was torn
// down and initialized again from another root key answers at the same address with another ID. An import
// of berth_secrets or berth_cluster, after Terraform state was lost, reads the rest: nothing in it is
// secret, and nothing else outside the nodes' disks holds the join CA certificate or the init settings as
// the provider sent them.
package clusterinfo

import (
	"context"
	"errors"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/berthlabs/berth/internal/clustername"
)

// Where the record lives, and its keys.
const (
	Namespace = metav1.NamespaceSystem
	Name      = "berth-cluster"
	keyID     = "clusterID"
	keyName   = "clusterName"
	// The init's settings, as the init request gave them ("" where it left one to the node).
	keyKubernetesVersion    = "kubernetesVersion"
	keyControlPlaneEndpoint = "controlPlaneEndpoint"
	keyPodSubnet            = "podSubnet"
	keyServiceSubnet        = "serviceSubnet"
	keyPodNetwork           = "podNetwork"
	keyAPIServerEndpoint    = "apiServerEndpoint"
	keyJoinCACertificate    = "joinCACertificate"
	keyCertificateValidity  = "certificateValidity"
)

// idLen is the length of keys.ClusterIDOf's hex ID.
const idLen = 32

// ErrNotFound is an API server that holds no Berth record: not a Berth cluster, or one whose record was
// deleted.
var ErrNotFound = errors.New("the API server holds no Berth cluster record (ConfigMap " + Namespace + "/" + Name + ")")

// Info is the record.
type Info struct {
	ID   string
	Name string
	// Init is empty in the records of clusters initialized before it was written.
	Init InitSettings
}

// InitSettings are what the first control-plane node acted on at init, and the join CA certificate (PEM)
// it was sent.
type InitSettings struct {
	KubernetesVersion    string
	ControlPlaneEndpoint string
	PodSubnet            string
	ServiceSubnet        string
	PodNetwork           string
	APIServerEndpoint    string
	JoinCACertificate    string
	// CertificateValidity is how long kubeadm's control-plane certificates last, as a Go duration; "" for
	// kubeadm's year.
	CertificateValidity string
}

// keys pairs each setting with its key in the record.
func (s *InitSettings) keys() map[string]*string {
	return map[string]*string{
		keyKubernetesVersion:    &s.KubernetesVersion,
		keyControlPlaneEndpoint: &s.ControlPlaneEndpoint,
		keyPodSubnet:            &s.PodSubnet,
		keyServiceSubnet:        &s.ServiceSubnet,
		keyPodNetwork:           &s.PodNetwork,
		keyAPIServerEndpoint:    &s.APIServerEndpoint,
		keyJoinCACertificate:    &s.JoinCACertificate,
		keyCertificateValidity:  &s.CertificateValidity,
	}
}

// Validate checks that i is a record a Berth init could have written.
func (i Info) Validate() error {
	if len(i.ID) != idLen || !isLowerHex(i.ID) {
		return fmt.Errorf("cluster ID %q is not %d lowercase hex digits", i.ID, idLen)
	}
	if err := clustername.Validate(i.Name); err != nil {
		return err
	}
	return nil
}

func isLowerHex(s string) bool {
	for _, c := range s {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// Publish writes the record. A record that exists with the same ID is kept (init may be retried after its
// result was lost); one with another ID is an error, because the API server then belongs to another cluster.
func Publish(ctx context.Context, kube kubernetes.Interface, info Info) error {
	if err := info.Validate(); err != nil {
		return fmt.Errorf("publishing the cluster record: %w", err)
	}
	cm := &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: Name, Namespace: Namespace,
			Labels: map[string]string{"app.kubernetes.io/managed-by": "berth"}},
		Data: map[string]string{keyID: info.ID, keyName: info.Name},
	}
	if info.Init != (InitSettings{}) {
		for key, v := range info.Init.keys() {
			cm.Data[key] = *v
		}
	}
	_, err := kube.CoreV1().ConfigMaps(Namespace).Create(ctx, cm, metav1.CreateOptions{})
	if !apierrors.IsAlreadyExists(err) {
		if err != nil {
			return fmt.Errorf("publishing the cluster record: %w", err)
		}
		return nil
	}
	have, err := Read(ctx, kube)
	if err != nil {
		return fmt.Errorf("publishing the cluster record: one exists: %w", err)
	}
	if have.ID != info.ID {
		return fmt.Errorf("publishing the cluster record: the API server already belongs to cluster %s", have.ID)
	}
	return nil
}

// Read returns the record; an error wrapping ErrNotFound if there is none.
func Read(ctx context.Context, kube kubernetes.Interface) (Info, error) {
	cm, err := readConfigMap(ctx, kube)
	if err != nil {
		return Info{}, err
	}
	info := Info{ID: cm.Data[keyID], Name: cm.Data[keyName]}
	for key, v := range info.Init.keys() {
		*v = cm.Data[key]
	}
	if err := info.Validate(); err != nil {
		return Info{}, fmt.Errorf("the cluster record %s/%s is damaged: %w", Namespace, Name, err)
	}
	return info, nil
}

// readConfigMap returns the record's ConfigMap; an error wrapping ErrNotFound if there is none.
func readConfigMap(ctx context.Context, kube kubernetes.Interface) (*corev1.ConfigMap, error) {
	cm, err := kube.CoreV1().ConfigMaps(Namespace).Get(ctx, Name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, ErrNotFound
	}
	if err != nil {
		return nil, fmt.Errorf("reading the cluster record: %w", err)
	}
	return cm, nil
}
