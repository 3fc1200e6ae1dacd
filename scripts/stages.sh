#!/usr/bin/env bash
# Runs each make target named on the command line in turn, stops at the first that fails, and prints every
# stage's wall time at the end either way, so that a CI log says where its minutes went.
set -uo pipefail

make_cmd=${MAKE:-make}
names=()
times=()
results=()
total_start=$(date +%s)

report() {
	local i
	echo
	echo "stage times:"
	for i in "${!names[@]}"; do
		printf '  %-20s %6ss  %s\n' "${names[$i]}" "${times[$i]}" "${results[$i]}"
	done
	printf '  %-20s %6ss\n' total "$(( $(date +%s) - total_start ))"
}

for stage in "$@"; do
	start=$(date +%s)
	"$make_cmd" --no-print-directory "$stage"
	rc=$?
	names+=("$stage")
	times+=("$(( $(date +%s) - start ))")
	if [ "$rc" -ne 0 ]; then
		results+=("FAILED (exit $rc)")
		report
		exit "$rc"
	fi
	results+=(ok)
done
report
