package agent

import (
	"context"
	"fmt"
	"log/slog"

	"k8s.io/client-go/kubernetes"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/nodeagent/internal/joinservice"
	"github.com/berthlabs/berth/nodeagent/internal/kubeupgrade"
)

// upgradeKubernetes takes this control-plane node's part in any Kubernetes upgrade the provider instructs,
// until ctx ends (package kubeupgrade).
func (a *Agent) upgradeKubernetes(ctx context.Context, self *metadata.Self, log *slog.Logger) {
	kubeupgrade.New(kubeupgrade.Config{
		Node:       self.Instance.Name,
		Kubeconfig: a.adminConf(),
		Kubeadm:    a.deps.Kubeadm,
		Client:     a.localAdminClient(self),
		Upgraded: func(ctx context.Context, kube kubernetes.Interface) error {
			if removed, err := joinservice.RemoveBootstrapAutoApproval(ctx, kube); err != nil {
				return err
			} else if removed {
				log.Info("removed the auto-approval of bootstrap tokens' node certificates that kubeadm upgrade made again",
					"binding", joinservice.BootstrapAutoApproveBinding)
			}
			// kubeadm upgrade renewed admin.conf's certificate with the others: the join service's copy
			// follows, or it would expire while the node's certificates are not yet due for renewal.
			if a.cfg.Kubeconfig != "" {
				return nil
			}
			if _, err := a.writeAdminCopy(); err != nil {
				return fmt.Errorf("passing the renewed admin credentials on to the join service: %w", err)
			}
			if a.deps.ReconnectKube != nil {
				a.deps.ReconnectKube()
			}
			return nil
		},
		Logger: log,
	}).Run(ctx)
}
