#!/usr/bin/env bash
# Installs what Berth's build and tests need on Debian 12: the TPM emulator with its certificate tooling,
# cryptsetup for LUKS2, protoc for `make generate`, openssl for certificate cross-checks, and for the
# real-cluster lab containerd, runc, the CNI plugins and the tools kubeadm's preflight looks for.
# Idempotent: it calls apt only for what is missing.
set -euo pipefail

need_go="1.26"
if ! command -v go >/dev/null; then
	echo "install-deps: Go $need_go or newer is required (expected at /usr/local/go/bin/go)" >&2
	exit 1
fi
have_go=$(go env GOVERSION | sed 's/^go//')
if [ "$(printf '%s\n%s\n' "$need_go" "$have_go" | sort -V | head -n1)" != "$need_go" ]; then
	echo "install-deps: Go $need_go or newer is required, found $have_go" >&2
	exit 1
fi

# command -> Debian package
declare -A pkgs=(
	[swtpm]=swtpm
	[swtpm_setup]=swtpm-tools
	[cryptsetup]=cryptsetup-bin
	[protoc]=protobuf-compiler
	[openssl]=openssl
	[blkid]=util-linux
	[nsenter]=util-linux
	[mkfs.ext4]=e2fsprogs
	[ip]=iproute2
	[containerd]=containerd
	[runc]=runc
	[iptables]=iptables
	[conntrack]=conntrack
	[socat]=socat
	[ethtool]=ethtool
)
missing=()
for cmd in "${!pkgs[@]}"; do
	command -v "$cmd" >/dev/null || [ -x "/usr/sbin/$cmd" ] || [ -x "/sbin/$cmd" ] || missing+=("${pkgs[$cmd]}")
done
[ -x /usr/lib/cni/bridge ] || missing+=(containernetworking-plugins)
if [ ${#missing[@]} -eq 0 ]; then
	exit 0
fi
mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
echo "install-deps: installing ${missing[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then
	command -v sudo >/dev/null || { echo "install-deps: need root (or sudo) to install ${missing[*]}" >&2; exit 1; }
	sudo=sudo
fi
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
