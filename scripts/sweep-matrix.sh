#!/usr/bin/env bash
# Runs the whole sweep matrix into one folder and plots it: for 2 and 4 ranks on loopback, every
# collective (all_reduce, broadcast, all_gather, reduce_scatter), f32 sum, 8 B to 256 MiB in
# steps of x4:
#   ours      collectives_perf --local N                        -> local_N.csv
#   ours+MPI  mpirun ... collectives_perf --baseline mpi, Open MPI on TCP too (btl tcp,self),
#             when collectives_perf is built with MPI and mpirun exists -> mpirun_N.csv
#   Gloo      gloo_perf --local N (no reduce_scatter in Gloo), when it is built (libgloo-dev)
#                                                               -> gloo_N.csv
# then bench/plot_sweep.py draws busbw_<collective>.png next to the CSVs. Each run's console
# output is kept as <name>.log; info.txt records the machine and the settings.
#
#   scripts/sweep-matrix.sh [OUT_DIR]          default out/matrix-<date>-<time>
#
# Environment:
#   QUICK=1               stop at 64 MiB instead of 256 MiB
#   RANKS="2 4"           world sizes
#   ITERS=20 WARMUP=5     timed / warm-up calls per size up to 1 MiB
#   LARGE_ITERS=10 LARGE_WARMUP=3  the same from 4 MiB up, where calls are long
#   COLLECTIVES_BUILD_DIR (default build)   as for scripts/build.sh
# Each size range is one run per (implementation, world size); the small and large runs are
# joined into one CSV. Builds collectives_perf and gloo_perf first (scripts/build.sh). Exits
# non-zero if any run failed; the others still run and are plotted.
set -euo pipefail
# OUT_DIR as given, resolved against the caller's folder before the cd below (not an OUT that
# happens to be in the environment).
OUT=""
if [[ $# -ge 1 ]]; then OUT=$(realpath -m -- "$1"); fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."

QUICK=${QUICK:-0}
RANKS=${RANKS:-2 4}
ITERS=${ITERS:-20}
WARMUP=${WARMUP:-5}
LARGE_ITERS=${LARGE_ITERS:-10}
LARGE_WARMUP=${LARGE_WARMUP:-3}
OUT=${OUT:-out/matrix-$(date +%Y%m%d-%H%M%S)}
BUILD_DIR=${COLLECTIVES_BUILD_DIR:-build}
COLLECTIVES=all_reduce,broadcast,all_gather,reduce_scatter

SMALL=(-b 8 -e 1M -f 4)                                 # 8 B, 32 B, ..., 512 KiB
if [[ ${QUICK} == 1 ]]; then
  LARGE=(-b 4M -e 64M -f 4)                             # 4, 16, 64 MiB
else
  LARGE=(-b 4M -e 256M -f 4)                            # 4, 16, 64, 256 MiB
fi

# ---- Build ------------------------------------------------------------------------------------
COLLECTIVES_BUILD_TARGETS=collectives_perf scripts/build.sh
PERF=${BUILD_DIR}/bench/collectives_perf
GLOO_PERF=${BUILD_DIR}/bench/gloo_perf
# gloo_perf exists as a target only where CMake found Gloo.
# (The list is read whole: grep -q would stop reading at the match, and the writer's SIGPIPE
# would fail the pipeline under pipefail.)
if grep -q '^gloo_perf:' <<<"$(cmake --build "${BUILD_DIR}" --target help)"; then
  cmake --build "${BUILD_DIR}" -j"$(nproc)" --target gloo_perf
else
  echo "sweep-matrix: gloo_perf is not built (libgloo-dev missing): no Gloo lines"
  GLOO_PERF=
fi
MPIRUN=()
if grep -q '^COLLECTIVES_WITH_MPI:BOOL=ON' "${BUILD_DIR}/CMakeCache.txt" &&
  command -v mpirun >/dev/null; then
  # shellcheck disable=SC2054  # "tcp,self" is one argument
  MPIRUN=(mpirun --oversubscribe --mca btl tcp,self)
  if [[ $(id -u) -eq 0 ]]; then MPIRUN+=(--allow-run-as-root); fi
else
  echo "sweep-matrix: collectives_perf has no MPI (or mpirun is missing): no MPI lines"
fi

mkdir -p "${OUT}"
{
  echo "sweep matrix, $(date -Iseconds)"
  echo "host $(hostname), $(nproc) cores, $(uname -sr)"
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "ranks ${RANKS}; sizes ${SMALL[*]} (n=${ITERS} w=${WARMUP}) and ${LARGE[*]}" \
    "(n=${LARGE_ITERS} w=${LARGE_WARMUP}); f32 sum, out of place, loopback TCP"
  echo "mpi: ${MPIRUN[*]:-none}"
  echo "gloo: ${GLOO_PERF:-none}"
} >"${OUT}/info.txt"
cat "${OUT}/info.txt"

# ---- Runs -------------------------------------------------------------------------------------
failed=()

# run NAME COMMAND...: runs COMMAND twice (small sizes, then large) with --csv and the range
# flags appended, keeps the output in NAME.log and joins the two CSVs into NAME.csv.
run() {
  local name=$1
  shift
  local part ok=1 began=${SECONDS}
  echo "== ${name}: $*"
  : >"${OUT}/${name}.log"
  for part in small large; do
    local range=("${SMALL[@]}" -n "${ITERS}" -w "${WARMUP}")
    [[ ${part} == large ]] && range=("${LARGE[@]}" -n "${LARGE_ITERS}" -w "${LARGE_WARMUP}")
    if ! "$@" "${range[@]}" --csv "${OUT}/${name}.${part}.csv" >>"${OUT}/${name}.log" 2>&1; then
      echo "sweep-matrix: ${name} (${part} sizes) failed; see ${OUT}/${name}.log" >&2
      ok=0
    fi
  done
  [[ ${ok} == 1 ]] || failed+=("${name}")
  # Header once, then the rows of both parts (whatever was written before a failure).
  local first=1 file
  : >"${OUT}/${name}.csv"
  for file in "${OUT}/${name}.small.csv" "${OUT}/${name}.large.csv"; do
    [[ -s ${file} ]] || continue
    if [[ ${first} == 1 ]]; then cat "${file}"; else tail -n +2 "${file}"; fi >>"${OUT}/${name}.csv"
    first=0
    rm -f "${file}"
  done
  [[ -s ${OUT}/${name}.csv ]] || rm -f "${OUT}/${name}.csv"
  echo "   ${name}: $((SECONDS - began)) s"
}

start=${SECONDS}
for n in ${RANKS}; do
  run "local_${n}" "${PERF}" --local "${n}" -c "${COLLECTIVES}"
  if [[ ${#MPIRUN[@]} -gt 0 ]]; then
    run "mpirun_${n}" "${MPIRUN[@]}" -np "${n}" "${PERF}" -c "${COLLECTIVES}" --baseline mpi
  fi
  if [[ -n ${GLOO_PERF} ]]; then
    run "gloo_${n}" "${GLOO_PERF}" --local "${n}" -c all
  fi
done
echo "sweep-matrix: runs took $((SECONDS - start)) s"

# ---- Plots ------------------------------------------------------------------------------------
shopt -s nullglob
csvs=("${OUT}"/*.csv)
if [[ ${#csvs[@]} -gt 0 ]]; then
  bench/plot_sweep.py --out "${OUT}" "${csvs[@]}" || failed+=(plot)
else
  echo "sweep-matrix: no CSV was written" >&2
  failed+=(plot)
fi

echo "sweep-matrix: results in ${OUT}"
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "sweep-matrix: failed: ${failed[*]}" >&2
  exit 1
fi
