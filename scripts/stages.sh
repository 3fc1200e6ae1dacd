#!/usr/bin/env bash
# Runs each make target named on the command line in turn, stops at the first that fails, and prints every
# stage's wall time at the end either way, so that a CI log says where its minutes went.
#
# usage: scripts/stages.sh [--background TARGET] STAGE...
#
# --background TARGET runs make TARGET beside the stages, from the end of the first stage (which installs
# what it needs), at the lowest CPU and I/O priority: it fills caches that later stages would otherwise fill
# in their own time, using the CPU that the stages leave idle (the lab's clusters mostly wait on real time).
# Its output goes to a log whose tail is printed if it fails; a failure costs nothing but time, because the
# stages build whatever is still missing themselves (every build script takes a lock on its cache).
set -uo pipefail

make_cmd=${MAKE:-make}
background=""
if [ "${1:-}" = "--background" ]; then
	background=$2
	shift 2
fi
names=()
times=()
results=()
total_start=$(date +%s)
bg_pid=""
bg_log=""
bg_start=0

finish_background() {
	[ -n "$bg_pid" ] || return 0
	local rc=0
	wait "$bg_pid" || rc=$?
	names+=("($background)")
	times+=("$(( $(date +%s) - bg_start ))")
	if [ "$rc" -eq 0 ]; then
		results+=("ok, beside the stages")
	elif [ "${1:-}" = stopped ]; then
		results+=("stopped when a stage failed")
	else
		results+=("FAILED (exit $rc), beside the stages; the stages built what they needed")
		echo "stages: make $background failed (exit $rc); the end of its log:"
		tail -n 30 "$bg_log"
	fi
	rm -f "$bg_log"
	bg_pid=""
}

report() {
	local i
	echo
	echo "stage times:"
	for i in "${!names[@]}"; do
		printf '  %-20s %6ss  %s\n' "${names[$i]}" "${times[$i]}" "${results[$i]}"
	done
	printf '  %-20s %6ss\n' total "$(( $(date +%s) - total_start ))"
}

start_background() {
	bg_log=$(mktemp)
	bg_start=$(date +%s)
	echo "stages: make $background runs beside the stages at the lowest priority (log: $bg_log)"
	nice -n 19 ionice -c 3 "$make_cmd" --no-print-directory "$background" >"$bg_log" 2>&1 &
	bg_pid=$!
}

for stage in "$@"; do
	start=$(date +%s)
	"$make_cmd" --no-print-directory "$stage"
	rc=$?
	names+=("$stage")
	times+=("$(( $(date +%s) - start ))")
	if [ "$rc" -ne 0 ]; then
		results+=("FAILED (exit $rc)")
		[ -z "$bg_pid" ] || kill "$bg_pid" 2>/dev/null
		finish_background stopped
		report
		exit "$rc"
	fi
	results+=(ok)
	if [ -n "$background" ] && [ -z "$bg_pid" ] && [ "$bg_start" -eq 0 ]; then
		start_background
	fi
done
finish_background
report
