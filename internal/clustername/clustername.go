// Package clustername is the one rule for a Berth cluster's name. The name becomes kubeadm's clusterName,
// the user-data's clusterName and the cluster record's name, so the provider, the init server, the metadata
// reader, the cluster record and kubeadm's configuration must agree on it exactly: a name one of them
// accepts and another refuses would fail an init after the first node exists.
package clustername

import (
	"errors"
	"fmt"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"
)

// Validate says why name cannot name a cluster: it must be a DNS-1123 label (lowercase letters, digits and
// '-', at most 63 characters), which also makes it a valid kubeconfig context and kubeadm cluster name.
func Validate(name string) error {
	if name == "" {
		return errors.New("cluster name is empty")
	}
	if msgs := validation.IsDNS1123Label(name); len(msgs) > 0 {
		return fmt.Errorf("cluster name %q is not a DNS-1123 label: %s", name, strings.Join(msgs, "; "))
	}
	return nil
}
