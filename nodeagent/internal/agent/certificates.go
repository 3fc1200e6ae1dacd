package agent

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/nodeagent/internal/certrenew"
	"github.com/berthlabs/berth/nodeagent/internal/kubecerts"
	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
)

// adminConf is kubeadm's admin kubeconfig on a control-plane node.
func (a *Agent) adminConf() string { return filepath.Join(a.cfg.Paths.KubernetesDir, "admin.conf") }

// adminCopyDir holds the join service's copy of admin.conf's credentials, on the state disk.
func (a *Agent) adminCopyDir() string { return filepath.Join(a.cfg.Paths.State, "admin-client") }

// writeAdminCopy writes admin.conf's client certificate and key to files of the agent's own, and a kubeconfig
// that names them, and returns that kubeconfig's path. client-go re-reads a client certificate given as
// files at each new connection, where it keeps one given inline (as kubeadm writes admin.conf) for the
// client's life: the join service runs as long as the node, and a renewal of admin.conf (package certrenew)
// must reach it before the old certificate ends. The renewal writes the copy again and closes the join
// service's connections, which open again with the new certificate.
func (a *Agent) writeAdminCopy() (string, error) {
	src := a.adminConf()
	cfg, err := clientcmd.LoadFromFile(src)
	if err != nil {
		return "", fmt.Errorf("reading %s: %w", src, err)
	}
	ctx, ok := cfg.Contexts[cfg.CurrentContext]
	if !ok || cfg.AuthInfos[ctx.AuthInfo] == nil {
		return "", fmt.Errorf("%s has no current context with a user", src)
	}
	user := cfg.AuthInfos[ctx.AuthInfo]
	if len(user.ClientCertificateData) == 0 || len(user.ClientKeyData) == 0 {
		// Files (which client-go reloads) or a token: nothing to copy.
		return src, nil
	}
	dir := a.adminCopyDir()
	cert, key := filepath.Join(dir, "client.crt"), filepath.Join(dir, "client.key")
	// The key first: a reader between the two writes pairs the old certificate with the new key, fails, and
	// reads both again at its next connection.
	if err := nodestate.WriteFile(key, user.ClientKeyData, 0o600); err != nil {
		return "", err
	}
	if err := nodestate.WriteFile(cert, user.ClientCertificateData, 0o600); err != nil {
		return "", err
	}
	user.ClientCertificateData, user.ClientKeyData, user.ClientCertificate, user.ClientKey = nil, nil, cert, key
	data, err := clientcmd.Write(*cfg)
	if err != nil {
		return "", fmt.Errorf("writing the admin kubeconfig copy: %w", err)
	}
	path := filepath.Join(dir, "kubeconfig")
	if err := nodestate.WriteFile(path, data, 0o600); err != nil {
		return "", err
	}
	return path, nil
}

// renewCertificates renews this control-plane node's kubeadm certificates whenever they are due, until ctx
// ends (package certrenew).
func (a *Agent) renewCertificates(ctx context.Context, self *metadata.Self, log *slog.Logger) {
	paths := a.cfg.Paths
	certrenew.New(certrenew.Config{
		Node:        self.Instance.Name,
		Files:       kubecerts.Files(paths),
		Kubeconfig:  a.adminConf(),
		CertDir:     paths.PKIDir(),
		ManifestDir: filepath.Join(paths.KubernetesDir, "manifests"),
		Kubeadm:     a.deps.Kubeadm,
		Client:      a.localAdminClient(self),
		RenewBefore: a.cfg.CertificateRenewBefore.Duration,
		Observer:    renewalObserver{a: a, log: log},
		Logger:      log,
	}).Run(ctx)
}

// localAdminClient connects to this control-plane node's own API server with admin.conf's current
// credentials, anew at each call: renewals and upgrades replace the certificate it authenticates with.
func (a *Agent) localAdminClient(self *metadata.Self) func() (kubernetes.Interface, error) {
	return func() (kubernetes.Interface, error) {
		server, err := localAPIServer(a.adminConf(), self.Instance.Addresses)
		if err != nil {
			return nil, err
		}
		return a.deps.KubeClient(a.adminConf(), server)
	}
}

// renewalObserver passes a renewal on to the join service's credentials and to the metrics.
type renewalObserver struct {
	a   *Agent
	log *slog.Logger
}

func (o renewalObserver) CertificatesRenewed(err error) {
	if err == nil && o.a.cfg.Kubeconfig == "" {
		if _, werr := o.a.writeAdminCopy(); werr != nil {
			err = fmt.Errorf("the certificates were renewed, but the join service keeps the old admin credentials: %w", werr)
			o.log.Error("renewal not passed on to the join service", "error", err)
		} else if o.a.deps.ReconnectKube != nil {
			o.a.deps.ReconnectKube()
		}
	}
	o.a.telemetry.metrics.CertificatesRenewed(err)
}
