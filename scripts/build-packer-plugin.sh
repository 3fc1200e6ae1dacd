#!/usr/bin/env bash
# Builds one of HashiCorp's Packer plugins, github.com/hashicorp/packer-plugin-NAME, at the version pinned in
# test/packertools/NAME/go.mod, and installs it in a cache in the layout Packer 1.9's required_plugins look in,
# so that `packer init`, `packer validate` and `packer build` find it without network:
#   ${BERTH_CACHE:-$HOME/.cache/berth}/packer-plugin-NAME/<version>/plugins/github.com/hashicorp/NAME/
#     packer-plugin-NAME_v<version>_x<api>_<os>_<arch> and its _SHA256SUM
# A plugin already there is kept. Progress goes to stderr; the only line on stdout is that plugins directory,
# for PACKER_PLUGIN_PATH.
#
# usage: scripts/build-packer-plugin.sh NAME      (amazon, qemu)
set -euo pipefail

log() { echo "build-packer-plugin: $*" >&2; }

if [ $# -ne 1 ]; then
	echo "usage: $0 NAME" >&2
	exit 2
fi
name=$1
module=github.com/hashicorp/packer-plugin-$name
module_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/../test/packertools" && pwd)/$name"
if [ ! -f "$module_dir/go.mod" ]; then
	log "no tools module pins $module: $module_dir/go.mod"
	exit 1
fi
cd "$module_dir"
version=$(go list -m -f '{{.Version}}' "$module")

# CI may run without HOME: fall back to a system cache directory.
cache_root="${BERTH_CACHE:-${HOME:+$HOME/.cache/berth}}"
cache_dir="${cache_root:-/var/cache/berth}/packer-plugin-$name/$version"
plugins_dir="$cache_dir/plugins"
install_dir="$plugins_dir/github.com/hashicorp/$name"
mkdir -p "$install_dir"
exec 9>"$cache_dir/.lock"
flock 9

# The installed name carries the version and plugin API the binary itself reports, as packer init checks.
installed=$(find "$install_dir" -maxdepth 1 -name "packer-plugin-${name}_${version}_x*_$(go env GOOS)_$(go env GOARCH)" -print -quit)
if [ -n "$installed" ] && [ -f "${installed}_SHA256SUM" ] && "$installed" describe >/dev/null 2>&1; then
	log "packer-plugin-$name $version already built"
else
	log "building packer-plugin-$name $version from its module (minutes with a cold build cache)"
	start=$SECONDS
	go build -trimpath -ldflags "-s -w" -o "$cache_dir/packer-plugin-$name.tmp" "$module"
	describe=$("$cache_dir/packer-plugin-$name.tmp" describe)
	api=$(sed -n 's/.*"api_version":"x\([^"]*\)".*/\1/p' <<<"$describe")
	reported=$(sed -n 's/.*"version":"\([^"]*\)".*/\1/p' <<<"$describe")
	if [ -z "$api" ] || [ "v$reported" != "$version" ]; then
		log "the built plugin describes itself as $describe, not version ${version#v} with an api_version"
		exit 1
	fi
	target="$install_dir/packer-plugin-${name}_${version}_x${api}_$(go env GOOS)_$(go env GOARCH)"
	rm -f "$install_dir"/packer-plugin-"${name}"_*
	mv "$cache_dir/packer-plugin-$name.tmp" "$target"
	sha256sum "$target" | cut -d' ' -f1 >"${target}_SHA256SUM"
	log "packer-plugin-$name $version built in $((SECONDS - start))s"
fi
echo "$plugins_dir"
