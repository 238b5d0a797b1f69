#!/usr/bin/env bash
# The test suite against the installed package, one pytest process per test file, all at once; each
# file's output, then a line per file, in $OUT/tests.log. Returns non-zero if any file failed.
#
# Why in parallel: most of the suite's time is Inductor's and AOTInductor's compiles, which use one
# CPU core each. On the H200 machine (16 cores) the files in one process ran past 420 s once
# AOTInductor's tests stopped skipping (benchmarks/NOTES.md, forty-sixth session); in parallel the
# suite takes about as long as its longest file. The files share the GPU: no test times anything.
#
# To run, from the repository root: bash benchmarks/run_tests.sh [pytest args...]
#   (device_run.sh runs it after the build).
set -uo pipefail
OUT=$(realpath -m "${OUT:-device_out}")
mkdir -p "$OUT"
src=$PWD
logs=$(mktemp -d)
files=("$src"/tests/test_*.py)
# Each process's Inductor would start a pool of compile workers as large as the machine: share the
# cores among the files instead.
threads=$(( $(nproc) / ${#files[@]} ))
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-$(( threads > 0 ? threads : 1 ))}
cd /tmp  # import the installed package, not the source tree
for file in "${files[@]}"; do
  name=$(basename "$file" .py)
  (python3 -m pytest -q -p no:cacheprovider -rfEs "$file" "$@" >"$logs/$name.log" 2>&1
   echo "exit code $?" >>"$logs/$name.log") &
done
wait
status=0
: >"$OUT/tests.log"
for log in "$logs"/*.log; do
  { echo "==== $(basename "$log" .log)"; cat "$log"; } >>"$OUT/tests.log"
done
for log in "$logs"/*.log; do
  summary=$(grep -E "^=* ?([0-9]+ (passed|failed|skipped|errors?|deselected)|no tests ran)" "$log" | tail -1)
  code=$(tail -1 "$log")
  # pytest's exit code 5: no test collected (a file whose tests all need what this machine lacks)
  [ "$code" = "exit code 0" ] || [ "$code" = "exit code 5" ] || status=1
  echo "$(basename "$log" .log): ${summary:-?} ($code)" | tee -a "$OUT/tests.log"
done
grep -hE "^(FAILED|ERROR) " "$logs"/*.log | head -40
rm -rf "$logs"
exit $status
