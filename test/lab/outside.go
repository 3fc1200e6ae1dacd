package lab

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/policy"
)

// What a machine the lab does not run itself needs to be one of its nodes: a virtual machine booted from a
// baked image, with a network card on the lab's bridge (test/labvm), is a node like the others once the lab
// lists it, its TPM carries an EK certificate of the lab's EK CA and the join policy names its image.

const (
	// Bridge is the lab's bridge.
	Bridge = bridgeName
	// CNIBinDir is where the lab's cluster installs Flannel's CNI plugin on every node, and so where the
	// containerd of a machine that joins it must find its CNI plugins.
	CNIBinDir = cniBinDir
)

var (
	// HostAddr is the host's address on the lab's bridge: the nodes' gateway.
	HostAddr = hostAddr
	// MetadataURL is the lab's instance-metadata service, which the agents of the lab's nodes read.
	MetadataURL = "http://" + metaAddr
)

// ListMachine lists a machine that runs outside the lab, such as a virtual machine on its bridge, in the
// metadata and the nodes' /etc/hosts, as AddNode lists its own nodes; its image may be any the join policy
// names. An empty UserData is the cluster's, in the process that brought the lab up.
func (l *Lab) ListMachine(m Machine) error {
	if isEmptyUserData(m.UserData) {
		m.UserData = l.userData
	}
	if err := checkMachine(m, nil); err != nil {
		return fmt.Errorf("machine %s: %w", m.Name, err)
	}
	if err := l.list(m, nil); err != nil {
		return fmt.Errorf("machine %s: %w", m.Name, err)
	}
	l.progress("%s: %s %s, image %s, listed in the metadata (a machine outside the lab)", m.Name, m.Role, m.Addr, m.Image)
	return nil
}

// ManufactureTPM makes a TPM state in dir as the lab's nodes have: an EK with a certificate the lab's EK CA
// issued.
func (l *Lab) ManufactureTPM(dir string) error {
	return l.ekCA.Manufacture(dir)
}

// NodeImageArchives are the docker-archive tars of the container images every lab node loads (pause,
// kube-proxy, CoreDNS, Flannel and the test workloads) but those named in except: what an image baked for the
// lab carries.
func (l *Lab) NodeImageArchives(except ...string) []string {
	var paths []string
	for _, img := range l.images.Node {
		if !slices.Contains(except, img.Name) {
			paths = append(paths, img.Path)
		}
	}
	return paths
}

// SetPolicy writes the join policy ConfigMap, as berth_join_policy does.
func (l *Lab) SetPolicy(ctx context.Context, p *policy.Policy) error {
	doc, err := p.Marshal()
	if err != nil {
		return err
	}
	cm, err := json.Marshal(map[string]any{
		"apiVersion": "v1", "kind": "ConfigMap",
		"metadata": map[string]any{"name": "berth-join-policy", "namespace": "kube-system"},
		"data":     map[string]string{policy.ConfigMapKey: string(doc)},
	})
	if err != nil {
		return err
	}
	if _, err := l.kubectlStdin(ctx, string(cm), "apply", "-f", "-"); err != nil {
		return fmt.Errorf("writing the join policy: %w", err)
	}
	return nil
}

// AgentLog is the file the node's agent logs to; on a control-plane node, its join service's refusals.
func (n *Node) AgentLog() string { return n.path("logs/agent.log") }

// LabImage is the policy's entry for one of the lab's own images (ImageNames): its predicted PCRs, for both
// roles.
func LabImage(name string) policy.Image {
	return policy.Image{Name: name, PCRs: PredictedPCRs(name), Roles: []metadata.Role{metadata.RoleControlPlane, metadata.RoleWorker}}
}
