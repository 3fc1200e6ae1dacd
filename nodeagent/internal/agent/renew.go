package agent

import (
	"context"
	"crypto/x509"
	"log/slog"
	"time"

	"github.com/berthlabs/berth/nodeagent/internal/joinclient"
	"github.com/berthlabs/berth/nodeagent/internal/kubecerts"
)

// renewRetry is how long the agent waits before it looks at the kubelet's certificate again after it
// could not read it or renew it; the join client retries a renewal itself until the join service answers.
const renewRetry = time.Minute

// renewKubeletCertificate keeps the kubelet's client certificate current on a node whose kubelet cannot
// rotate it through the API server (it joined without kubeadm): when two thirds of the certificate's
// lifetime have passed, the join service signs a new one, until ctx ends.
func (a *Agent) renewKubeletCertificate(ctx context.Context, log *slog.Logger, jc *joinclient.Client, disk string) {
	log = log.With("component", "kubelet-certificate")
	var renewed time.Time
	for {
		wait := renewRetry
		cert, err := kubecerts.Read(joinclient.KubeletCertPath(a.cfg.Paths))
		if err != nil {
			log.Warn("reading the kubelet's client certificate", "error", err)
		} else {
			// A signer whose certificates are already due when issued (a short lifetime, a long backdate)
			// gets one request a renewRetry, not a loop of them.
			wait = max(time.Until(renewAt(cert)), time.Until(renewed.Add(renewRetry)))
			log.Info("kubelet certificate renewal scheduled", "serial", cert.SerialNumber.Text(16), "renew_in", wait.Round(time.Second), "not_after", cert.NotAfter.UTC())
		}
		if wait > 0 {
			select {
			case <-ctx.Done():
				return
			case <-time.After(wait):
			}
		}
		if err != nil {
			continue
		}
		renewed = time.Now()
		if _, err := jc.RenewKubeletCertificate(ctx, disk); err != nil {
			if ctx.Err() != nil {
				return
			}
			log.Error("renewing the kubelet certificate", "error", err, "not_after", cert.NotAfter.UTC())
			select {
			case <-ctx.Done():
				return
			case <-time.After(renewRetry):
			}
		}
	}
}

// renewAt is when a certificate is renewed: two thirds into its lifetime, as the kubelet's own rotation
// does (at 70 to 90 percent), early enough that a join service down for a while costs nothing.
func renewAt(cert *x509.Certificate) time.Time {
	life := cert.NotAfter.Sub(cert.NotBefore)
	return cert.NotBefore.Add(life * 2 / 3)
}
