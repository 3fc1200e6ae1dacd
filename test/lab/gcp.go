package lab

import (
	"cmp"
	"context"
	"crypto/rand"
	"crypto/x509"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/cloud/gcp/computeinstances"
	"github.com/berthlabs/berth/internal/cloud/gcp/computeinstances/computetest"
	"github.com/berthlabs/berth/internal/cloud/gcp/shieldedvm"
	"github.com/berthlabs/berth/internal/cloud/gcp/shieldedvm/shieldedvmtest"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/test/gcemetadatatest"
	"github.com/berthlabs/berth/test/swtpm/swtpmtest"
)

// GCPConfig makes every node of a lab a Compute Engine Shielded VM instance, as far as one machine can be
// Compute Engine:
//   - its TPM carries an EK certificate in the shape of a Compute Engine vTPM's, issued by a CA of Google's
//     shape (shieldedvmtest) that the lab makes at its start, naming the node's instance in Google's
//     instance extension;
//   - it has a GCE metadata server of its own (gcemetadatatest, served by berth-lab gce-metadata) at
//     169.254.169.254:80 inside its network namespace, serving its instance id and name, zone, project,
//     address and network, the default service account's token, and as the berth-node-config attribute
//     berth_node_config's json with the join endpoint of the first control-plane node and the node's role;
//   - its agent.yaml has gcp (the managed instance groups of both roles, the lab's Compute endpoint, the
//     lab's vTPM CA instead of Google's) instead of a metadata service, and its agent trusts that endpoint
//     by its CA (SSL_CERT_FILE); the join service calls the Compute API with the token its metadata server
//     issues, as an instance with a service account does;
//   - the lab's Compute endpoint (computetest, https on the host's side of the bridge) knows it as a running
//     instance on the lab's network, a member of its role's managed instance group (or Machine.Group), with
//     its TPM's EK as its Shielded identity (or Machine.ReportedEK).
//
// The first control-plane node is initialized as berth_cluster's gcp block does it: its TPM is trusted by
// its EK certificate chaining to the (lab's) vTPM CA and naming its instance, with no Compute API call.
//
// The Compute endpoint and the vTPM CA live in the process that started the host and end with it or with
// Lab.Close: only that process can add nodes to a GCP lab.
type GCPConfig struct{}

// Where a GCP lab's instances are, and the managed instance groups of its roles.
const (
	GCPProject                = "berth-lab"
	GCPProjectNumber          = 424242424242
	GCPZone                   = "europe-west1-b"
	GCPNetwork                = "berth-lab"
	ControlPlaneInstanceGroup = "europe-west1/berth-cp"
	WorkerInstanceGroup       = "europe-west1/berth-workers"
)

const (
	// computePort is where the lab's Compute endpoint listens on the host's address.
	computePort = 7461
	// gceMetadataAddr is the metadata server's address; every GCP node has it on its network namespace's
	// loopback.
	gceMetadataAddr = "169.254.169.254:80"
	// computeCAFile is the CA of the Compute endpoint's certificate, the agents' SSL_CERT_FILE; vtpmCAFile
	// the lab's vTPM EK CA, the agents' gcp.ekCABundle.
	computeCAFile = "compute-ca.pem"
	vtpmCAFile    = "vtpm-ca.pem"
	// gcpFile, in a node's directory, is what the node is to Compute Engine; gceMetadataFile what its
	// metadata server serves.
	gcpFile         = "gcp.json"
	gceMetadataFile = "gce-metadata.json"
	// computeToken is the access token every node's metadata server issues and the Compute endpoint takes.
	computeToken = "ya29.berthlab-compute"
)

// instanceGroupOf is the managed instance group of a role's nodes.
func instanceGroupOf(role metadata.Role) string {
	if role == metadata.RoleControlPlane {
		return ControlPlaneInstanceGroup
	}
	return WorkerInstanceGroup
}

// gceInstance is what a GCP lab's node is to Compute Engine (gcp.json in its directory).
type gceInstance struct {
	ID    uint64 `json:"id"`
	Group string `json:"instanceGroup"`
	// EK is the DER SubjectPublicKeyInfo of the EK of the node's TPM, read at its first power-on, when its
	// certificate is written.
	EK []byte `json:"ek,omitempty"`
	// ReportedEK, if set, is what the Compute API reports for the instance instead of EK (Machine.ReportedEK).
	ReportedEK []byte `json:"reportedEK,omitempty"`
}

// path is the instance as the join service's records and berth_cluster's gcp block name it.
func (g *gceInstance) path() string { return computeinstances.InstanceID(GCPProject, GCPZone, g.ID) }

// newGCEInstance is the instance of a machine added to a GCP lab.
func newGCEInstance(m Machine) (*gceInstance, error) {
	b := make([]byte, 8)
	rand.Read(b)
	// Compute Engine's instance ids are 19 or 20 digits; the top bit set keeps them 19 digits or more.
	inst := &gceInstance{ID: binary.BigEndian.Uint64(b) | 1<<63, Group: cmp.Or(m.Group, instanceGroupOf(m.Role))}
	if m.ReportedEK != nil {
		der, err := x509.MarshalPKIXPublicKey(m.ReportedEK)
		if err != nil {
			return nil, err
		}
		inst.ReportedEK = der
	}
	return inst, nil
}

// startCompute serves the lab's Compute endpoint on the host's side of the bridge, over TLS, makes the lab's
// vTPM CA, and writes both CAs.
func (l *Lab) startCompute() error {
	srv, err := computetest.Start(computetest.Options{Addr: net.JoinHostPort(hostAddr.String(), strconv.Itoa(computePort)),
		TLS: true, Project: GCPProject, Token: computeToken})
	if err != nil {
		return fmt.Errorf("Compute endpoint: %w", err)
	}
	l.Compute = srv
	for _, key := range []string{ControlPlaneInstanceGroup, WorkerInstanceGroup} {
		if err := srv.PutGroup(computetest.Group{Key: key}); err != nil {
			return err
		}
	}
	if l.vtpmCA, err = shieldedvmtest.NewCA(); err != nil {
		return err
	}
	l.progress("Compute endpoint %s (project %s, network %s) and the vTPM CA", srv.URL, GCPProject, GCPNetwork)
	if err := os.WriteFile(l.path(computeCAFile), srv.CACertPEM, 0o644); err != nil {
		return err
	}
	return os.WriteFile(l.path(vtpmCAFile), l.vtpmCA.PEM(), 0o644)
}

// vtpmTrust is how berth_cluster's gcp block trusts the first control-plane node's TPM: by its EK
// certificate, which must chain to the vTPM CA (the lab's, in Google's stead) and name its instance.
func (l *Lab) vtpmTrust() (attest.EKTrust, error) {
	if l.vtpmCA == nil {
		return nil, errors.New("the lab's vTPM CA lives only in the process that started the lab's host")
	}
	roots, inters := l.vtpmCA.Pools()
	return shieldedvm.NewTrust(roots, inters, nil, nil), nil
}

// createGCP gives a new GCP node the metadata server's address on its loopback and writes what its
// metadata server serves (with userData, the machine's) and gcp.json.
func (n *Node) createGCP(ctx context.Context, userData metadata.UserData) error {
	host, _, _ := net.SplitHostPort(gceMetadataAddr)
	if _, err := run(ctx, "ip", "-n", netnsPrefix+n.Name, "addr", "add", host+"/32", "dev", "lo"); err != nil {
		return err
	}
	userData.Role = n.Role
	ud, err := json.Marshal(userData)
	if err != nil {
		return err
	}
	if err := writeJSON(n.path(gceMetadataFile), gcemetadatatest.Instance{
		ID: n.gce.ID, Name: n.Name, Zone: GCPZone, ProjectID: GCPProject, ProjectNumber: GCPProjectNumber,
		IP: n.Addr.String(), Network: GCPNetwork, Image: "projects/" + GCPProject + "/global/images/" + n.Image,
		NodeConfig: ud, Token: computeToken, TokenLifetime: time.Hour,
	}); err != nil {
		return err
	}
	return writeJSON(n.path(gcpFile), n.gce)
}

// loadGCP reads gcp.json, if the node has one.
func (n *Node) loadGCP() error {
	data, err := os.ReadFile(n.path(gcpFile))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var inst gceInstance
	if err := json.Unmarshal(data, &inst); err != nil {
		return fmt.Errorf("reading %s: %w", n.path(gcpFile), err)
	}
	n.gce, n.InstanceID = &inst, inst.path()
	return nil
}

// powerOnGCP does, at a GCP node's power-on, what Compute Engine does around an instance: at the first,
// its vTPM gets its EK certificate; at each, its metadata server serves, and the Compute endpoint (in the
// process that has it) knows the instance as a member of its group, with its TPM's EK as its identity.
func (n *Node) powerOnGCP(ctx context.Context) error {
	l := n.lab
	if n.gce.EK == nil {
		if l.vtpmCA == nil {
			return errors.New("the lab's vTPM CA lives only in the process that started the lab's host")
		}
		if err := n.certifyVTPM(); err != nil {
			return fmt.Errorf("certifying the EK of %s's TPM: %w", n.Name, err)
		}
		if err := writeJSON(n.path(gcpFile), n.gce); err != nil {
			return err
		}
	}
	if l.Compute != nil {
		ek := n.gce.EK
		if n.gce.ReportedEK != nil {
			ek = n.gce.ReportedEK
		}
		pub, err := x509.ParsePKIXPublicKey(ek)
		if err != nil {
			return err
		}
		ekPEM, err := computetest.PublicKeyPEM(pub)
		if err != nil {
			return err
		}
		if err := l.Compute.Put(computetest.Instance{Name: n.Name, Zone: GCPZone, ID: n.gce.ID,
			NICs: []computetest.NIC{{Network: GCPNetwork, IP: n.Addr}}, Group: n.gce.Group,
			Identity: &computetest.ShieldedIdentity{EKPub: ekPEM}}); err != nil {
			return err
		}
	}
	args := []string{l.cfg.LabBinary, "gce-metadata", "--config", n.path(gceMetadataFile), "--listen", gceMetadataAddr}
	if _, _, err := n.startCmdEnv("gce-metadata", nil, args...); err != nil {
		return err
	}
	return n.waitListening(ctx, "metadata server", gceMetadataAddr, "gce-metadata")
}

// certifyVTPM reads the EK of the node's TPM and writes its certificate from the lab's vTPM CA, naming
// the node's instance, as Compute Engine does for a Shielded VM's vTPM.
func (n *Node) certifyVTPM() error {
	ek, err := readEK("unix:" + n.path("tpm/tpm.sock"))
	if err != nil {
		return err
	}
	pub, err := x509.ParsePKIXPublicKey(ek)
	if err != nil {
		return err
	}
	cert, err := n.lab.vtpmCA.IssueEK(pub, shieldedvm.InstanceInfo{Zone: GCPZone, ProjectNumber: GCPProjectNumber,
		ProjectID: GCPProject, InstanceID: n.gce.ID, InstanceName: n.Name})
	if err != nil {
		return err
	}
	conn, err := net.Dial("unix", n.path("tpm/tpm.sock"))
	if err != nil {
		return err
	}
	defer conn.Close()
	if err := swtpmtest.WriteEKCertificate(conn, cert.Raw); err != nil {
		return err
	}
	n.gce.EK = ek
	return nil
}

// gcpAgentConfig is agent.yaml's gcp for every GCP node: the groups of both roles, the lab's Compute
// endpoint and vTPM CA; project and network come from the metadata server.
func (n *Node) gcpAgentConfig() map[string]any {
	return map[string]any{
		"instanceGroups":  map[string]metadata.Role{ControlPlaneInstanceGroup: metadata.RoleControlPlane, WorkerInstanceGroup: metadata.RoleWorker},
		"computeEndpoint": "https://" + net.JoinHostPort(hostAddr.String(), strconv.Itoa(computePort)),
		"ekCABundle":      n.lab.path(vtpmCAFile),
	}
}

// gcpAgentEnv is the environment of a GCP node's agent: the host's without Google's settings, and the
// Compute endpoint's CA as the one CA the agent's TLS trusts by default (the join service's and the
// cluster's connections pin their own).
func (n *Node) gcpAgentEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "GCE_") && !strings.HasPrefix(kv, "GOOGLE_") && !strings.HasPrefix(kv, "SSL_CERT_") {
			env = append(env, kv)
		}
	}
	return append(env, "SSL_CERT_FILE="+n.lab.path(computeCAFile))
}
