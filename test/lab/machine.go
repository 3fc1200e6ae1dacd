package lab

import (
	"context"
	"crypto/rsa"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strings"
	"syscall"
	"time"

	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/berthlabs/berth/internal/cloudinit"
	"github.com/berthlabs/berth/internal/metadata"
)

// maxNodeName keeps a node's veth name ("bl-" + name) within the kernel's 15 characters.
const maxNodeName = 15 - len(vethPrefix)

// Machine is a node to add to a lab, as a cloud is asked for an instance: a name, a role, an address, an
// image and the user-data it boots with.
type Machine struct {
	Name string
	Role metadata.Role
	// Addr is the node's address on the lab's bridge, in 10.250.0.0/24 but not the host's 10.250.0.1.
	Addr netip.Addr
	// Image is one of ImageNames.
	Image string
	// UserData is what berth_node_config renders; every node of a lab shares one, except that only
	// control-plane nodes need carry the init secret's hash.
	UserData metadata.UserData
	// CloudInit, if set, makes the machine bare metal: its agent has no metadata service, and the lab does
	// cloud-init's part with this #cloud-config (berth_node_config's cloud_init with bare_metal): it writes
	// its files and sets its hostname at every power-on. UserData is then the one it writes.
	CloudInit string
	// In an AWS lab (Config.AWS): Group is the autoscaling group of the machine's instance, its role's
	// (ControlPlaneGroup, WorkerGroup) when empty; ReportedEK, if set, is the EK that EC2 reports for the
	// instance instead of its TPM's, as for a node whose TPM is not the instance's. In a GCP lab
	// (Config.GCP) the same, with the managed instance group (ControlPlaneInstanceGroup,
	// WorkerInstanceGroup) and the EK of the instance's Shielded identity.
	Group      string
	ReportedEK *rsa.PublicKey
	// KubeBin, if set, is the directory of the machine's Kubernetes binaries in place of the lab's: an image
	// of another release, as one that rolls the cluster to a new release. Its node loads the images of its
	// release and, as an image that cannot pull carries them too, those of the lab's.
	KubeBin string
}

// AddNode adds a machine to the lab and powers it on: it lists the node in the metadata and the nodes'
// /etc/hosts, makes its namespaces, TPM and state disk, and starts swtpm, containerd and berth-agent. It
// returns once the agent runs, not when the node is Ready. Separate processes may add nodes at the same
// time. A node that fails to start stays for inspection; RemoveNode removes it.
func (l *Lab) AddNode(ctx context.Context, m Machine) (*Node, error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("adding a lab node needs root")
	}
	if m.CloudInit != "" {
		ud, err := cloudInitUserData(m.CloudInit)
		if err != nil {
			return nil, fmt.Errorf("node %s: %w", m.Name, err)
		}
		m.UserData = ud
	}
	if err := checkMachine(m, l.imageNames()); err != nil {
		return nil, fmt.Errorf("node %s: %w", m.Name, err)
	}
	n := l.newNode(m)
	if m.KubeBin != "" {
		if err := n.useKubeBin(ctx, m.KubeBin); err != nil {
			return nil, fmt.Errorf("node %s: %w", m.Name, err)
		}
	}
	switch {
	case l.cfg.AWS == nil && l.cfg.GCP == nil && (m.Group != "" || m.ReportedEK != nil):
		return nil, fmt.Errorf("node %s: an instance group and an EK reported by the cloud are for AWS and GCP labs only", m.Name)
	case l.cfg.GCP != nil && l.Compute == nil:
		return nil, fmt.Errorf("node %s: the lab's Compute endpoint runs in the process that started its host: only that process adds nodes to a GCP lab", m.Name)
	case l.cfg.GCP != nil && m.CloudInit != "":
		return nil, fmt.Errorf("node %s: a Compute Engine instance is not bare metal", m.Name)
	case l.cfg.GCP != nil:
		inst, err := newGCEInstance(m)
		if err != nil {
			return nil, fmt.Errorf("node %s: %w", m.Name, err)
		}
		n.gce, n.InstanceID = inst, inst.path()
	case l.cfg.AWS != nil && l.EC2 == nil:
		return nil, fmt.Errorf("node %s: the lab's EC2 endpoint runs in the process that started its host: only that process adds nodes to an AWS lab", m.Name)
	case l.cfg.AWS != nil && m.CloudInit != "":
		return nil, fmt.Errorf("node %s: an EC2 instance is not bare metal", m.Name)
	case l.cfg.AWS != nil:
		inst, err := newEC2Instance(m)
		if err != nil {
			return nil, fmt.Errorf("node %s: %w", m.Name, err)
		}
		n.ec2, n.InstanceID = inst, inst.ID
	}
	err := l.list(m, func() error {
		if _, err := os.Stat(n.Dir); err == nil {
			return fmt.Errorf("%s exists from an earlier node of that name (berth-lab node down --name %s removes it)", n.Dir, m.Name)
		}
		return os.MkdirAll(n.Dir, 0o700)
	})
	if err != nil {
		return nil, fmt.Errorf("node %s: %w", m.Name, err)
	}
	l.Nodes = append(l.Nodes, n)
	l.progress("%s: %s %s, image %s, listed in the metadata", n.Name, n.Role, n.Addr, n.Image)
	if err := n.create(ctx, m.UserData); err != nil {
		return n, l.nodeFailure(n, "create", err)
	}
	l.progress("%s: network namespace, cgroup, TPM manufactured, LUKS2 state image", n.Name)
	if err := n.powerOn(ctx); err != nil {
		return n, l.nodeFailure(n, "power on", err)
	}
	l.progress("%s: berth-agent boot", n.Name)
	return n, nil
}

// RemoveNode powers the node off and removes all of it: processes, network namespace and veth, cgroups,
// directory, its line in the nodes' /etc/hosts and its metadata record (with the last node, the lab's
// user-data goes too). A node that is not there is no error, and a node half removed is removed the rest
// of the way.
func (l *Lab) RemoveNode(ctx context.Context, name string) error {
	if os.Geteuid() != 0 {
		return errors.New("removing a lab node needs root")
	}
	// The name becomes a path that is removed: only a name AddNode accepts gets that far.
	if err := checkNodeName(name); err != nil {
		return err
	}
	n := l.Node(name)
	if n == nil {
		n = l.newNode(Machine{Name: name})
		if err := n.load(); err != nil {
			return err
		}
	}
	l.progress("%s: power off and remove", name)
	n.PowerOff()
	// EC2 reports a terminated instance for about an hour after.
	n.setEC2State("terminated")
	if n.gce != nil && l.Compute != nil {
		l.Compute.Remove(GCPZone, n.Name)
	}
	var errs []error
	if left := killProcesses(name, 10*time.Second); len(left) > 0 {
		errs = append(errs, fmt.Errorf("node %s: processes still alive after SIGKILL: %v", name, left))
	}
	errs = append(errs, removeNodeNetwork(ctx, name))
	if err := removeCgroups(name); err != nil {
		errs = append(errs, fmt.Errorf("node %s: cgroups: %w", name, err))
	}
	if err := os.RemoveAll(n.Dir); err != nil {
		errs = append(errs, err)
	}
	errs = append(errs, l.withLock(func() error {
		doc, err := readDocument(l.path(documentFile))
		if err != nil {
			return err
		}
		doc.Instances = slices.DeleteFunc(doc.Instances, func(i metadata.Instance) bool { return i.Name == name })
		if len(doc.Instances) == 0 {
			// No node is left to share the user-data with: the next node may be of another cluster.
			doc.UserData = metadata.UserData{}
		}
		if err := writeJSON(l.path(documentFile), doc); err != nil {
			return err
		}
		return l.writeHosts(doc)
	}))
	l.Nodes = slices.DeleteFunc(l.Nodes, func(x *Node) bool { return x.Name == name })
	return errors.Join(errs...)
}

// cloudInitUserData is the user-data a bare-metal machine's cloud-config writes for its agent.
func cloudInitUserData(doc string) (metadata.UserData, error) {
	cc, err := cloudinit.Parse(doc)
	if err != nil {
		return metadata.UserData{}, err
	}
	for _, f := range cc.WriteFiles {
		if f.Path == cloudinit.UserDataPath {
			return metadata.ParseUserData([]byte(f.Content))
		}
	}
	return metadata.UserData{}, fmt.Errorf("the cloud-config writes no %s", cloudinit.UserDataPath)
}

// checkMachine checks what a machine asks for on its own; admit checks it against the lab's other nodes. Its
// image must be one of images, or any name if images is nil.
func checkMachine(m Machine, images []string) error {
	if err := checkNodeName(m.Name); err != nil {
		return err
	}
	if !m.Role.Valid() {
		return fmt.Errorf("role %q is not %q or %q", m.Role, metadata.RoleControlPlane, metadata.RoleWorker)
	}
	a := m.Addr
	switch {
	case !a.IsValid() || !a.Is4() || !labSubnet.Contains(a):
		return fmt.Errorf("address %s is not in the lab's network %s", a, labSubnet)
	case a == hostAddr:
		return fmt.Errorf("address %s is the lab host's", a)
	case a == labSubnet.Addr() || a.As4()[3] == 255:
		return fmt.Errorf("address %s is the network's or its broadcast address", a)
	}
	switch {
	case images == nil && m.Image == "":
		return errors.New("the machine names no image")
	case images != nil && !slices.Contains(images, m.Image):
		return fmt.Errorf("image %q is not one of the lab's images (%s)", m.Image, strings.Join(images, ", "))
	}
	if err := m.UserData.Validate(); err != nil {
		return fmt.Errorf("user-data: %w", err)
	}
	return nil
}

// checkNodeName accepts what can name a Kubernetes node, a network namespace, a veth and a directory.
func checkNodeName(name string) error {
	if msgs := validation.IsDNS1123Label(name); len(msgs) > 0 {
		return fmt.Errorf("node name %q is not a DNS-1123 label: %s", name, strings.Join(msgs, "; "))
	}
	if len(name) > maxNodeName {
		return fmt.Errorf("node name %q is longer than %d characters: its veth %s%s would not fit the kernel's 15", name, maxNodeName, vethPrefix, name)
	}
	return nil
}

// list lists the machine in the metadata document and the nodes' /etc/hosts, under the lab's lock; prepare,
// if set, runs once the machine is admitted and before anything is written.
func (l *Lab) list(m Machine, prepare func() error) error {
	return l.withLock(func() error {
		doc, err := readDocument(l.path(documentFile))
		if err != nil {
			return err
		}
		if err := admit(doc, m); err != nil {
			return err
		}
		if prepare != nil {
			if err := prepare(); err != nil {
				return err
			}
		}
		if err := writeJSON(l.path(documentFile), doc); err != nil {
			return err
		}
		return l.writeHosts(doc)
	})
}

// admit adds the machine to the metadata document: its name and address must be new, and its user-data
// the lab's.
func admit(doc *metadata.Document, m Machine) error {
	for _, inst := range doc.Instances {
		if inst.Name == m.Name {
			return fmt.Errorf("the lab has a node %s already (berth-lab node down --name %s removes it)", m.Name, m.Name)
		}
		if slices.Contains(inst.Addresses, m.Addr) {
			return fmt.Errorf("address %s belongs to node %s already", m.Addr, inst.Name)
		}
	}
	ud, err := mergeUserData(doc.UserData, m.UserData)
	if err != nil {
		return err
	}
	doc.UserData = ud
	doc.Instances = append(doc.Instances, metadata.Instance{Name: m.Name, Role: m.Role, Addresses: []netip.Addr{m.Addr}, ImageID: m.Image})
	return doc.Validate()
}

// mergeUserData is the lab's one user-data after a node with next joins it. The metadata service serves
// all nodes the same, so next must equal it, except that a worker's may lack the init secret's hash (the
// lab's is kept) and the first node that has one brings it.
func mergeUserData(cur, next metadata.UserData) (metadata.UserData, error) {
	if isEmptyUserData(cur) {
		return next, nil
	}
	switch {
	case next.ClusterName != cur.ClusterName:
		return cur, fmt.Errorf("user-data names cluster %q, the lab's nodes are of cluster %q", next.ClusterName, cur.ClusterName)
	case next.JoinPort != cur.JoinPort:
		return cur, fmt.Errorf("user-data has join port %d, the lab's nodes have %d", next.JoinPort, cur.JoinPort)
	case next.JoinCAPin != cur.JoinCAPin:
		return cur, fmt.Errorf("user-data pins join CA %s, the lab's nodes pin %s", next.JoinCAPin, cur.JoinCAPin)
	case !slices.Equal(next.JoinEndpoints, cur.JoinEndpoints):
		return cur, fmt.Errorf("user-data has join endpoints %v, the lab's nodes have %v", next.JoinEndpoints, cur.JoinEndpoints)
	case next.InitSecretHash != "" && cur.InitSecretHash != "" && next.InitSecretHash != cur.InitSecretHash:
		// The hashes themselves stay out of the message: they would only help guess a weak init secret.
		return cur, errors.New("user-data has another init secret hash than the lab's nodes: they belong to another cluster's secrets")
	}
	if cur.InitSecretHash == "" {
		cur.InitSecretHash = next.InitSecretHash
	}
	return cur, nil
}

func isEmptyUserData(u metadata.UserData) bool {
	return u.ClusterName == "" && u.JoinPort == 0 && u.JoinCAPin == "" && len(u.JoinEndpoints) == 0 && u.InitSecretHash == ""
}

// readDocument reads metadata.json. A host without nodes has an empty user-data, which ParseDocument
// refuses; any other document must pass it.
func readDocument(path string) (*metadata.Document, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("reading the metadata document: %w", err)
	}
	var doc metadata.Document
	if err := json.Unmarshal(data, &doc); err == nil && len(doc.Instances) == 0 && isEmptyUserData(doc.UserData) {
		return &doc, nil
	}
	return metadata.ParseDocument(data)
}

// writeHosts writes the nodes' /etc/hosts: the host and every node.
func (l *Lab) writeHosts(doc *metadata.Document) error {
	var b strings.Builder
	fmt.Fprintf(&b, "127.0.0.1 localhost\n%s berthlab-host\n", hostAddr)
	for _, inst := range doc.Instances {
		fmt.Fprintf(&b, "%s %s\n", inst.Addresses[0], inst.Name)
	}
	// In place, not by rename: this very file is bound over every node's /etc/hosts.
	return os.WriteFile(l.path("hosts"), []byte(b.String()), 0o644)
}

// withLock runs f holding the lab's lock, which every process that changes the metadata or the hosts file
// takes.
func (l *Lab) withLock(f func() error) error {
	lock, err := os.OpenFile(l.path(lockFile), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return fmt.Errorf("lab lock: %w", err)
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return fmt.Errorf("lab lock: %w", err)
	}
	return f()
}
