#!/usr/bin/env bash
# The main job, as `make lab` runs it: the lab host first (bridge, swtpm EK CA, container images and the image
# manifest), then `terraform apply` of examples/lab with the provider built from this tree, which makes the
# cluster's secrets, boots the machines, attests and initializes the first control-plane node and writes the
# join policy; last, a wait until every node is Ready.
#
# usage: scripts/lab-up.sh LAB_DIR BIN_DIR KUBE_BIN_DIR
set -euo pipefail

dir=$1 bin=$2 kube_bin=$3
repo=$(cd "$(dirname "$0")/.." && pwd)
command -v terraform >/dev/null || { echo "terraform (1.11 or later) is needed on PATH: make deps installs it" >&2; exit 1; }

"$bin/berth-lab" host --dir "$dir" --kube-bin "$kube_bin" --agent "$bin/berth-agent"

# Terraform's working directory lives in the lab directory, so make lab-down removes its state too.
work=$dir/terraform
mkdir -p "$work"
cp "$repo"/examples/lab/*.tf "$work/"
# The root key of a throwaway cluster; a real one lives in a secret store and comes back on every run.
(umask 077 && head -c 32 /dev/urandom | base64 >"$dir/root-key")
cat >"$work/dev.tfrc" <<TFRC
provider_installation {
  dev_overrides {
    "berthlabs/berth" = "$bin"
  }
  direct {}
}
TFRC
export TF_CLI_CONFIG_FILE=$work/dev.tfrc CHECKPOINT_DISABLE=1 TF_IN_AUTOMATION=1
TF_VAR_root_key=$(cat "$dir/root-key")
export TF_VAR_root_key
terraform -chdir="$work" apply -auto-approve -input=false -var "lab_dir=$dir" -var "berth_lab=$bin/berth-lab"
(umask 077 && terraform -chdir="$work" output -raw kubeconfig >"$dir/admin.conf")
"$bin/berth-lab" wait --dir "$dir" --kubeconfig "$dir/admin.conf"
cat <<DONE

The lab's Terraform state and configuration are in $work; to change the cluster (add a worker, drop an image
from the join policy), edit them there and run, with the same environment:
  TF_CLI_CONFIG_FILE=$work/dev.tfrc TF_VAR_root_key=\$(cat $dir/root-key) \\
    terraform -chdir=$work apply -var lab_dir=$dir -var berth_lab=$bin/berth-lab
DONE
