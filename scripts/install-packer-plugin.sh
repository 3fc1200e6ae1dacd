#!/usr/bin/env bash
# Installs a built packer-plugin-berth into a Packer plugin directory in the layout Packer 1.9 looks in for
# required_plugins, so that `packer init` finds it without any network:
#   DIR/github.com/berthlabs/berth/packer-plugin-berth_v<version>_x<api>_<os>_<arch> and its _SHA256SUM
# The version and plugin API come from the binary itself (`describe`), so the name cannot disagree with it.
#
# usage: scripts/install-packer-plugin.sh BINARY DIR
set -euo pipefail

binary=$1 dir=$2
describe=$("$binary" describe)
version=$(sed -n 's/.*"version":"\([^"]*\)".*/\1/p' <<<"$describe")
api=$(sed -n 's/.*"api_version":"x\([^"]*\)".*/\1/p' <<<"$describe")
if [ -z "$version" ] || [ -z "$api" ]; then
	echo "install-packer-plugin: $binary describe says $describe: no version or api_version" >&2
	exit 1
fi
target="$dir/github.com/berthlabs/berth/packer-plugin-berth_v${version}_x${api}_$(go env GOOS)_$(go env GOARCH)"
mkdir -p "$(dirname "$target")"
install -m 0755 "$binary" "$target"
sha256sum "$target" | cut -d' ' -f1 >"${target}_SHA256SUM"
echo "$target"
