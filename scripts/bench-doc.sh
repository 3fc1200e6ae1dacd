#!/usr/bin/env bash
# Puts the tables make bench measured into docs/benchmarks.md, between its "make bench: begin" and "make bench:
# end" markers, under a line naming the machine, the date and the command; the prose around them is written
# by hand and stays.
#   scripts/bench-doc.sh <tables.md> <doc.md> <command>
set -euo pipefail
tables=$1 doc=$2 command=$3
begin='<!-- make bench: begin -->'
end='<!-- make bench: end -->'
grep -qxF "$begin" "$doc" && grep -qxF "$end" "$doc" || { echo "bench-doc: $doc has no '$begin' / '$end' markers" >&2; exit 1; }
[ -s "$tables" ] || { echo "bench-doc: $tables is empty: did the benchmarks run?" >&2; exit 1; }

cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)
mem=$(awk '/^MemTotal:/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)
os=$(. /etc/os-release && echo "$PRETTY_NAME")
versions=$(basename "$(dirname "$(scripts/build-k8s.sh 2>/dev/null)")") # v1.36.3-etcd-v3.6.8
header=$(mktemp)
trap 'rm -f "$header"' EXIT
{
	echo "**Machine**: $(nproc) vCPUs ($cpu), $mem, $os, $(go env GOVERSION); kube-apiserver ${versions%-etcd-*} and"
	echo "etcd ${versions#*-etcd-} built from their modules, on the same machine. **Date**: $(date -u +%F). **Command**:"
	echo "\`$command\`."
	echo
	cat "$tables"
} >"$header"
awk -v begin="$begin" -v end="$end" -v header="$header" '
	$0 == begin { print; print ""; while ((getline line < header) > 0) print line; print ""; skip = 1; next }
	$0 == end { skip = 0 }
	!skip { print }
' "$doc" >"$doc.new"
mv "$doc.new" "$doc"
echo "bench-doc: $doc updated"
