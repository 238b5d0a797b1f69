#!/usr/bin/env bash
# One batch on the GPU machine: install the CUTLASS wheel carried in .whl/, build, run the tests
# (benchmarks/run_tests.sh: pytest processes in parallel, per file and per package-building test), the
# benchmark and the host time per call (training_bench.py --parts host). Logs go to $OUT (or
# ./device_out).
#
# To run (from the device tool, carrying .whl): bash benchmarks/device_run.sh [pytest args...]
#   Env: BUILD_DEFINES="-C cmake.define.X=Y ..." extra build options; BENCH_ARGS extra bench options;
#        SKIP_TESTS=1, SKIP_BENCH=1, SANITIZE=1 (benchmarks/sanitize.sh: memcheck, initcheck, synccheck
#        and racecheck over every built kernel).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-device_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
python3 -m pip install -q --no-index --no-deps .whl/*.whl || exit 1
start=$(date +%s)
# One build folder per set of build options: CMake caches -D values, so a folder reused with other
# options would silently keep the old instance table.
build_dir="build/device-$(echo "${BUILD_DEFINES:-default}" | md5sum | cut -c1-8)"
if ! python3 -m pip install --no-index --no-deps --no-build-isolation -v -C build-dir="$build_dir" \
    ${BUILD_DEFINES:-} . >"$OUT/build.log" 2>&1; then
  tail -60 "$OUT/build.log"; exit 1
fi
echo "build: $(( $(date +%s) - start )) s; ptxas warnings: $(grep -c 'ptxas warning' "$OUT/build.log"); C7510: $(grep -c C7510 "$OUT/build.log")"
if [ -z "${SKIP_TESTS:-}" ]; then
  OUT="$OUT" bash benchmarks/run_tests.sh "$@"  # pytest processes in parallel (its header says which)
fi
cd /tmp  # import the installed package, not the source tree
src=$OLDPWD
if [ -n "${SANITIZE:-}" ]; then
  (cd "$src" && OUT="$OUT" bash benchmarks/sanitize.sh)  # from the repo root, like the build
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  python3 "$src/benchmarks/training_bench.py" --parts host 2>&1 | tee "$OUT/host_overhead.log"
  python3 -m cutlass_moe.bench --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>"$OUT/bench.err" | tee "$OUT/bench.log"
  tail -3 "$OUT/bench.err"
fi
