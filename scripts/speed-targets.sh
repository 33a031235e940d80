#!/usr/bin/env bash
# Measures each speed target below against its baseline in the same run, ROUNDS
# times, and prints one line per target with every round's figure, the median and whether the
# median meets it:
#   all-reduce 1, 16, 64 MiB, 2 and 4 ranks: our time / MPI_Allreduce's over TCP <= 1.0
#   all-reduce 8 B, 2 ranks:                  our time / MPI_Allreduce's <= 1.2
#   broadcast, all-gather 1 and 16 MiB, 2 and 4 ranks: our time / MPI's <= 1.0
#   f32 sum kernel:                           bytes per second / memcpy's >= 0.70, in place (as
#                                             the algorithms call it) and out of place, with the
#                                             compiler's plain loop and a loop that only reads
#                                             the three buffers beside it (kernels_bench)
#   1000 x 4 KiB f32 packed, 4 ranks:         one call per tensor / packed >= 10 (packing_perf)
#   256 MiB all-reduce in place, 4 ranks:     peak resident memory of a rank <= tensor + 32 MiB
# MPI runs over loopback TCP (--mca btl tcp,self); each collectives_perf run alternates our
# rounds and MPI's (-r) and reports the medians. Rounds are whole passes over every target, so
# a slow minute of the machine lands in one round, not in one target.
#
#   scripts/speed-targets.sh [OUT_DIR]         default out/targets-<date>-<time>
#
# Environment: ROUNDS (default 3); COLLECTIVES_BUILD_DIR (default build). Writes each run's
# CSV / JSON / log and summary.txt into OUT_DIR. Exits non-zero if a run failed or a run is not
# possible (no MPI); a missed target is reported, not an error.
set -euo pipefail
# OUT_DIR as given, resolved against the caller's folder before the cd below (not an OUT that
# happens to be in the environment).
OUT=""
if [[ $# -ge 1 ]]; then OUT=$(realpath -m -- "$1"); fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."

ROUNDS=${ROUNDS:-3}
OUT=${OUT:-out/targets-$(date +%Y%m%d-%H%M%S)}
BUILD_DIR=${COLLECTIVES_BUILD_DIR:-build}

COLLECTIVES_BUILD_TARGETS="collectives_perf packing_perf kernels_bench" scripts/build.sh
if ! grep -q '^COLLECTIVES_WITH_MPI:BOOL=ON' "${BUILD_DIR}/CMakeCache.txt" ||
  ! command -v mpirun >/dev/null; then
  echo "speed-targets: collectives_perf was built without MPI (or mpirun is missing);" \
    "the MPI baselines cannot be measured" >&2
  exit 1
fi
PERF=${BUILD_DIR}/bench/collectives_perf
# shellcheck disable=SC2054  # "tcp,self" is one argument
MPIRUN=(mpirun --oversubscribe --mca btl tcp,self)
if [[ $(id -u) -eq 0 ]]; then MPIRUN+=(--allow-run-as-root); fi

mkdir -p "${OUT}"
{
  echo "speed targets, $(date -Iseconds)"
  echo "host $(hostname), $(nproc) cores, $(uname -sr)"
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "rounds ${ROUNDS}; mpi: ${MPIRUN[*]}"
} >"${OUT}/info.txt"
cat "${OUT}/info.txt"

failed=()
# step NAME COMMAND...: runs COMMAND, output to NAME.log; a failure is recorded, not fatal.
step() {
  local name=$1
  shift
  local began=${SECONDS}
  if ! "$@" >"${OUT}/${name}.log" 2>&1; then
    echo "speed-targets: ${name} failed; see ${OUT}/${name}.log" >&2
    failed+=("${name}")
  fi
  echo "   ${name}: $((SECONDS - began)) s"
}

for round in $(seq 1 "${ROUNDS}"); do
  echo "== round ${round} of ${ROUNDS}"
  for n in 2 4; do
    step "r${round}_all_reduce_${n}" "${MPIRUN[@]}" -np "${n}" "${PERF}" --impl ring \
      -c all_reduce -b 1M -e 64M -f 4 -n 10 -w 3 -r 7 --inplace --baseline mpi --check \
      --csv "${OUT}/r${round}_all_reduce_${n}.csv"
    # A 1 MiB call lasts a fraction of a millisecond: more calls per round, more rounds.
    step "r${round}_bcast_gather_1M_${n}" "${MPIRUN[@]}" -np "${n}" "${PERF}" --impl ring \
      -c broadcast,all_gather -b 1M -e 1M -n 100 -w 3 -r 21 --inplace --baseline mpi --check \
      --csv "${OUT}/r${round}_bcast_gather_1M_${n}.csv"
    step "r${round}_bcast_gather_16M_${n}" "${MPIRUN[@]}" -np "${n}" "${PERF}" --impl ring \
      -c broadcast,all_gather -b 16M -e 16M -n 10 -w 3 -r 21 --inplace --baseline mpi --check \
      --csv "${OUT}/r${round}_bcast_gather_16M_${n}.csv"
  done
  step "r${round}_all_reduce_8B_2" "${MPIRUN[@]}" -np 2 "${PERF}" --impl ring \
    -c all_reduce -b 8 -e 8 -n 2000 -w 100 -r 7 --baseline mpi --check \
    --csv "${OUT}/r${round}_all_reduce_8B_2.csv"
  step "r${round}_kernels" "${BUILD_DIR}/bench/kernels_bench" \
    --benchmark_filter='BM_Memcpy|BM_PlainF32Add|BM_ReadThreeF32|ReduceBench/f32_sum|ReduceInPlaceBench/f32_sum' \
    --benchmark_repetitions=5 --benchmark_min_time=0.2 --benchmark_report_aggregates_only=true \
    --benchmark_out="${OUT}/r${round}_kernels.json" --benchmark_out_format=json
  step "r${round}_packing" "${BUILD_DIR}/bench/packing_perf" --local 4 --workload 1000x4K \
    --bytes-per-pack 1M -n 20 --check --csv "${OUT}/r${round}_packing.csv"
  # GNU time prints each rank's peak resident set (KiB) on its own line.
  step "r${round}_memory" "${MPIRUN[@]}" -np 4 /usr/bin/time -f "peak_rss_kib %M" "${PERF}" \
    --impl ring -c all_reduce -b 256M -e 256M -n 2 -w 1 --inplace
done

summary_ok=1
bench/speed_targets_report.py "${OUT}" | tee "${OUT}/summary.txt" || summary_ok=0
[[ ${summary_ok} == 1 ]] || failed+=(report)
echo "speed-targets: results in ${OUT}"
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "speed-targets: failed: ${failed[*]}" >&2
  exit 1
fi
