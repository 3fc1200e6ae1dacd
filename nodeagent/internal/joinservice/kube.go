package joinservice

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	bootstrapapi "k8s.io/cluster-bootstrap/token/api"
	bootstraputil "k8s.io/cluster-bootstrap/token/util"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/diskrecord"
	"github.com/berthlabs/berth/internal/metadata"
)

// Namespace holds the objects the join service writes: where kubeadm keeps its bootstrap tokens.
const Namespace = metav1.NamespaceSystem

// nodeBootstrapGroup is kubeadm's group for joining nodes; its RBAC lets them create CSRs and read cluster-info.
const nodeBootstrapGroup = "system:bootstrappers:kubeadm:default-node-token"

// KubeTokens issues kubeadm bootstrap tokens as Secrets, the way `kubeadm token create` does.
type KubeTokens struct {
	Client kubernetes.Interface
	Clock  func() time.Time
	// Records, if set, says which earlier tokens a node has, instead of a list request per token.
	Records *NodeRecords
}

// Issue creates a token for node that expires after ttl (the token controller deletes it then), and deletes
// the node's earlier tokens.
func (k *KubeTokens) Issue(ctx context.Context, ttl time.Duration, node string) (string, time.Time, error) {
	token, err := bootstraputil.GenerateBootstrapToken()
	if err != nil {
		return "", time.Time{}, err
	}
	id, secret, _ := strings.Cut(token, ".")
	now := time.Now
	if k.Clock != nil {
		now = k.Clock
	}
	expires := now().Add(ttl).UTC().Truncate(time.Second)
	s := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: bootstraputil.BootstrapTokenSecretName(id), Namespace: Namespace,
			Labels: instanceLabels(node), Annotations: map[string]string{instanceNameAnnotation: node}},
		Type: bootstrapapi.SecretTypeBootstrapToken,
		StringData: map[string]string{
			bootstrapapi.BootstrapTokenIDKey:               id,
			bootstrapapi.BootstrapTokenSecretKey:           secret,
			bootstrapapi.BootstrapTokenDescriptionKey:      "issued by the Berth join service with a join ticket",
			bootstrapapi.BootstrapTokenExpirationKey:       expires.Format(time.RFC3339),
			bootstrapapi.BootstrapTokenUsageAuthentication: "true",
			bootstrapapi.BootstrapTokenUsageSigningKey:     "true",
			bootstrapapi.BootstrapTokenExtraGroupsKey:      nodeBootstrapGroup,
		},
	}
	created, err := k.Client.CoreV1().Secrets(Namespace).Create(ctx, s, metav1.CreateOptions{})
	if err != nil {
		return "", time.Time{}, fmt.Errorf("creating bootstrap token secret: %w", err)
	}
	// A token left behind lives until it expires; the ticket goes out either way.
	older, err := recordsOf(ctx, k.Records, secretsOf, node, func(ctx context.Context) ([]string, error) {
		list, err := k.Client.CoreV1().Secrets(Namespace).List(ctx, instanceSelector(node))
		if err != nil {
			return nil, err
		}
		return objectNames(list.Items), nil
	})
	if err == nil {
		for _, name := range older {
			if name != created.Name {
				k.Client.CoreV1().Secrets(Namespace).Delete(ctx, name, metav1.DeleteOptions{})
			}
		}
	}
	return token, expires, nil
}

// recordsOf names node's records: from the watch in records when it has listed them, else from list.
func recordsOf(ctx context.Context, records *NodeRecords, inf func(*NodeRecords) cache.SharedIndexInformer, node string,
	list func(context.Context) ([]string, error)) ([]string, error) {
	if names, ok := records.names(inf, node); ok {
		return names, nil
	}
	return list(ctx)
}

func objectNames[T any, PT interface {
	*T
	GetName() string
}](items []T) []string {
	names := make([]string, len(items))
	for i := range items {
		names[i] = PT(&items[i]).GetName()
	}
	return names
}

// KubeDisks records disk owners as one ConfigMap per disk. Create is atomic in the API server, so two
// TPMs racing for one disk cannot both win.
type KubeDisks struct {
	Client kubernetes.Interface
	// Records, if set, says which other disks a node has, instead of a list request per claim.
	Records *NodeRecords
}

const diskOwnerKey = "ek-sha256"

// The records of a node: its disks and its bootstrap tokens. Node names may be longer than a label value,
// so the label holds a hash; the annotation the name.
const (
	instanceLabel               = "berth.dev/instance"
	instanceNameAnnotation      = diskrecord.InstanceNameAnnotation
	instanceAddressesAnnotation = "berth.dev/instance-addresses"
	absentSinceAnnotation       = "berth.dev/instance-absent-since"
)

func instanceLabels(node string) map[string]string {
	sum := sha256.Sum256([]byte(node))
	return map[string]string{instanceLabel: hex.EncodeToString(sum[:16])}
}

func instanceSelector(node string) metav1.ListOptions {
	return metav1.ListOptions{LabelSelector: instanceLabel + "=" + instanceLabels(node)[instanceLabel]}
}

// Claim implements DiskRegistry.
func (k *KubeDisks) Claim(ctx context.Context, disk, ek string, inst *metadata.Instance) error {
	addrs := make([]string, len(inst.Addresses))
	for i, a := range inst.Addresses {
		addrs[i] = a.String()
	}
	labels := instanceLabels(inst.Name)
	labels[diskrecord.ManagedByLabel] = diskrecord.ManagedBy
	cm := &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{
			Name: diskrecord.Name(disk), Namespace: Namespace, Labels: labels,
			Annotations: map[string]string{instanceNameAnnotation: inst.Name, instanceAddressesAnnotation: strings.Join(addrs, ",")},
		},
		Data: map[string]string{diskOwnerKey: ek},
	}
	_, err := k.Client.CoreV1().ConfigMaps(Namespace).Create(ctx, cm, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		owner, err := k.Owner(ctx, disk)
		if err != nil {
			return err
		}
		if owner != ek {
			return ErrDiskOwnedByOther
		}
	} else if err != nil {
		return fmt.Errorf("recording owner of disk %s: %w", disk, err)
	}
	return k.forgetOtherDisks(ctx, inst.Name, diskrecord.Name(disk))
}

// forgetOtherDisks removes the records of node's disks other than keep.
func (k *KubeDisks) forgetOtherDisks(ctx context.Context, node, keep string) error {
	records, err := recordsOf(ctx, k.Records, configMapsOf, node, func(ctx context.Context) ([]string, error) {
		list, err := k.Client.CoreV1().ConfigMaps(Namespace).List(ctx, instanceSelector(node))
		if err != nil {
			return nil, err
		}
		return objectNames(list.Items), nil
	})
	if err != nil {
		return fmt.Errorf("listing the disk records of %s: %w", node, err)
	}
	for _, name := range records {
		if name == keep || !strings.HasPrefix(name, diskrecord.Prefix) {
			continue
		}
		err := k.Client.CoreV1().ConfigMaps(Namespace).Delete(ctx, name, metav1.DeleteOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("removing the record of %s's earlier disk %s: %w", node, strings.TrimPrefix(name, diskrecord.Prefix), err)
		}
	}
	return nil
}

// Owner implements DiskRegistry.
func (k *KubeDisks) Owner(ctx context.Context, disk string) (string, error) {
	cm, err := k.Client.CoreV1().ConfigMaps(Namespace).Get(ctx, diskrecord.Name(disk), metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return "", ErrDiskUnknown
	}
	if err != nil {
		return "", fmt.Errorf("reading owner of disk %s: %w", disk, err)
	}
	return cm.Data[diskOwnerKey], nil
}

// controlPlaneFiles are what kubeadm join --control-plane expects to find already in place: the CAs
// shared by all control-plane nodes and the service-account key pair.
var controlPlaneFiles = []string{
	"ca.crt", "ca.key", "sa.key", "sa.pub", "front-proxy-ca.crt", "front-proxy-ca.key", "etcd/ca.crt", "etcd/ca.key",
}

// PKIFiles reads the control-plane files from a kubeadm certificates directory.
func PKIFiles(dir string) func() ([]*berthv1.File, error) {
	return func() ([]*berthv1.File, error) {
		files := make([]*berthv1.File, 0, len(controlPlaneFiles))
		for _, name := range controlPlaneFiles {
			content, err := os.ReadFile(filepath.Join(dir, name))
			if err != nil {
				return nil, err
			}
			mode := uint32(0o644)
			if strings.HasSuffix(name, ".key") {
				mode = 0o600
			}
			files = append(files, &berthv1.File{Path: name, Content: content, Mode: mode})
		}
		return files, nil
	}
}

// BootstrapAutoApproveBinding is the ClusterRoleBinding `kubeadm init` makes (phase bootstrap-token) so
// that kube-controller-manager approves every node client CSR a bootstrap token's holder sends.
const BootstrapAutoApproveBinding = "kubeadm:node-autoapprove-bootstrap"

// RemoveBootstrapAutoApproval deletes BootstrapAutoApproveBinding and reports whether it existed. Its
// approver checks only that a CSR asks for a system:node: name, so anyone holding a bootstrap token (root on
// a joined worker, whose ticket carried one) could get a client certificate for any node's name, a
// control-plane node's included, past every check of the join service. Berth's nodes never use it: the
// join service signs their first certificate, and their renewals go through kubeadm's other binding (a
// node may renew its own certificate: kubeadm:node-autoapprove-certificate-rotation), which stays. kubeadm
// makes the binding again on `kubeadm init` and `kubeadm upgrade apply`; every join service removes it
// when it starts.
func RemoveBootstrapAutoApproval(ctx context.Context, kube kubernetes.Interface) (bool, error) {
	err := kube.RbacV1().ClusterRoleBindings().Delete(ctx, BootstrapAutoApproveBinding, metav1.DeleteOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("removing the ClusterRoleBinding %s: %w", BootstrapAutoApproveBinding, err)
	}
	return true, nil
}
