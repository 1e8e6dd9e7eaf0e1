#!/usr/bin/env bash
# Runs one browser test file N times in a row against target/release/sluice and counts the
# passes; the output of each failed run is kept under target/repeat/. For intermittent
# failures: `scripts/repeat_browser_test.sh 30 e2e.test.mjs`.
set -uo pipefail
n=${1:?usage: $0 RUNS FILE.test.mjs}
file=${2:?usage: $0 RUNS FILE.test.mjs}
root=$(cd "$(dirname "$0")/.." && pwd)
logs=$root/target/repeat
mkdir -p "$logs"
pass=0
for i in $(seq 1 "$n"); do
  start=$(date +%s)
  if (cd "$root/tests/browser" && RUST_LOG=${RUST_LOG:-info} node --test --test-reporter=spec "$file") \
    > "$logs/run-$i.log" 2>&1; then
    pass=$((pass + 1))
    rm -f "$logs/run-$i.log"
    echo "run $i: pass ($(($(date +%s) - start)) s)"
  else
    echo "run $i: FAIL ($(($(date +%s) - start)) s), output in $logs/run-$i.log"
  fi
done
echo "passed $pass of $n"
[ "$pass" -eq "$n" ]
