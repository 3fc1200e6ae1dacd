// Package kubecerts knows the certificates kubeadm and the kubelet keep on a node: where they are, and how to
// read one from a PEM file or from a kubeconfig that carries it. The node's metrics show their expiry, and a
// control-plane node renews kubeadm's before they expire (package certrenew).
package kubecerts

import (
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"k8s.io/client-go/tools/clientcmd"

	"github.com/berthlabs/berth/nodeagent/internal/nodestate"
)

// File is one certificate a node keeps.
type File struct {
	// Name is how metrics and logs call it: kubeadm's name for it (`kubeadm certs check-expiration`), with
	// etcd's prefixed "etcd-".
	Name string
	Path string
	// CA is set for a certificate authority. Berth's provider makes the cluster's CA; kubeadm makes the
	// front proxy's and etcd's, for ten years, and cannot renew them in place.
	CA bool
	// Kubeadm is set for what `kubeadm certs renew all` renews.
	Kubeadm bool
}

// Files are the certificates of a node with paths: kubeadm's control-plane certificates, the kubeconfigs it
// writes and their CAs (on control-plane nodes), and the kubelet's client and serving certificates (on
// every node). A node has only some of them; a missing file is not an error of its own.
func Files(paths nodestate.Paths) []File {
	var files []File
	pki := paths.PKIDir()
	for _, name := range []string{"ca", "front-proxy-ca", "etcd/ca"} {
		files = append(files, File{Name: strings.ReplaceAll(name, "/", "-"), Path: filepath.Join(pki, name+".crt"), CA: true})
	}
	for _, name := range []string{"apiserver", "apiserver-kubelet-client", "apiserver-etcd-client", "front-proxy-client",
		"etcd/server", "etcd/peer", "etcd/healthcheck-client"} {
		files = append(files, File{Name: strings.ReplaceAll(name, "/", "-"), Path: filepath.Join(pki, name+".crt"), Kubeadm: true})
	}
	for _, conf := range []string{"admin.conf", "super-admin.conf", "controller-manager.conf", "scheduler.conf"} {
		files = append(files, File{Name: conf, Path: filepath.Join(paths.KubernetesDir, conf), Kubeadm: true})
	}
	// The kubelet rotates its client certificate through the API server (or the agent through the join
	// service) and makes its serving certificate itself.
	return append(files,
		File{Name: "kubelet-client", Path: filepath.Join(paths.KubeletDir, "pki", "kubelet-client-current.pem")},
		File{Name: "kubelet-serving", Path: filepath.Join(paths.KubeletDir, "pki", "kubelet.crt")})
}

// maxFile bounds what is read of one file; kubeadm's largest, a kubeconfig with its CA and client
// certificate inline, is about 6 KiB.
const maxFile = 1 << 20

// Read reads the certificate at path: a PEM file's first certificate (the kubelet's client file holds its
// key too), or a kubeconfig's client certificate for its current context's user, inline or in a file the
// kubeconfig names. A missing file's error is fs.ErrNotExist's.
func Read(path string) (*x509.Certificate, error) {
	data, err := readBounded(path)
	if err != nil {
		return nil, err
	}
	if block, _ := pem.Decode(data); block == nil {
		// Not PEM: a kubeconfig, whose client certificate is inline or in a file beside it.
		if data, err = kubeconfigClientCertificate(path, data); err != nil {
			return nil, err
		}
	}
	for rest := data; ; {
		var block *pem.Block
		block, rest = pem.Decode(rest)
		if block == nil {
			return nil, fmt.Errorf("%s: no PEM certificate", path)
		}
		if block.Type != "CERTIFICATE" {
			continue
		}
		cert, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		return cert, nil
	}
}

func kubeconfigClientCertificate(path string, data []byte) ([]byte, error) {
	cfg, err := clientcmd.Load(data)
	if err != nil {
		return nil, fmt.Errorf("%s: neither PEM nor a kubeconfig: %w", path, err)
	}
	ctx, ok := cfg.Contexts[cfg.CurrentContext]
	if !ok {
		return nil, fmt.Errorf("%s: no current context", path)
	}
	user, ok := cfg.AuthInfos[ctx.AuthInfo]
	switch {
	case !ok:
		return nil, fmt.Errorf("%s: the current context's user %q is not there", path, ctx.AuthInfo)
	case len(user.ClientCertificateData) > 0:
		return user.ClientCertificateData, nil
	case user.ClientCertificate != "":
		file := user.ClientCertificate
		if !filepath.IsAbs(file) {
			file = filepath.Join(filepath.Dir(path), file)
		}
		return readBounded(file)
	}
	return nil, fmt.Errorf("%s: the current context's user has no client certificate", path)
}

func readBounded(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, maxFile+1))
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", path, err)
	}
	if len(data) > maxFile {
		return nil, fmt.Errorf("%s: larger than %d bytes", path, maxFile)
	}
	return data, nil
}
