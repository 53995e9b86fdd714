#!/usr/bin/env bash
# Measures flakiness: runs the tests N times and prints every test that
# failed at least once, with its failure count. No retries: a test that
# fails once in N is a defect to find (docs/testing.md, "Flakes").
#
#   scripts/flakes.sh N [nextest filterset]
#   scripts/flakes.sh 10 'test(/^cluster::fault_handoff::/)'
#   scripts/flakes.sh 3                       # the whole suite, three times
#
# Builds once; each run's JUnit is kept in target/nextest/flakes/run-K.xml.
# Needs what the tests selected need (the whole suite: root, runsc, the
# emulator and the images; run scripts/test.sh once first).
set -euo pipefail
cd "$(dirname "$0")/.."

runs=${1:?usage: scripts/flakes.sh N [nextest filterset]}
filter=${2:-all()}
case "$runs" in ''|*[!0-9]*) echo "error: N must be a number, not '$runs'" >&2; exit 2;; esac
export FUZZ_SECS="${FUZZ_SECS:-20}"

out=target/nextest/flakes
rm -rf "$out" && mkdir -p "$out"
cargo nextest run --workspace --all-features --no-run
for k in $(seq 1 "$runs"); do
  started=$(date +%s)
  status=0
  cargo nextest run --workspace --all-features --profile ci -E "$filter" >"$out/run-$k.log" 2>&1 || status=$?
  mv target/nextest/ci/junit.xml "$out/run-$k.xml"
  echo "run $k of $runs: exit $status, $(( $(date +%s) - started )) s"
done

python3 - "$out" "$runs" <<'PY'
import glob, sys, xml.etree.ElementTree as ET
from collections import Counter
out, runs = sys.argv[1], int(sys.argv[2])
failed, seen = Counter(), Counter()
for path in sorted(glob.glob(f"{out}/run-*.xml")):
    for suite in ET.parse(path).getroot().iter("testsuite"):
        for case in suite.iter("testcase"):
            key = f"{suite.get('name')} {case.get('name')}"
            seen[key] += 1
            # nextest writes a flaky or failed test with <failure>/<error> or
            # <flakyFailure> (retries are off, so only the first two occur).
            if any(case.find(tag) is not None for tag in ("failure", "error", "flakyFailure", "rerunFailure")):
                failed[key] += 1
print(f"== {len(seen)} tests, {runs} runs")
if not failed:
    print("no test failed in any run")
else:
    print("tests that failed at least once (failures/runs):")
    for key, count in failed.most_common():
        print(f"  {count}/{seen[key]}  {key}")
sys.exit(1 if failed else 0)
PY
