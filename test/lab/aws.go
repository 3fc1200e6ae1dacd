package lab

import (
	"cmp"
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/http"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/ec2"

	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/cloud/aws/ec2instances"
	"github.com/berthlabs/berth/internal/cloud/aws/ec2instances/ec2test"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/test/imdstest"
)

// AWSConfig makes every node of a lab an EC2 instance, as far as one machine can be EC2:
//   - its TPM has an RSA EK and no EK certificate, as a NitroTPM;
//   - it has an IMDS of its own, AWS's amazon-ec2-metadata-mock, at 169.254.169.254:80 inside its network
//     namespace, with IMDSv2 required, serving its instance id, its name as local-hostname, its lab
//     address as local-ipv4, an AMI id for its image, the lab's region and VPC, instance-profile
//     credentials of its own, and as user-data berth_node_config's json with the join endpoint of the
//     first control-plane node and the node's role;
//   - its agent.yaml has aws (the autoscaling groups of both roles, the lab's EC2 endpoint) instead of a
//     metadata service, and its agent trusts that endpoint by its CA (AWS_CA_BUNDLE); the AWS SDK takes the
//     credentials from IMDS, as on an instance with an instance profile;
//   - the lab's EC2 endpoint (ec2test, https on the host's side of the bridge) knows it as a running
//     instance of the lab's VPC: its id, address, PrivateDnsName (its name), the tag
//     aws:autoscaling:groupName of its role's group (or Machine.Group), and its TPM's EK, read from the
//     TPM before its agent first starts (or Machine.ReportedEK).
//
// The first control-plane node is initialized as berth_cluster's aws block does it: its TPM is trusted by
// the EK that EC2 reports for its instance.
//
// The EC2 endpoint runs inside the process that started the host (Lab.EC2) and ends with it or with
// Lab.Close: only that process can add nodes to an AWS lab.
type AWSConfig struct {
	// IMDSMock is the ec2-metadata-mock binary (scripts/build-imds-mock.sh builds it; imdstest.Binary).
	IMDSMock string `json:"imdsMock"`
	// CloudControllerManager, if set, is the AWS cloud controller manager's binary
	// (scripts/build-aws-ccm.sh builds it): the nodes' kubelets run with --cloud-provider=external and their
	// provider IDs, and every control-plane node runs the controller manager once the cluster exists, as
	// the guides' DaemonSet does, against the lab's EC2 endpoint with its instance profile's credentials.
	CloudControllerManager string `json:"cloudControllerManager,omitempty"`
}

// Where an AWS lab's instances are, and the autoscaling groups of its roles. The nodes read the region and
// the VPC from their IMDS; their agents map the groups back to roles.
const (
	AWSRegion         = "us-east-1"  // ec2test's region
	AWSZone           = "us-east-1a" // every instance's availability zone
	AWSVPC            = "vpc-0be27c1a5b1ab0001"
	ControlPlaneGroup = "berth-cp"
	WorkerGroup       = "berth-workers"
)

const (
	// ec2Port is where the lab's EC2 endpoint listens on the host's address.
	ec2Port = 7460
	// imdsAddr is IMDS's address; every AWS node has it on its network namespace's loopback.
	imdsAddr = "169.254.169.254"
	imdsPort = 80
	// ec2CAFile is the CA of the EC2 endpoint's certificate, the agents' AWS_CA_BUNDLE.
	ec2CAFile = "ec2-ca.pem"
	// awsFile, in a node's directory, is what the node is to EC2.
	awsFile = "aws.json"
	// operatorKeyID is the access key the lab's init signs its EC2 calls with, as terraform's with the
	// operator's credentials; nodes sign with their instance profile's (instanceKeyID).
	operatorKeyID = "AKIABERTHLABOPERATOR"
)

// groupOf is the autoscaling group of a role's nodes.
func groupOf(role metadata.Role) string {
	if role == metadata.RoleControlPlane {
		return ControlPlaneGroup
	}
	return WorkerGroup
}

// ec2Instance is what an AWS lab's node is to EC2 (aws.json in its directory).
type ec2Instance struct {
	ID    string `json:"instanceID"`
	Group string `json:"autoscalingGroup"`
	// EK is the DER SubjectPublicKeyInfo of the EK of the node's TPM, read at its first power-on.
	EK []byte `json:"ek,omitempty"`
	// ReportedEK, if set, is what EC2 reports for the instance instead of EK (Machine.ReportedEK).
	ReportedEK []byte `json:"reportedEK,omitempty"`
}

// newInstanceID is an EC2 instance id: i- and 17 hex digits.
func newInstanceID() string {
	b := make([]byte, 9)
	rand.Read(b)
	return "i-" + hex.EncodeToString(b)[:17]
}

// amiID is the AMI id the lab gives an image: a stable ami- and 17 hex digits of its name.
func amiID(image string) string {
	sum := sha256.Sum256([]byte(image))
	return "ami-" + hex.EncodeToString(sum[:])[:17]
}

// instanceKeyID is the access key of the instance profile credentials an instance's IMDS serves.
func instanceKeyID(instanceID string) string {
	return "ASIA" + strings.ToUpper(strings.TrimPrefix(instanceID, "i-")[:16])
}

// startEC2 serves the lab's EC2 endpoint on the host's side of the bridge, over TLS, and writes its CA.
func (l *Lab) startEC2() error {
	srv, err := ec2test.Start(ec2test.Options{Addr: net.JoinHostPort(hostAddr.String(), strconv.Itoa(ec2Port)), TLS: true})
	if err != nil {
		return fmt.Errorf("EC2 endpoint: %w", err)
	}
	l.EC2 = srv
	l.progress("EC2 endpoint %s (region %s, VPC %s)", srv.URL, AWSRegion, AWSVPC)
	return os.WriteFile(l.path(ec2CAFile), srv.CACertPEM, 0o644)
}

// Close stops what the lab runs inside this process: an AWS lab's EC2 endpoint, a GCP lab's Compute
// endpoint. Down stops everything else.
func (l *Lab) Close() {
	if l.EC2 != nil {
		l.EC2.Close()
	}
	if l.Compute != nil {
		l.Compute.Close()
	}
}

// ec2API is an EC2 client for the lab's endpoint with an operator's credentials, as terraform has.
func (l *Lab) ec2API() (*ec2.Client, error) {
	if l.EC2 == nil {
		return nil, errors.New("the lab's EC2 endpoint runs only in the process that started the lab's host")
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(l.EC2.CACertPEM) {
		return nil, errors.New("the EC2 endpoint's CA is not PEM")
	}
	return ec2.NewFromConfig(aws.Config{
		Region:      AWSRegion,
		Credentials: credentials.NewStaticCredentialsProvider(operatorKeyID, "berthlab-operator-secret", ""),
		HTTPClient:  &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}},
	}, ec2instances.GuardBodies, func(o *ec2.Options) { o.BaseEndpoint = aws.String(l.EC2.URL) }), nil
}

// cloudEKTrust is how berth_cluster's aws block trusts the first control-plane node's TPM: by the EK EC2
// reports for its instance.
func (l *Lab) cloudEKTrust() (attest.EKTrust, error) {
	api, err := l.ec2API()
	if err != nil {
		return nil, err
	}
	return attest.CloudEK{Cloud: "EC2", Source: ec2instances.NewEKs(api, nil)}, nil
}

// newEC2Instance is the instance of a machine added to an AWS lab.
func newEC2Instance(m Machine) (*ec2Instance, error) {
	inst := &ec2Instance{ID: newInstanceID(), Group: cmp.Or(m.Group, groupOf(m.Role))}
	if m.ReportedEK != nil {
		der, err := x509.MarshalPKIXPublicKey(m.ReportedEK)
		if err != nil {
			return nil, err
		}
		inst.ReportedEK = der
	}
	return inst, nil
}

// createAWS gives a new AWS node IMDS's address on its loopback and writes its IMDS's configuration (with
// userData, the machine's) and aws.json.
func (n *Node) createAWS(ctx context.Context, userData metadata.UserData) error {
	if _, err := run(ctx, "ip", "-n", netnsPrefix+n.Name, "addr", "add", imdsAddr+"/32", "dev", "lo"); err != nil {
		return err
	}
	userData.Role = n.Role
	ud, err := json.Marshal(userData)
	if err != nil {
		return err
	}
	secret := make([]byte, 20)
	rand.Read(secret)
	config, err := imdstest.MockConfig(imdstest.Config{
		InstanceID: n.ec2.ID, LocalHostname: n.Name, LocalIPv4: n.Addr.String(), AMIID: amiID(n.Image),
		Region: AWSRegion, AvailabilityZone: AWSZone, VPCID: AWSVPC, UserData: ud,
		Credentials: &imdstest.Credentials{AccessKeyID: instanceKeyID(n.ec2.ID), SecretAccessKey: hex.EncodeToString(secret),
			Token: "berthlab-session-" + n.ec2.ID, Expiration: time.Now().Add(7 * 24 * time.Hour)},
	})
	if err != nil {
		return err
	}
	for _, d := range []string{"imds", "aws"} {
		if err := os.MkdirAll(n.path(d), 0o700); err != nil {
			return err
		}
	}
	// The agent's AWS SDK reads these instead of root's ~/.aws: empty, so its credentials come from IMDS.
	for _, f := range []string{"aws/config", "aws/credentials"} {
		if err := os.WriteFile(n.path(f), nil, 0o600); err != nil {
			return err
		}
	}
	if err := os.WriteFile(n.path("imds/aemm-config.json"), config, 0o600); err != nil {
		return err
	}
	return writeJSON(n.path(awsFile), n.ec2)
}

// loadAWS reads aws.json, if the node has one.
func (n *Node) loadAWS() error {
	data, err := os.ReadFile(n.path(awsFile))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var inst ec2Instance
	if err := json.Unmarshal(data, &inst); err != nil {
		return fmt.Errorf("reading %s: %w", n.path(awsFile), err)
	}
	n.ec2, n.InstanceID = &inst, inst.ID
	return nil
}

// powerOnAWS does, at an AWS node's power-on, what EC2 does around an instance: its IMDS serves, and the
// EC2 endpoint (in the process that has it) knows the instance, with the EK of its TPM, which swtpm serves
// already.
func (n *Node) powerOnAWS(ctx context.Context) error {
	if n.ec2.EK == nil {
		ek, err := readEK("unix:" + n.path("tpm/tpm.sock"))
		if err != nil {
			return fmt.Errorf("reading the EK of %s's TPM: %w", n.Name, err)
		}
		n.ec2.EK = ek
		if err := writeJSON(n.path(awsFile), n.ec2); err != nil {
			return err
		}
	}
	if l := n.lab; l.EC2 != nil {
		ek := n.ec2.EK
		if n.ec2.ReportedEK != nil {
			ek = n.ec2.ReportedEK
		}
		l.EC2.Put(ec2test.Instance{
			ID: n.ec2.ID, ImageID: amiID(n.Image), VPCID: AWSVPC, SubnetID: "subnet-0be27c1a5b1ab0001", Zone: AWSZone,
			PrivateDNSName: n.Name, Interfaces: [][]netip.Addr{{n.Addr}},
			// The guides' groups tag their instances with the cluster, as the cloud controller manager expects.
			Tags: map[string]string{"aws:autoscaling:groupName": n.ec2.Group, "Name": n.Name,
				"kubernetes.io/cluster/" + ClusterName: "owned"},
			EK: ek,
		})
	}
	args := append([]string{n.lab.cfg.AWS.IMDSMock}, imdstest.Args(imdsAddr, imdsPort, n.path("imds/aemm-config.json"))...)
	// The mock reads AEMM_* variables and $HOME/aemm-config.json as configuration: neither the host's.
	if _, _, err := n.startCmdEnv("imds", []string{"HOME=" + n.path("imds"), "PATH=" + os.Getenv("PATH")}, args...); err != nil {
		return err
	}
	return n.waitListening(ctx, "IMDS", net.JoinHostPort(imdsAddr, strconv.Itoa(imdsPort)), "imds")
}

// waitListening waits until a server the node runs (what, its log named log) listens on addr inside the
// node's network namespace.
func (n *Node) waitListening(ctx context.Context, what, addr, log string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return err
	}
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		// bash's /dev/tcp: a connection from inside the node's network namespace.
		_, err := run(ctx, "nsenter", "--net="+n.netns(), "bash", "-c", fmt.Sprintf("exec 3<>/dev/tcp/%s/%s", host, port))
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the %s of %s does not listen on %s (see %s): %w", what, n.Name, addr, n.path("logs/"+log+".log"), err)
		}
	}
}

// readEK reads the public key of the TPM's RSA EK, as DER SubjectPublicKeyInfo: what EC2's
// GetInstanceTpmEkPub reports for the instance's NitroTPM.
func readEK(device string) ([]byte, error) {
	tpm, err := attest.OpenTPM(device)
	if err != nil {
		return nil, err
	}
	defer tpm.Close()
	eks, err := tpm.EKs()
	if err != nil {
		return nil, err
	}
	for _, ek := range eks {
		if pub, ok := ek.Public.(*rsa.PublicKey); ok {
			return x509.MarshalPKIXPublicKey(pub)
		}
	}
	return nil, errors.New("the TPM has no RSA EK")
}

// awsAgentConfig is agent.yaml's aws for every AWS node: the groups of both roles, and the lab's EC2
// endpoint; region and VPC come from IMDS.
func awsAgentConfig() map[string]any {
	return map[string]any{
		"autoscalingGroups": map[string]metadata.Role{ControlPlaneGroup: metadata.RoleControlPlane, WorkerGroup: metadata.RoleWorker},
		"ec2Endpoint":       "https://" + net.JoinHostPort(hostAddr.String(), strconv.Itoa(ec2Port)),
	}
}

// agentEnv is the environment of an AWS node's agent: the host's without its AWS settings, the EC2
// endpoint's CA as AWS_CA_BUNDLE, and empty AWS configuration files, so that the SDK's credentials are the
// instance profile's from IMDS.
func (n *Node) agentEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "AWS_") {
			env = append(env, kv)
		}
	}
	return append(env, "AWS_CA_BUNDLE="+n.lab.path(ec2CAFile), "AWS_CONFIG_FILE="+n.path("aws/config"),
		"AWS_SHARED_CREDENTIALS_FILE="+n.path("aws/credentials"))
}

// ccmLog is the log of a control-plane node's cloud controller manager, in the node's logs directory.
const ccmLog = "cloud-controller-manager"

// startCloudControllerManager runs the AWS cloud controller manager on a control-plane node of an AWS lab
// whose cluster exists, as the guides' DaemonSet runs it on every control-plane node: inside the node, with
// its instance profile's credentials from its IMDS, the lab's EC2 endpoint as EC2 (the only service
// override: LoadBalancer Services would need ELB, which the lab does not serve), and the lab's admin
// kubeconfig. The copies elect a leader among themselves.
func (n *Node) startCloudControllerManager() error {
	l := n.lab
	// The override's Service is aws-sdk-go-v2's service id, which it must match exactly ("ec2" is ignored).
	conf := fmt.Sprintf("[Global]\n\n[ServiceOverride \"1\"]\nService = EC2\nRegion = %s\nURL = https://%s\nSigningRegion = %s\n",
		AWSRegion, net.JoinHostPort(hostAddr.String(), strconv.Itoa(ec2Port)), AWSRegion)
	if err := os.WriteFile(n.path("aws/cloud.conf"), []byte(conf), 0o600); err != nil {
		return err
	}
	kubeconfig := l.path("admin.conf")
	_, _, err := n.startCmdEnv(ccmLog, n.agentEnv(), l.cfg.AWS.CloudControllerManager,
		"--cloud-provider=aws", "--cloud-config="+n.path("aws/cloud.conf"),
		"--kubeconfig="+kubeconfig, "--authentication-kubeconfig="+kubeconfig, "--authorization-kubeconfig="+kubeconfig,
		"--use-service-account-credentials=false", "--configure-cloud-routes=false", "--leader-elect=true", "--v=2")
	if err != nil {
		return err
	}
	l.progress("%s: AWS cloud controller manager started (log %s)", n.Name, n.path("logs/"+ccmLog+".log"))
	return nil
}

// runsCloudControllerManager says whether the node runs the cloud controller manager once the cluster exists.
func (n *Node) runsCloudControllerManager() bool {
	return n.ec2 != nil && n.Role == metadata.RoleControlPlane && n.lab.cfg.AWS.CloudControllerManager != ""
}

// setEC2State tells the lab's EC2 endpoint, in the process that has it, that the node's instance is in state
// (stopped at a power-off, terminated at its removal), as EC2 reports it to the cloud controller manager.
func (n *Node) setEC2State(state string) {
	if n.ec2 != nil && n.lab.EC2 != nil {
		n.lab.EC2.SetState(n.ec2.ID, state)
	}
}
