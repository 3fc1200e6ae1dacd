package joinservice

import (
	"context"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
)

// NodeRecords keeps, from a watch, the names of the join service's records of each node: its bootstrap token
// Secrets and its disk-record ConfigMaps. Every ticket removes its node's earlier records; asking the API
// server which those are would take two of a ticket's four requests, each a list that the API server answers
// by filtering every record of the cluster, so a storm's cost would grow with the square of its size.
//
// The watch may lag the API server by moments, and by seconds while it reconnects after the API server
// restarted: a record it has not seen yet is removed at that node's next ticket (a token expires anyway, and
// the disk-record sweep removes a gone instance's records). Only names and
// labels are kept, not the tokens or disk owners.
type NodeRecords struct {
	secrets, configMaps cache.SharedIndexInformer
}

const byInstance = "instance"

// WatchNodeRecords watches the disk records, and with tokens the bootstrap tokens, until ctx ends: a service
// that issues no tokens may not be allowed to read Secrets. Until the watch has listed the records once,
// KubeTokens and KubeDisks ask the API server instead.
func WatchNodeRecords(ctx context.Context, client kubernetes.Interface, tokens bool) (*NodeRecords, error) {
	f := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithNamespace(Namespace),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = instanceLabel }))
	r := &NodeRecords{configMaps: f.Core().V1().ConfigMaps().Informer()}
	watched := []cache.SharedIndexInformer{r.configMaps}
	if tokens {
		r.secrets = f.Core().V1().Secrets().Informer()
		watched = append(watched, r.secrets)
	}
	for _, inf := range watched {
		if err := inf.AddIndexers(cache.Indexers{byInstance: instanceIndex}); err != nil {
			return nil, err
		}
		if err := inf.SetTransform(namesOnly); err != nil {
			return nil, err
		}
	}
	f.Start(ctx.Done())
	return r, nil
}

func instanceIndex(obj any) ([]string, error) {
	m, err := meta.Accessor(obj)
	if err != nil {
		return nil, err
	}
	if v, ok := m.GetLabels()[instanceLabel]; ok {
		return []string{v}, nil
	}
	return nil, nil
}

// namesOnly drops what the records hold (a token's secret, a disk's owner): the index needs names and labels.
func namesOnly(obj any) (any, error) {
	switch o := obj.(type) {
	case *corev1.Secret:
		return &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: o.Name, Namespace: o.Namespace, Labels: o.Labels, ResourceVersion: o.ResourceVersion}}, nil
	case *corev1.ConfigMap:
		return &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: o.Name, Namespace: o.Namespace, Labels: o.Labels, ResourceVersion: o.ResourceVersion}}, nil
	}
	return obj, nil
}

// names are the records inf holds for node; ok is false until the watch has listed them once, or if r or
// the informer is nil.
func (r *NodeRecords) names(informer func(*NodeRecords) cache.SharedIndexInformer, node string) (names []string, ok bool) {
	if r == nil {
		return nil, false
	}
	inf := informer(r)
	if inf == nil || !inf.HasSynced() {
		return nil, false
	}
	objs, err := inf.GetIndexer().ByIndex(byInstance, instanceLabels(node)[instanceLabel])
	if err != nil {
		return nil, false
	}
	for _, o := range objs {
		if m, err := meta.Accessor(o); err == nil {
			names = append(names, m.GetName())
		}
	}
	return names, true
}

func secretsOf(r *NodeRecords) cache.SharedIndexInformer    { return r.secrets }
func configMapsOf(r *NodeRecords) cache.SharedIndexInformer { return r.configMaps }
