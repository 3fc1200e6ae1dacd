#!/usr/bin/env bash
# Builds Berth's release archives offline (make release), the same files with the same names and layout as
# `goreleaser release` makes from the two release configurations, which this script mirrors: change them
# together.
#   .goreleaser.yml         the Terraform provider, in the form of HashiCorp's provider scaffolding:
#                           terraform-provider-berth_<version>_<os>_<arch>.zip holding
#                           terraform-provider-berth_v<version> (and LICENSE, README.md, CHANGELOG.md),
#                           terraform-provider-berth_<version>_manifest.json (terraform-registry-manifest.json)
#                           and terraform-provider-berth_<version>_SHA256SUMS over the zips and the manifest
#   .goreleaser.packer.yml  the Packer plugin, in the form of HashiCorp's packer-plugin-scaffolding:
#                           packer-plugin-berth_v<version>_<api>_<os>_<arch>.zip holding the binary of the
#                           same name, and packer-plugin-berth_v<version>_SHA256SUMS over the zips; <api> is
#                           the plugin API version the binary describes (x5.0), which Packer reads in the name
# goreleaser is not needed here (nor fetchable offline): this is the build a developer or an offline machine
# runs, and the one the tests install from.
#
# usage: scripts/release.sh [provider] [packer-plugin]    (both when neither is named)
# environment:
#   VERSION            the release's semantic version (a leading v is dropped); else the v* tag on HEAD, as
#                      goreleaser takes it; else 0.1.0, the first release. CHANGELOG.md, which every
#                      provider archive ships, must have its section "## <version>"
#   RELEASE_PLATFORMS  os/arch pairs, space- or comma-separated, among those the configurations build
#                      (default: linux/amd64 linux/arm64 darwin/amd64 darwin/arm64)
#   RELEASE_DIST       where the archives go (default: dist/ in the repository); the product's earlier
#                      archives there are removed first, as goreleaser's --clean does
#   GPG_FINGERPRINT    when set, each SHA256SUMS is signed with that key into SHA256SUMS.sig (goreleaser's
#                      signs section); the Terraform Registry needs that signature, a filesystem mirror not
# Prints the archive directory's path last.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

all_platforms="linux/amd64 linux/arm64 darwin/amd64 darwin/arm64"

die() {
	echo "release: $*" >&2
	exit 1
}

products=("$@")
[ ${#products[@]} -gt 0 ] || products=(provider packer-plugin)
for p in "${products[@]}"; do
	case $p in
	provider | packer-plugin) ;;
	*) die "unknown product $p: say provider, packer-plugin or nothing for both" ;;
	esac
done

for tool in go zip sha256sum; do
	command -v "$tool" >/dev/null || die "$tool is not on PATH (Debian: apt-get install zip coreutils)"
done

version=${VERSION:-}
if [ -z "$version" ]; then
	if tag=$(git describe --tags --exact-match --match 'v[0-9]*' HEAD 2>/dev/null); then
		version=$tag
	else
		version=0.1.0
		echo "release: no v* tag on HEAD and no VERSION: building $version" >&2
	fi
fi
version=${version#v}
# File names, Terraform's version constraints and Packer's plugin discovery all read it as a semantic version.
[[ $version =~ ^[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?$ ]] ||
	die "version $version is not a semantic version such as 0.1.0 or 0.2.0-rc.1"
# Every archive ships CHANGELOG.md: without a section for this version it would ship another release's notes.
grep -qE "^## ${version//./\\.}( |$)" CHANGELOG.md ||
	die "CHANGELOG.md has no section \"## $version\": write this release's notes first"
core=${version%%-*}
prerelease=""
[ "$core" = "$version" ] || prerelease=${version#*-}

platforms=$(tr ',' ' ' <<<"${RELEASE_PLATFORMS:-$all_platforms}")
for platform in $platforms; do
	[[ " $all_platforms " == *" $platform "* ]] ||
		die "RELEASE_PLATFORMS: $platform is not a platform the release configurations build ($all_platforms)"
done
[ -n "$platforms" ] || die "RELEASE_PLATFORMS is empty"

dist=${RELEASE_DIST:-$root/dist}
mkdir -p "$dist"
dist=$(cd "$dist" && pwd)

# goreleaser's mod_timestamp: every file in an archive carries the commit's time, so the same commit makes
# the same archives byte for byte (zip -X leaves out owners and extra times; TZ=UTC fixes the DOS times).
mtime=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}
export TZ=UTC

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# build PACKAGE OUTPUT LDFLAGS GOOS GOARCH: the configurations' build (CGO_ENABLED=0, -trimpath: what make build
# and the tests' test/gobuild use too, so the release test finds this platform's packages compiled).
build() {
	local pkg=$1 out=$2 ldflags=$3
	CGO_ENABLED=0 GOOS=$4 GOARCH=$5 go build -trimpath -ldflags "$ldflags" -o "$out" "$pkg"
	chmod 0755 "$out"
	touch -d "@$mtime" "$out"
}

# archive ZIP FILE...: the files at the zip's root, in the given order.
archive() {
	local zipfile=$1
	shift
	rm -f "$zipfile"
	(cd "$(dirname "$1")" && zip -q -X "$zipfile" "${@##*/}")
}

# sums FILE NAME...: goreleaser's checksum file, "<sha256>  <name>" sorted by name, and its signature.
sums() {
	local sumfile=$1
	shift
	(cd "$dist" && printf '%s\n' "$@" | LC_ALL=C sort | xargs sha256sum) >"$sumfile"
	if [ -n "${GPG_FINGERPRINT:-}" ]; then
		rm -f "$sumfile.sig"
		gpg --batch --local-user "$GPG_FINGERPRINT" --output "$sumfile.sig" --detach-sign "$sumfile"
	fi
}

release_provider() {
	local name=terraform-provider-berth
	rm -f "$dist/${name}_"*
	local stage=$work/provider files=()
	mkdir -p "$stage"
	for f in LICENSE README.md CHANGELOG.md; do
		install -m 0644 "$f" "$stage/$f"
		touch -d "@$mtime" "$stage/$f"
	done
	for platform in $platforms; do
		local os=${platform%/*} arch=${platform#*/}
		local binary=${name}_v$version
		build . "$stage/$binary" "-s -w -X main.version=$version" "$os" "$arch"
		archive "$dist/${name}_${version}_${os}_${arch}.zip" "$stage/$binary" "$stage/LICENSE" "$stage/README.md" "$stage/CHANGELOG.md"
		files+=("${name}_${version}_${os}_${arch}.zip")
		rm "$stage/$binary"
	done
	# The registry reads the protocol versions the provider serves from this file of the release.
	install -m 0644 terraform-registry-manifest.json "$dist/${name}_${version}_manifest.json"
	files+=("${name}_${version}_manifest.json")
	sums "$dist/${name}_${version}_SHA256SUMS" "${files[@]}"
}

release_packer_plugin() {
	local name=packer-plugin-berth pkg=./packer/cmd/packer-plugin-berth
	rm -f "$dist/${name}_"*
	# The plugin reports Version and Prerelease separately; a release has them from its version.
	local ldflags="-s -w -X github.com/berthlabs/berth/packer/version.Version=$core -X github.com/berthlabs/berth/packer/version.Prerelease=$prerelease"
	# The plugin API version, as the scaffold's release workflow reads it (`go run . describe`), from a host
	# build with the release's flags; and what `packer-sdc plugin-check` asks of that description.
	build "$pkg" "$work/describe" "$ldflags" "$(go env GOHOSTOS)" "$(go env GOHOSTARCH)"
	local describe api described
	describe=$("$work/describe" describe)
	api=$(sed -n 's/.*"api_version":"\([^"]*\)".*/\1/p' <<<"$describe")
	described=$(sed -n 's/.*"version":"\([^"]*\)".*/\1/p' <<<"$describe")
	[ -n "$api" ] || die "$name describe names no api_version: $describe"
	[ "$described" = "$version" ] || die "$name built as $version describes itself as version ${described:-none}: $describe"
	grep -q '"\(builders\|provisioners\|post_processors\|datasources\)":\["' <<<"$describe" ||
		die "$name describe lists no component: $describe"
	local stage=$work/packer-plugin files=()
	mkdir -p "$stage"
	for platform in $platforms; do
		local os=${platform%/*} arch=${platform#*/}
		local binary=${name}_v${version}_${api}_${os}_${arch}
		build "$pkg" "$stage/$binary" "$ldflags" "$os" "$arch"
		archive "$dist/$binary.zip" "$stage/$binary"
		files+=("$binary.zip")
		rm "$stage/$binary"
	done
	sums "$dist/${name}_v${version}_SHA256SUMS" "${files[@]}"
}

for p in "${products[@]}"; do
	case $p in
	provider) release_provider ;;
	packer-plugin) release_packer_plugin ;;
	esac
done
(cd "$dist" && ls -l) >&2
echo "$dist"
