#!/usr/bin/env bash
# The test suite against the installed package, one pytest process per test file, all at once, and one
# more per test that compiles ahead of time; each process's output, then a line per process, in
# $OUT/tests.log. Returns non-zero if any process failed.
#
# Why in parallel: most of the suite's time is Inductor's and AOTInductor's compiles, which use one
# CPU core each. On the H200 machine (16 cores) the files in one process ran past 420 s once
# AOTInductor's tests stopped skipping (benchmarks/NOTES.md, forty-sixth session). With one process
# per file the suite took as long as its slowest file, 393 s (test_autograd.py, whose AOTInductor
# tests compile one package after another). So the tests that build a package (SPLIT_K, a pytest -k
# expression: the AOTInductor tests and the examples, which export and package too) run in processes
# of their own, and each file's other tests in one process: about 300 s there (the call 411 s with its
# build, against 517 s), the eight package tests taking 250-290 s each side by side (forty-seventh
# session). The processes share the GPU: no test times anything.
#
# To run, from the repository root: bash benchmarks/run_tests.sh [pytest args...]
#   (device_run.sh runs it after the build). With pytest args (e.g. -k), one process per file only.
set -uo pipefail
OUT=$(realpath -m "${OUT:-device_out}")
mkdir -p "$OUT"
src=$PWD
logs=$(mktemp -d)
files=("$src"/tests/test_*.py)
SPLIT_K=${SPLIT_K:-aoti or example}
cd /tmp  # import the installed package, not the source tree
split_ids=()
if [ $# -eq 0 ] && [ -n "$SPLIT_K" ]; then
  # Node ids relative to the rootdir, which is $src (its pyproject.toml holds the pytest settings).
  mapfile -t split_ids < <(python3 -m pytest --collect-only -q -p no:cacheprovider -k "$SPLIT_K" "$src/tests" 2>/dev/null |
                           grep '::')
fi
# The package-building tests' compiler (tests/conftest.py, aoti_compiler), probed once here instead of
# in each of their processes (a probe compiles a package or two). Without an answer each process probes.
if [ ${#split_ids[@]} -gt 0 ] && [ -z "${CUTLASS_MOE_TEST_AOTI_COMPILER:-}" ]; then
  CUTLASS_MOE_TEST_AOTI_COMPILER=$(python3 -c "import sys; sys.path.insert(0, sys.argv[1]); import conftest
print(conftest.aoti_compiler_answer())" "$src/tests" 2>"$logs/aoti_compiler_probe.err" | tail -1)
  echo "AOTInductor compiler for the tests: ${CUTLASS_MOE_TEST_AOTI_COMPILER:-(the probe failed: each test probes)}"
  [ -n "$CUTLASS_MOE_TEST_AOTI_COMPILER" ] || tail -5 "$logs/aoti_compiler_probe.err"
  export CUTLASS_MOE_TEST_AOTI_COMPILER
fi
# Each process's Inductor would start a pool of compile workers as large as the machine: share the
# cores among the processes instead.
jobs=$(( ${#files[@]} + ${#split_ids[@]} ))
threads=$(( $(nproc) / jobs ))
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-$(( threads > 0 ? threads : 1 ))}
run() {  # run LOG_NAME PYTEST_ARGS...: one pytest process in the background, its exit code last in its log
  local log="$logs/$1.log"
  shift
  (python3 -m pytest -q -p no:cacheprovider -rfEs "$@" >"$log" 2>&1; echo "exit code $?" >>"$log") &
}
for file in "${files[@]}"; do
  if [ ${#split_ids[@]} -gt 0 ]; then
    run "$(basename "$file" .py)" "$file" -k "not ($SPLIT_K)"
  else
    run "$(basename "$file" .py)" "$file" "$@"
  fi
done
for id in "${split_ids[@]}"; do
  run "$(basename "${id%%::*}" .py)::$(printf '%s' "${id#*::}" | tr -c 'A-Za-z0-9_.-' '_')" "$src/$id"
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
  # pytest's exit code 5: no test collected or all deselected (a file whose tests all need what this
  # machine lacks, or whose tests all run in processes of their own)
  [ "$code" = "exit code 0" ] || [ "$code" = "exit code 5" ] || status=1
  echo "$(basename "$log" .log): ${summary:-?} ($code)" | tee -a "$OUT/tests.log"
done
grep -hE "^(FAILED|ERROR) " "$logs"/*.log | head -40
rm -rf "$logs"
exit $status
