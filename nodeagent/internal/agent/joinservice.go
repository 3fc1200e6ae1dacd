package agent

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"time"

	"google.golang.org/grpc"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/berthlabs/berth/internal/api/berthv1"
	"github.com/berthlabs/berth/internal/attest"
	"github.com/berthlabs/berth/internal/cfssl"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/pki"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/internal/rpc"
	"github.com/berthlabs/berth/nodeagent/internal/joinservice"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
)

// InitialPolicyFile is where the init server leaves the policy of the init request, for the join service
// to publish as its ConfigMap when none exists yet.
const InitialPolicyFile = "join-policy.yaml"

// joinConnectionsPerCPU bounds the exchanges in progress: a node holds its connection while its TPM quotes
// and activates (up to a few hundred milliseconds on a vTPM), so a few dozen per CPU keep the CPUs busy
// while a storm beyond that waits in the listen queue instead of costing memory.
const joinConnectionsPerCPU = 32

// serverCertValidity is the join service's certificate lifetime; the service makes a new one each start.
const serverCertValidity = 90 * 24 * time.Hour

// ServeJoinService serves join tickets from this control-plane node's stored cluster secrets until ctx ends.
func (a *Agent) ServeJoinService(ctx context.Context) error {
	self, err := a.self(ctx)
	if err != nil {
		return err
	}
	log := a.log.With("component", "join-service", "node", self.Instance.Name)
	secrets, err := nodestate.ReadSecrets(a.cfg.Paths.State)
	if err != nil {
		return fmt.Errorf("join service: %w", err)
	}
	kubeCA, signer, err := a.kubeletSigning()
	if err != nil {
		return fmt.Errorf("join service: %w", err)
	}
	joinCA, err := pki.ParseCA(secrets.JoinCACert, secrets.JoinCAKey)
	if err != nil {
		return fmt.Errorf("join service: join CA: %w", err)
	}
	bundle, err := os.ReadFile(a.cfg.EKCABundle)
	if err != nil {
		return fmt.Errorf("join service: EK CA bundle: %w", err)
	}
	roots, inters, err := attest.ParseCABundle(bundle)
	if err != nil {
		return fmt.Errorf("join service: EK CA bundle %s: %w", a.cfg.EKCABundle, err)
	}
	kubeconfig := a.cfg.Kubeconfig
	if kubeconfig == "" {
		kubeconfig = filepath.Join(a.cfg.Paths.KubernetesDir, "admin.conf")
	}
	kube, err := a.deps.KubeClient(kubeconfig)
	if err != nil {
		return fmt.Errorf("join service: %w", err)
	}

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	store := policy.NewStore(&policy.Policy{})
	watchErr := make(chan error, 1)
	if a.cfg.PolicyFile != "" {
		go func() { watchErr <- policy.WatchFile(ctx, a.cfg.PolicyFile, 5*time.Second, store, log) }()
	} else {
		if err := a.publishInitialPolicy(ctx, kube); err != nil {
			log.Warn("publishing the initial join policy", "error", err)
		}
		go func() {
			watchErr <- policy.WatchConfigMap(ctx, kube, joinservice.Namespace, a.cfg.PolicyConfigMap, store, log)
		}()
	}

	svc, err := joinservice.New(joinservice.Config{
		Verifier:          attest.NewVerifier(roots, inters, nil),
		Policy:            store,
		Instances:         a.meta,
		Tokens:            &joinservice.KubeTokens{Client: kube},
		Disks:             &joinservice.KubeDisks{Client: kube},
		MasterSecret:      secrets.MasterSecret,
		Salt:              secrets.Salt,
		KubernetesCA:      kubeCA,
		KubeletSigner:     signer,
		APIServerEndpoint: secrets.APIServerEndpoint,
		KubernetesVersion: secrets.KubernetesVersion,
		ControlPlaneFiles: joinservice.PKIFiles(a.cfg.Paths.PKIDir()),
		JoinCA:            joinCA,
		Logger:            log,
	})
	if err != nil {
		return err
	}
	cert, err := serverCert(joinCA, self.Instance)
	if err != nil {
		return fmt.Errorf("join service certificate: %w", err)
	}
	addr := net.JoinHostPort(a.cfg.JoinListenHost, strconv.Itoa(int(self.UserData.JoinPort)))
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("join service: %w", err)
	}
	lis = rpc.LimitListener(lis, joinConnectionsPerCPU*runtime.GOMAXPROCS(0))
	gs := grpc.NewServer(rpc.ServerOptions(cert)...)
	berthv1.RegisterJoinServiceServer(gs, svc)
	served := make(chan error, 1)
	go func() { served <- gs.Serve(lis) }()
	log.Info("join service listening", "address", lis.Addr().String())
	select {
	case <-ctx.Done():
		stopGracefully(gs, 10*time.Second)
		return nil
	case err := <-served:
		return fmt.Errorf("join service: %w", err)
	case err := <-watchErr:
		gs.Stop()
		return fmt.Errorf("join service: watching the join policy: %w", err)
	}
}

// publishInitialPolicy creates the policy ConfigMap from the init request's policy, unless it exists.
func (a *Agent) publishInitialPolicy(ctx context.Context, kube kubernetes.Interface) error {
	data, err := os.ReadFile(filepath.Join(a.cfg.Paths.State, InitialPolicyFile))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	cm := &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: a.cfg.PolicyConfigMap, Namespace: joinservice.Namespace,
			Labels: map[string]string{"app.kubernetes.io/managed-by": "berth"}},
		Data: map[string]string{policy.ConfigMapKey: string(data)},
	}
	_, err = kube.CoreV1().ConfigMaps(joinservice.Namespace).Create(ctx, cm, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		return nil
	}
	return err
}

// kubeletSigning is the Kubernetes CA and, with a CFSSL configured, the signer of kubelet certificates;
// then the CA's key is not read, and need not be on this machine.
func (a *Agent) kubeletSigning() (*pki.CA, joinservice.KubeletSigner, error) {
	dir := a.cfg.Paths.PKIDir()
	certPEM, err := os.ReadFile(filepath.Join(dir, "ca.crt"))
	if err != nil {
		return nil, nil, fmt.Errorf("Kubernetes CA: %w", err)
	}
	c := a.cfg.CFSSL
	if c == nil {
		key, err := os.ReadFile(filepath.Join(dir, "ca.key"))
		if err != nil {
			return nil, nil, fmt.Errorf("Kubernetes CA: %w (configure cfssl to sign kubelet certificates without it)", err)
		}
		ca, err := pki.ParseCA(certPEM, key)
		if err != nil {
			return nil, nil, fmt.Errorf("Kubernetes CA: %w", err)
		}
		return ca, nil, nil
	}
	cert, err := pki.ParseCertPEM(certPEM)
	if err != nil {
		return nil, nil, fmt.Errorf("Kubernetes CA: %w", err)
	}
	hexKey, err := os.ReadFile(c.AuthKeyFile)
	if err != nil {
		return nil, nil, fmt.Errorf("CFSSL auth key: %w", err)
	}
	key, err := cfssl.ParseAuthKey(string(hexKey))
	if err != nil {
		return nil, nil, fmt.Errorf("CFSSL auth key %s: %w", c.AuthKeyFile, err)
	}
	signer := &cfssl.Signer{URL: c.URL, Profile: c.Profile, AuthKey: key, Label: c.Label,
		Logger: a.log.With("component", "cfssl")}
	return &pki.CA{Cert: cert}, joinservice.CFSSLSigner{Signer: signer}, nil
}

// serverCert issues this node's join-service certificate, with the join CA in the chain so that nodes
// holding only the CA's pin can verify it.
func serverCert(ca *pki.CA, self metadata.Instance) (tls.Certificate, error) {
	key, err := pki.NewKey()
	if err != nil {
		return tls.Certificate{}, err
	}
	ips := make([]net.IP, len(self.Addresses))
	for i, a := range self.Addresses {
		ips[i] = a.AsSlice()
	}
	now := time.Now()
	leaf, err := ca.IssueServer(key.Public(), []string{self.Name}, ips, now, min(serverCertValidity, ca.Cert.NotAfter.Sub(now)))
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.Certificate{Certificate: [][]byte{leaf.Raw, ca.Cert.Raw}, PrivateKey: key, Leaf: leaf}, nil
}
