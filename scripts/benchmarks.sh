#!/usr/bin/env bash
# Measures the library against Open MPI with the project's own tools and writes the results page,
# docs/benchmarks.md, with its plots under docs/img/: the date, the machine, the commit, every
# command, one table per sweep and the speed-targets report. Meant to take under 10 minutes on 2
# cores; run it on an otherwise idle machine, or the figures measure the other work.
#
#   scripts/benchmarks.sh [OUT_DIR]        raw CSVs and logs; default out/benchmarks-<date>-<time>
#
# What it runs:
#   - all-reduce sweeps, 4 B to 64 MiB (x4), f32 sum, every result checked, for each rank count in
#     RANKS: AUTO (shared memory on this host) against Open MPI's default transport (shared
#     memory), and RING (TCP over loopback) against Open MPI over TCP (--mca btl tcp,self); both
#     libraries timed round for round on the same buffers (--baseline mpi, -r 3);
#   - scripts/speed-targets.sh with ROUNDS=1 (each target against its baseline).
# Environment:
#   RANKS (default "2 4")        rank counts of the sweeps
#   BENCH_QUICK=1                tiny sizes and one short round, no speed targets: checks that the
#                                script works; its figures mean nothing, and the page says so
#   BENCH_DOCS_DIR (default docs) where benchmarks.md and img/ go
#   BENCH_NO_BUILD=1             use the build as it is (speed-targets.sh still runs build.sh)
#   COLLECTIVES_BUILD_DIR (default build)
# Needs an MPI build of collectives_perf and mpirun, and Debian's python3 with matplotlib
# (/usr/bin/python3, whatever python3 comes first on PATH). Exits non-zero when a run failed or
# found a wrong element; the page is written anyway and names the failed runs.
set -euo pipefail
OUT=""
if [[ $# -ge 1 ]]; then OUT=$(realpath -m -- "$1"); fi
# BENCH_DOCS_DIR, like OUT_DIR, relative to the caller's folder; by default the repository's docs/.
DOCS=""
if [[ -n ${BENCH_DOCS_DIR:-} ]]; then DOCS=$(realpath -m -- "${BENCH_DOCS_DIR}"); fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DOCS=${DOCS:-$(pwd)/docs}

OUT=${OUT:-out/benchmarks-$(date +%Y%m%d-%H%M%S)}
BUILD_DIR=${COLLECTIVES_BUILD_DIR:-build}
RANKS=${RANKS:-2 4}
QUICK=${BENCH_QUICK:-0}
PYTHON=/usr/bin/python3
if [[ ! -x ${PYTHON} ]]; then
  echo "benchmarks: ${PYTHON} is missing (Debian: apt-get install python3 python3-matplotlib)" >&2
  exit 1
fi

# The commit measured, read before this script writes anything.
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
if [[ -n $(git status --porcelain --untracked-files=no 2>/dev/null) ]]; then
  commit="${commit} with uncommitted changes"
fi

if [[ ${BENCH_NO_BUILD:-0} != 1 ]]; then
  COLLECTIVES_BUILD_TARGETS="collectives_perf packing_perf kernels_bench" scripts/build.sh
fi
if ! grep -q '^COLLECTIVES_WITH_MPI:BOOL=ON' "${BUILD_DIR}/CMakeCache.txt" ||
  ! command -v mpirun >/dev/null; then
  echo "benchmarks: collectives_perf was built without MPI (or mpirun is missing)" >&2
  exit 1
fi
PERF=${BUILD_DIR}/bench/collectives_perf

if [[ ${QUICK} == 1 ]]; then
  SIZES=(-b 4 -e 64K -f 64 -n 3 -w 1 -r 1)
else
  SIZES=(-b 4 -e 64M -f 4 -n 20 -w 5 -r 3)
fi
MPIRUN=(mpirun --oversubscribe)
if [[ $(id -u) -eq 0 ]]; then MPIRUN+=(--allow-run-as-root); fi

mkdir -p "${OUT}" "${DOCS}/img"
failed=()
commands=()
# run NAME COMMAND...: runs COMMAND with its output in OUT/NAME.log; a failure is recorded.
run() {
  local name=$1
  shift
  local began=${SECONDS}
  commands+=("$*")
  echo "== ${name}: $*"
  if ! "$@" >"${OUT}/${name}.log" 2>&1; then
    echo "benchmarks: ${name} failed; see ${OUT}/${name}.log" >&2
    failed+=("${name}")
  fi
  echo "   ${name}: $((SECONDS - began)) s"
}

for n in ${RANKS}; do
  run "auto_${n}" "${MPIRUN[@]}" -np "${n}" "${PERF}" --impl auto -c all_reduce "${SIZES[@]}" \
    --baseline mpi --check --csv "${OUT}/auto_${n}.csv"
  # shellcheck disable=SC2054  # "tcp,self" is one argument
  run "ring_${n}" "${MPIRUN[@]}" --mca btl tcp,self -np "${n}" "${PERF}" --impl ring \
    -c all_reduce "${SIZES[@]}" --baseline mpi --check --csv "${OUT}/ring_${n}.csv"
done

if [[ ${QUICK} != 1 ]]; then
  commands+=("ROUNDS=1 scripts/speed-targets.sh ${OUT}/targets")
  echo "== speed targets"
  if ! ROUNDS=1 COLLECTIVES_BUILD_DIR="${BUILD_DIR}" \
    scripts/speed-targets.sh "${OUT}/targets" >"${OUT}/targets.log" 2>&1; then
    echo "benchmarks: speed targets failed; see ${OUT}/targets.log" >&2
    failed+=(speed-targets)
  fi
fi

# Plots: one per implementation, ours and Open MPI's busbw against size.
for impl in auto ring; do
  csvs=()
  for n in ${RANKS}; do
    [[ -s ${OUT}/${impl}_${n}.csv ]] && csvs+=("${OUT}/${impl}_${n}.csv")
  done
  [[ ${#csvs[@]} -gt 0 ]] || continue
  mkdir -p "${OUT}/plot_${impl}"
  if "${PYTHON}" bench/plot_sweep.py --out "${OUT}/plot_${impl}" "${csvs[@]}" \
    >"${OUT}/plot_${impl}.log" 2>&1; then
    cp "${OUT}/plot_${impl}/busbw_all_reduce.png" "${DOCS}/img/busbw_all_reduce_${impl}.png"
  else
    echo "benchmarks: plotting ${impl} failed; see ${OUT}/plot_${impl}.log" >&2
    failed+=("plot_${impl}")
  fi
done

cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
mpi_version=$(mpirun --version 2>/dev/null | head -1)
build_type=$(sed -n 's/^CMAKE_BUILD_TYPE:STRING=//p' "${BUILD_DIR}/CMakeCache.txt")

printf '%s\n' "${commands[@]}" >"${OUT}/commands.txt"
printf '%s\n' "${failed[@]+"${failed[@]}"}" >"${OUT}/failed.txt"
BENCH_DATE=$(date -u '+%Y-%m-%d %H:%M UTC') BENCH_CPU=${cpu} BENCH_CORES=$(nproc) \
  BENCH_KERNEL=$(uname -sr) BENCH_COMMIT=${commit} BENCH_MPI=${mpi_version} \
  BENCH_BUILD_TYPE=${build_type} BENCH_RANKS=${RANKS} BENCH_QUICK=${QUICK} \
  "${PYTHON}" - "${OUT}" "${DOCS}/benchmarks.md" <<'PY'
"""Writes benchmarks.md from the run folder."""
import csv
import os
import sys

out, page = sys.argv[1], sys.argv[2]
env = os.environ
ranks = env["BENCH_RANKS"].split()
quick = env["BENCH_QUICK"] == "1"


def lines(name):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [line.rstrip("\n") for line in f if line.strip()]


def size(n):
    n = int(n)
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def sweep_table(path):
    if not os.path.exists(path):
        return ["(no results: the run failed, see its log)"]
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    table = ["| size | ours (us) | ours busbw (GB/s) | Open MPI (us) | Open MPI busbw (GB/s) "
             "| ours / Open MPI | algorithm | wrong |",
             "|---:|---:|---:|---:|---:|---:|---|---:|"]
    for row in rows:
        def cell(column, digits):
            text = (row.get(column) or "").strip()
            try:
                return f"{float(text):.{digits}f}"
            except ValueError:
                return text or "-"
        table.append("| " + " | ".join([
            size(row["size_bytes"]), cell("time_us", 1), cell("busbw_gbps", 2),
            cell("mpi_time_us", 1), cell("mpi_busbw_gbps", 2),
            cell("time_ratio_ours_over_mpi", 2), row.get("algorithm") or "-",
            row.get("wrong") or "-"]) + " |")
    return table


# The run folder's path means nothing to a reader: OUT_DIR stands for it.
commands = [c.replace(out, "OUT_DIR") for c in lines("commands.txt")]
failed = lines("failed.txt")
doc = ["# Benchmarks", ""]
doc += ["Generated by `scripts/benchmarks.sh`; rerun it on an idle machine to refresh this page. "
        "Absolute figures do not travel between machines: compare the ratios, which are measured "
        "in the same run on the same buffers.", ""]
if quick:
    doc += ["**This page comes from a quick run (`BENCH_QUICK=1`: tiny sizes, one short round, "
            "no speed targets). It shows the page's form; its figures mean nothing.**", ""]
doc += ["| | |", "|---|---|",
        f"| date | {env['BENCH_DATE']} |",
        f"| machine | {env['BENCH_CPU']}, {env['BENCH_CORES']} cores, {env['BENCH_KERNEL']} |",
        f"| commit | `{env['BENCH_COMMIT']}` ({env['BENCH_BUILD_TYPE']} build) |",
        f"| baseline | {env['BENCH_MPI']} |", ""]
if failed:
    doc += ["**Failed runs:** " + ", ".join(failed) + " (their logs are in the run folder).", ""]

doc += ["## How to read the tables", "",
        "nccl-tests conventions: `size` is the bytes of the full result buffer; `time` is the "
        "slowest rank's time per call, the median of the alternating rounds; busbw = size / time "
        "x 2(n-1)/n for all-reduce; `ours / Open MPI` below 1 means this library is faster; "
        "`algorithm` is the all-reduce algorithm the library ran at that size; `wrong` counts "
        "result elements that differ from the exact answer (every run checks its results).", ""]

doc += ["## All-reduce in shared memory: AUTO against Open MPI", "",
        "Every rank on this host: AUTO runs in POSIX shared memory, Open MPI with its default "
        "transport (shared memory too). f32 sum, out of place.", ""]
doc += ["![AUTO and Open MPI: all-reduce busbw against size](img/busbw_all_reduce_auto.png)", ""]
for n in ranks:
    doc += [f"### {n} ranks", "", "```sh", next((c for c in commands if f"-np {n} " in c
                                               and "--impl auto" in c), "?"), "```", ""]
    doc += sweep_table(os.path.join(out, f"auto_{n}.csv")) + [""]

doc += ["## All-reduce over TCP: RING against Open MPI over TCP", "",
        "RING over loopback TCP against Open MPI restricted to TCP (`--mca btl tcp,self`). "
        "f32 sum, out of place.", "",
        "![RING and Open MPI over TCP: all-reduce busbw against size]"
        "(img/busbw_all_reduce_ring.png)", ""]
for n in ranks:
    doc += [f"### {n} ranks", "", "```sh", next((c for c in commands if f"-np {n} " in c
                                               and "--impl ring" in c), "?"), "```", ""]
    doc += sweep_table(os.path.join(out, f"ring_{n}.csv")) + [""]

doc += ["## Speed targets", ""]
summary = lines(os.path.join("targets", "summary.txt"))
if quick:
    doc += ["Not measured in a quick run.", ""]
elif not summary:
    doc += ["(no report: the run failed, see targets.log in the run folder)", ""]
else:
    doc += ["Each target against its baseline in the same run, one round "
            "(`ROUNDS=1 scripts/speed-targets.sh`; what each line measures is at the top of "
            "that script; `bench/speed_targets_report.py` prints the report):", "",
            "```"] + summary + ["```", ""]

doc += ["## Measuring more", "",
        "- `build/bench/collectives_perf` (`--help` lists every flag): the nccl-tests style "
        "sweep of all-reduce, broadcast, all-gather and reduce-scatter over sizes, dtypes and ops; "
        "`--local N` starts N ranks on this host, under `mpirun` it bootstraps through MPI and "
        "`--baseline mpi` times Open MPI on the same buffers; `--versus IMPL:ALGORITHM,...` times "
        "other configurations of this library round for round; `--pretend-hosts H` cuts the "
        "ranks into H pretend hosts, so AUTO plans as on H machines; `--check` verifies every "
        "element (exit status 2 on a wrong one); `--csv FILE` writes the rows. Columns: `time` "
        "(us, the slowest rank's), `algbw` = size / time, `busbw` = algbw x 2(n-1)/n for "
        "all-reduce, x (n-1)/n for all-gather and reduce-scatter, x 1 for broadcast.",
        "- PyTorch: [benchmarks-torch.md](benchmarks-torch.md), written by "
        "`scripts/torch-bench.sh` (`torch.distributed` through the backend against Gloo and the "
        "C++ sweep, DDP); `bench/torch_perf.py --nproc N` times every `torch.distributed` "
        "collective.",
        "- `scripts/sweep-matrix.sh [OUT_DIR]`: every collective at 2 and 4 ranks, 8 B to "
        "256 MiB, ours, ours against Open MPI over TCP, and Gloo (`build/bench/gloo_perf`), "
        "with one plot per collective.",
        "- `scripts/speed-targets.sh [OUT_DIR]` (`ROUNDS`, default 3): each speed target "
        "against its baseline; `bench/speed_targets_report.py OUT_DIR` prints the report again.",
        "- `build/bench/packing_perf --local N`: many tensors one call each against the packer "
        "(`--impl auto` for shared memory; `--compute-ms X` for overlap with computation).",
        "- `build/bench/kernels_bench`, `pack_bench`, `frame_bench`: Google Benchmark micro "
        "benchmarks of the reduction kernels (against memcpy), packing, and frame headers.",
        "- `bench/plot_sweep.py --out DIR a.csv ...`: busbw against size from any of the CSVs "
        "(Debian's `/usr/bin/python3`, which has matplotlib).",
        "- `scripts/emulated-cluster.sh --preset 10g|1g`: hosts as network namespaces with "
        "shaped links, AUTO against every fixed algorithm, Open MPI and Gloo; it writes the "
        "section \"Emulated clusters\" below ([emulated-cluster.md](emulated-cluster.md)).", "",
        "[tuning.md](tuning.md) has the measurements behind each default."]
# The section scripts/emulated-cluster.sh --docs writes is kept as it stands.
try:
    with open(page) as f:
        old = f.read()
    at = old.find("\n## Emulated clusters\n")
    if at >= 0:
        end = old.find("\n## ", at + 1)
        doc += [""] + old[at + 1:end if end >= 0 else len(old)].rstrip("\n").split("\n")
except OSError:
    pass

with open(page, "w") as f:
    f.write("\n".join(doc).rstrip("\n") + "\n")
print(f"benchmarks: wrote {page}")
PY

echo "benchmarks: raw results in ${OUT}"
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "benchmarks: failed: ${failed[*]}" >&2
  exit 1
fi
