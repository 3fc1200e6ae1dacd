#!/usr/bin/env bash
# Installs what Berth's build and tests need on Debian 12: the TPM emulator with its certificate tooling,
# cryptsetup for LUKS2, protoc for `make generate`, openssl for certificate cross-checks, and for the
# real-cluster lab containerd, runc, the CNI plugins and the tools kubeadm's preflight looks for; for the
# measured-boot tests and the berth-uki builder binutils' objcopy (joins unified kernel images), osslsigncode
# (an independent Authenticode hash), fdisk, dosfstools and mtools (the UEFI disk image, made without root),
# cpio (checks the initrds) and QEMU with OVMF (boots them with a swtpm; dnsmasq's DHCP gives a baked image
# booted on the lab's bridge its address, as a cloud's network does); mmdebstrap (the root file system of
# the local node image, from Debian's archive), kmod (its kernel modules' index) and busybox-static (a shell
# for chroot tests); gcc with glibc's headers and static library (cgo: CFSSL's sqlite driver, and flanneld,
# linked statically for the lab's Flannel image) and sqlite3 (CFSSL's certificate database in the
# remote-signer tests); and Terraform (below).
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
	[objcopy]=binutils
	[osslsigncode]=osslsigncode
	[qemu-system-x86_64]=qemu-system-x86
	[qemu-img]=qemu-utils
	[dnsmasq]=dnsmasq-base
	# The verified-root test builds another root for the image's UKI (and finds files' blocks with filefrag).
	[mkfs.erofs]=erofs-utils
	[filefrag]=e2fsprogs
	[ssh-keygen]=openssh-client
	[systemd-analyze]=systemd
	[sfdisk]=fdisk
	[mkfs.vfat]=dosfstools
	[mcopy]=mtools
	[cpio]=cpio
	[depmod]=kmod
	[mmdebstrap]=mmdebstrap
	[busybox]=busybox-static
	[gcc]=gcc
	[sqlite3]=sqlite3
	[zip]=zip
	[unzip]=unzip
	# The conformance suite's test images carry these as upstream's carry Alpine's (make conformance).
	[dig]=bind9-dnsutils
	[nc.openbsd]=netcat-openbsd
	[curl]=curl
)
# Terraform is not in Debian: the provider's tests and `make lab` run the release HashiCorp publishes. The
# binary's checksum is pinned, so a tampered or different download is refused.
tf_version="1.11.4"
tf_sha256="268000fca5c61021c6396893d9483007ba589ad9d0aaccbd7dfa8c78bf7dbe23"
install_terraform() {
	local tmp
	tmp=$(mktemp -d)
	trap 'rm -rf "$tmp"' RETURN
	echo "install-deps: installing terraform $tf_version to /usr/local/bin"
	if ! command -v curl >/dev/null || ! command -v unzip >/dev/null; then
		$sudo apt-get update -qq
		DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends curl unzip ca-certificates
	fi
	curl -fsSLo "$tmp/tf.zip" "https://releases.hashicorp.com/terraform/$tf_version/terraform_${tf_version}_linux_amd64.zip"
	unzip -q "$tmp/tf.zip" terraform -d "$tmp"
	echo "$tf_sha256  $tmp/terraform" | sha256sum -c --quiet -
	$sudo install -m 0755 "$tmp/terraform" /usr/local/bin/terraform
}

missing=()
for cmd in "${!pkgs[@]}"; do
	command -v "$cmd" >/dev/null || [ -x "/usr/sbin/$cmd" ] || [ -x "/sbin/$cmd" ] || missing+=("${pkgs[$cmd]}")
done
[ -x /usr/lib/cni/bridge ] || missing+=(containernetworking-plugins)
[ -f /usr/lib/x86_64-linux-gnu/libc.a ] || missing+=(libc6-dev)
[ -f /usr/share/OVMF/OVMF_CODE_4M.fd ] || missing+=(ovmf)
sudo=""
if [ "$(id -u)" -ne 0 ]; then
	sudo=sudo
fi
have_tf=$(CHECKPOINT_DISABLE=1 terraform version -json 2>/dev/null | sed -n 's/.*"terraform_version": *"\([0-9.]*\)".*/\1/p' || true)
if [ -z "$have_tf" ] || [ "$(printf '%s\n%s\n' 1.11.0 "$have_tf" | sort -V | head -n1)" != 1.11.0 ]; then
	install_terraform
fi
if [ ${#missing[@]} -eq 0 ]; then
	exit 0
fi
mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
echo "install-deps: installing ${missing[*]}"
if [ -n "$sudo" ]; then
	command -v sudo >/dev/null || { echo "install-deps: need root (or sudo) to install ${missing[*]}" >&2; exit 1; }
	sudo=sudo
fi
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
