#!/usr/bin/env bash
# compute-sanitizer over every built kernel (benchmarks/sanitize_sweep.py): memcheck and initcheck
# over the full sweep, synccheck and racecheck over one small ragged call per kernel (both are slow
# on the TMA/WGMMA kernels), then memcheck over the CUDA-graph step alone with PyTorch's caching
# allocator. The other runs set PYTORCH_NO_CUDA_MEMORY_CACHING=1, so the sanitizer sees each tensor
# as its own allocation (no out-of-bounds access hidden inside a cached block, no "initialized" bytes
# left over from a freed tensor); a capture cannot allocate then, and the grouped families allocate
# their workspace inside it, hence the extra graph run. Each run has its own time limit.
# Logs: $OUT/sanitize_<run>.log (OUT defaults to ./device_out). Prints one summary line per run;
# exits 1 if any run reported errors (sanitizer errors, wrong results, a crash), else 2 if one ran
# out of time, else 0.
#
# To run (from the repo root, after the package is installed): bash benchmarks/sanitize.sh
#   Env: SANITIZE_KERNELS=substr[,substr] only the kernels whose built_configs() name holds one;
#        SANITIZE_RUNS="memcheck initcheck synccheck racecheck graph" a subset, in that order.
set -uo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;; esac
export PYTHONUNBUFFERED=1
src=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-device_out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
if ! command -v compute-sanitizer >/dev/null; then
  echo "sanitize.sh: compute-sanitizer not found (it ships with the CUDA toolkit: \$CUDA_HOME/bin)"; exit 1
fi
echo "sanitize.sh: $(compute-sanitizer --version | grep -m1 -i version)"
cd /tmp  # import the installed package, not the source tree
sweep="$src/benchmarks/sanitize_sweep.py"
kernel_args=()
[ -n "${SANITIZE_KERNELS:-}" ] && kernel_args=(--kernels "$SANITIZE_KERNELS")

failed=0
timed_out=0
# run_one NAME LIMIT_S CACHING(on|off) SANITIZER_ARGS... -- SWEEP_ARGS...
run_one() {
  local name=$1 limit=$2 caching=$3
  shift 3
  local san=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do san+=("$1"); shift; done
  shift
  local log="$OUT/sanitize_$name.log" env_args=() start rc
  [ "$caching" = off ] && env_args=(PYTORCH_NO_CUDA_MEMORY_CACHING=1)
  start=$(date +%s)
  # timeout signals the whole process group: compute-sanitizer and the python it runs.
  env ${env_args[@]+"${env_args[@]}"} timeout -k 15 "$limit" \
    compute-sanitizer "${san[@]}" --error-exitcode 9 --print-limit 20 \
    python3 "$sweep" "$@" ${kernel_args[@]+"${kernel_args[@]}"} >"$log" 2>&1
  rc=$?
  local secs=$(( $(date +%s) - start ))
  # memcheck/initcheck/synccheck end with "ERROR SUMMARY: N errors", racecheck with
  # "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)".
  local summary errors sweep_line verdict
  summary=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$log" | tail -1 | sed 's/^=* *//')
  errors=$(echo "$summary" | grep -oE '(SUMMARY: |\()[0-9]+ error' | grep -oE '[0-9]+' | tail -1)
  sweep_line=$(grep -E "^sanitize_sweep: " "$log" | tail -1 | cut -c1-160)
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    verdict="TIMEOUT after ${limit} s (incomplete)"
    timed_out=1
    [ -n "$errors" ] && [ "$errors" != 0 ] && { verdict="ERRORS, then timed out"; failed=1; }
  elif [ "$rc" = 0 ] && [ "${errors:-0}" = 0 ]; then
    verdict="clean"
  else
    case $rc in
      9) verdict="SANITIZER ERRORS" ;;
      1) verdict="WRONG RESULTS" ;;
      2) verdict="NOTHING RAN" ;;
      *) verdict="FAILED" ;;
    esac
    failed=1
  fi
  printf '%-10s exit %-3s %4s s  %-32s %s\n' "$name" "$rc" "$secs" "$verdict" "${summary:-no SUMMARY line}"
  [ -n "$sweep_line" ] && printf '%-10s %s\n' "" "$sweep_line"
  if [ "$verdict" != clean ]; then  # the first findings, the rest are in the log
    grep -E "^========= (Invalid|Uninitialized|Error|ERROR:|Race|Barrier|Program hit|Warning)|^FAIL " "$log" \
      | head -4 | cut -c1-200 | sed 's/^/           /'
    [ "$rc" != 0 ] && [ "$rc" != 9 ] && [ "$rc" != 1 ] && tail -3 "$log" | cut -c1-200 | sed 's/^/           /'
  fi
  return 0
}

for run in ${SANITIZE_RUNS:-memcheck initcheck synccheck racecheck graph}; do
  case $run in
    memcheck)  run_one memcheck 120 off --tool memcheck -- --mode full ;;
    # initcheck's default does not report unused allocations (out's NaN rows no expert owns).
    initcheck) run_one initcheck 120 off --tool initcheck -- --mode full ;;
    # synccheck and racecheck are slow on the TMA/WGMMA kernels: one small ragged call per kernel.
    synccheck) run_one synccheck 80 off --tool synccheck -- --mode small ;;
    racecheck) run_one racecheck 150 off --tool racecheck -- --mode small ;;
    graph)     run_one graph 60 on --tool memcheck -- --mode graph ;;
    *) echo "sanitize.sh: unknown run '$run' (memcheck initcheck synccheck racecheck graph)"; failed=1 ;;
  esac
done
echo "logs: $OUT/sanitize_*.log"
if [ "$failed" = 1 ]; then exit 1; fi
if [ "$timed_out" = 1 ]; then exit 2; fi
exit 0
