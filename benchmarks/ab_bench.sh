#!/usr/bin/env bash
# A/B timing on the GPU machine: builds <old_git_rev> and this working tree side by side (bf16,
# (E,K,N) weights, sm90 families only: what the bench times), then times both on the public bench
# cases in alternating rounds (old,new / new,old / ...) with benchmarks/ab_bench.py, and summarizes
# per case and runner (auto, moe, grouped): each build's median, its spread over the rounds, new/old
# and a REGRESSION verdict. Build logs go to $OUT/ab_build_{old,new}.log (OUT defaults to
# ./device_out), the runs' progress to $OUT/ab_run.log, the table to $OUT/ab_summary.txt, and the
# rounds' JSON files, once summarized, into $OUT/ab_rounds.json (the device tool brings back at
# most 8 files; AB_KEEP_ROUNDS=1 keeps the per-round $OUT/ab_{old,new}_r<N>.json too).
# Exits 0, 3 if the summary found a regression, 1 if a build or a run failed, 2 on bad usage.
#
# To run (from the repo root of the new checkout, carrying .whl):
#   bash benchmarks/ab_bench.sh <old_git_rev> [rounds=3]
#   Env: OLD_SRC=/path an already-extracted old source tree (then <old_git_rev> only names it);
#        AB_ARGS extra ab_bench.py options, e.g. "--cases dsv3-prefill,dsv3-decode", "--passes 1" or
#             "--wgrad" (the weight gradient instead of the forward);
#        AB_JOBS compile jobs per build (default: half the cores, as the two builds run at once).
set -uo pipefail
export PYTHONUNBUFFERED=1
usage="usage: bash benchmarks/ab_bench.sh <old_git_rev> [rounds=3]   (env: OLD_SRC, AB_ARGS, AB_JOBS, OUT)"
case "${1:-}" in
  -h|--help) echo "$usage"; exit 0 ;;
  "") echo "$usage"; exit 2 ;;
esac
rev=$1
rounds=${2:-3}
if ! [[ "$rounds" =~ ^[1-9][0-9]*$ ]]; then echo "$usage"; exit 2; fi
src=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$src" || exit 1
OUT=${OUT:-device_out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
rm -f "$OUT"/ab_old_r*.json "$OUT"/ab_new_r*.json "$OUT/ab_rounds.json" "$OUT/ab_run.log"
git_() { git -c safe.directory='*' -C "$src" "$@"; }

# ---- the two source trees -------------------------------------------------------------------------
if [ -n "${OLD_SRC:-}" ]; then
  old_src=$(cd "$OLD_SRC" && pwd) || exit 2
  old_label="$rev ($old_src)"
else
  sha=$(git_ rev-parse --verify --quiet "$rev^{commit}") || {
    echo "ab_bench.sh: no revision '$rev' in $src/.git (set OLD_SRC=/path to an extracted old tree)"; exit 2; }
  old_src=/tmp/ab_old_src
  rm -rf "$old_src" && mkdir -p "$old_src"
  git_ archive "$sha" | tar -x -C "$old_src" || { echo "ab_bench.sh: git archive $sha failed"; exit 1; }
  old_label="$(git_ log -1 --format='%h' "$sha")"
  echo "old: $rev = $(git_ log -1 --format='%h %s' "$sha" | cut -c1-100)"
fi
new_label="$(git_ log -1 --format='%h' HEAD 2>/dev/null || echo '?')+worktree"
echo "new: working tree at $(git_ log -1 --format='%h %s' HEAD 2>/dev/null | cut -c1-80)," \
     "$(git_ status --porcelain 2>/dev/null | wc -l) changed paths"

# The CUTLASS headers: the carried wheel, unless they are installed already.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps .whl/*.whl || exit 1
elif ! python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('cutlass_library') is None)"; then
  echo "ab_bench.sh: no .whl/*.whl (carry .whl) and no nvidia-cutlass installed"; exit 1
fi

# ---- the two builds, at once ----------------------------------------------------------------------
jobs=${AB_JOBS:-$(( ($(nproc) + 1) / 2 ))}
defines=(-C cmake.define.CUTLASS_MOE_DTYPES=kBFloat16 -C cmake.define.CUTLASS_MOE_WEIGHT_LAYOUTS=kKN
         -C cmake.define.CUTLASS_MOE_SM80_CONFIGS=)
build() {  # build NAME TREE: into /tmp/ab_NAME, build folder TREE/build/ab-NAME
  local name=$1 tree=$2 start rc
  start=$(date +%s)
  rm -rf "/tmp/ab_$name"  # pip --target does not replace an existing package
  CMAKE_BUILD_PARALLEL_LEVEL=$jobs python3 -m pip install -v --no-index --no-deps --no-build-isolation \
    --target "/tmp/ab_$name" -C build-dir="build/ab-$name" "${defines[@]}" "$tree" >"$OUT/ab_build_$name.log" 2>&1
  rc=$?
  echo "$(( $(date +%s) - start ))" >"/tmp/ab_build_$name.seconds"
  return $rc
}
echo "building old ($old_src) and new ($src) at once, $jobs jobs each..."
build old "$old_src" & pid_old=$!
build new "$src" & pid_new=$!
wait $pid_old; rc_old=$?
wait $pid_new; rc_new=$?
build_failed=0
for name in old new; do
  rc=$rc_old; [ $name = new ] && rc=$rc_new
  log="$OUT/ab_build_$name.log"
  echo "build $name: $(cat "/tmp/ab_build_$name.seconds" 2>/dev/null || echo '?') s, exit $rc;" \
       "ptxas warnings: $(grep -c 'ptxas warning' "$log"); C7510: $(grep -c C7510 "$log")"
  if [ "$rc" != 0 ]; then tail -40 "$log"; build_failed=1; fi
done
[ $build_failed = 0 ] || exit 1

# ---- alternating rounds ---------------------------------------------------------------------------
run_failed=0
for round in $(seq 1 "$rounds"); do
  if (( round % 2 )); then order="old new"; else order="new old"; fi
  for name in $order; do
    label=$old_label; [ $name = new ] && label=$new_label
    start=$(date +%s)
    # From /tmp, with the build on PYTHONPATH: neither the source tree nor another install is imported
    # (ab_bench.py checks cutlass_moe.__file__ against --expect-dir). Both builds time the new tree's
    # cases.json.
    (cd /tmp && PYTHONPATH="/tmp/ab_$name" python3 "$src/benchmarks/ab_bench.py" --label $name --rev "$label" \
       --expect-dir "/tmp/ab_$name" --cases-json "$src/python/cutlass_moe/cases.json" \
       --json "$OUT/ab_${name}_r$round.json" ${AB_ARGS:-}) >>"$OUT/ab_run.log" 2>&1
    rc=$?
    echo "round $round $name: exit $rc, $(( $(date +%s) - start )) s;" \
         "$(grep -o 'cutlass_moe from .*' "$OUT/ab_run.log" | tail -1)"
    if [ $rc != 0 ]; then run_failed=1; tail -n 3 "$OUT/ab_run.log" | cut -c1-200 | sed 's/^/  /'; fi
  done
done

# ---- summary --------------------------------------------------------------------------------------
shopt -s nullglob
jsons=("$OUT"/ab_old_r*.json "$OUT"/ab_new_r*.json)
shopt -u nullglob
if [ ${#jsons[@]} = 0 ]; then
  echo "ab_bench.sh: no run wrote its JSON; see $OUT/ab_run.log"; tail -20 "$OUT/ab_run.log"; exit 1
fi
merge=(--merge-into "$OUT/ab_rounds.json")
python3 "$src/benchmarks/ab_bench.py" --summarize "${jsons[@]}" --summary-out "$OUT/ab_summary.txt" "${merge[@]}"
rc=$?
if [ -z "${AB_KEEP_ROUNDS:-}" ] && [ -s "$OUT/ab_rounds.json" ]; then rm -f "${jsons[@]}"; fi
if [ $rc != 0 ]; then exit $rc; fi
exit $run_failed
