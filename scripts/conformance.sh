#!/usr/bin/env bash
# Kubernetes' conformance suite against the lab's cluster, as `make conformance` runs it: e2e.test built from
# the Kubernetes version the lab runs (scripts/build-e2e.sh), the images it lists made here and loaded into
# every node (berth-lab e2e-images), then the [Conformance] tests that may run side by side, on
# CONFORMANCE_PROCS ginkgo processes, then the [Serial] and [Disruptive] ones alone: the two
# [Conformance] tests so labelled taint a node and need nothing else; most other [Disruptive] tests reboot
# nodes over SSH, which lab nodes do not serve, so a focus that selects them fails them. Reports (JUnit,
# ginkgo's JSON) go to
# LAB_DIR/conformance; the summary line of each run is printed at the end.
#
# usage: scripts/conformance.sh LAB_DIR BIN_DIR
#   CONFORMANCE_FOCUS  a regular expression of the tests to run ([Conformance] by default)
#   CONFORMANCE_SKIP   a regular expression of tests to leave out as well
#   CONFORMANCE_PROCS  parallel processes for the non-serial tests (4; the tests mostly wait, so more
#                      than the CPUs pay off)
#   CONFORMANCE_TIMEOUT  how long each of the two runs may take (3h); at the end ginkgo stops the run and
#                      still writes its reports, the unfinished tests counted as interrupted
set -euo pipefail

dir=$1 bin=$2
repo=$(cd "$(dirname "$0")/.." && pwd)
focus=${CONFORMANCE_FOCUS:-'\[Conformance\]'}
procs=${CONFORMANCE_PROCS:-4}
timeout=${CONFORMANCE_TIMEOUT:-3h}

e2e=$("$repo/scripts/build-e2e.sh")
k8s_source=$(go -C "$repo/test/k8stools" list -m -f '{{.Dir}}' k8s.io/kubernetes)
"$bin/berth-lab" e2e-images --dir "$dir" --e2e-bin "$e2e" --k8s-source "$k8s_source"

report=$dir/conformance
rm -rf "$report"
mkdir -p "$report"
export KUBE_TEST_REPO_LIST=$dir/e2e-images/repo-list.yaml
suite=(--kubeconfig="$dir/admin.conf" --provider=skeleton --report-dir="$report")
status=0
run() {
	local name=$1
	shift
	echo "conformance: $name" >&2
	"$e2e/ginkgo" --focus="$focus" ${CONFORMANCE_SKIP:+--skip="$CONFORMANCE_SKIP"} --timeout="$timeout" \
		--output-dir="$report" --junit-report="junit_$name.xml" --json-report="$name.json" --no-color --silence-skips "$@" \
		"$e2e/e2e.test" -- "${suite[@]}" 2>&1 | tee "$report/$name.log" || status=1
}
# The suite labels its specs as it names them ([Serial], [Disruptive]): the labels select without regex
# pitfalls, and the focus stays free for CONFORMANCE_FOCUS.
run parallel --procs="$procs" --label-filter='!Serial && !Disruptive'
run serial --label-filter='Serial || Disruptive'
for name in parallel serial; do
	echo "conformance, $name:" >&2
	sed -n -e '/^Summarizing [0-9]* Failure/,/^Ran /p' -e '/^\(SUCCESS\|FAIL\)! --/p' "$report/$name.log" >&2
done
exit $status
