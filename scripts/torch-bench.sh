#!/usr/bin/env bash
# Measures the PyTorch backend "collectives" against PyTorch's Gloo backend on this host and
# writes a Markdown section with the tables: all_reduce busbw at 1, 4, 16 and 64 MiB (AUTO and
# RING against Gloo, and against the C++ library measured by collectives_perf, the backend's
# overhead), 8-byte all_reduce latency, and DDP on Fashion-MNIST (samples/s against Gloo and
# against no gradient synchronisation, the best of interleaved short runs; test accuracy after
# one epoch; identical weights).
#
#   scripts/torch-bench.sh [OUT_DIR]     default out/torch-bench-<date>-<time>; the section is
#                                        OUT_DIR/benchmarks-torch.md, also printed
# Environment:
#   RANKS (default "2 4")          process counts
#   BENCH_QUICK=1                  small sizes and short DDP runs: checks that the script
#                                  works; its figures mean nothing
#   DDP_ROUNDS (default 2)         interleaved rounds of the DDP throughput runs
#   COLLECTIVES_BUILD_DIR (build)  the build with the torch backend (build/python) and
#                                  collectives_perf (-DCOLLECTIVES_BUILD_TORCH=ON
#                                  -DCOLLECTIVES_BUILD_BENCHMARKS=ON)
# Run it on an otherwise idle machine, or the figures measure the other work. Exits non-zero when
# a run failed or found a wrong element.
set -euo pipefail
OUT=""
if [[ $# -ge 1 ]]; then OUT=$(realpath -m -- "$1"); fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-out/torch-bench-$(date +%Y%m%d-%H%M%S)}
BUILD_DIR=$(realpath -m -- "${COLLECTIVES_BUILD_DIR:-build}")
RANKS=${RANKS:-2 4}
QUICK=${BENCH_QUICK:-0}
PYTHON=/usr/bin/python3
PERF=${BUILD_DIR}/bench/collectives_perf
export PYTHONPATH=${BUILD_DIR}/python${PYTHONPATH:+:${PYTHONPATH}}
mkdir -p "${OUT}"

if [[ ! -x ${PERF} ]]; then
  echo "torch-bench: ${PERF} is missing: cmake --build ${BUILD_DIR} --target collectives_perf" >&2
  exit 2
fi
if ! ${PYTHON} -c "import collectives.torch" 2>"${OUT}/import.log"; then
  echo "torch-bench: cannot import collectives.torch from ${BUILD_DIR}/python:" >&2
  cat "${OUT}/import.log" >&2
  exit 2
fi

if [[ ${QUICK} == 1 ]]; then
  BIG=(-b 64K -e 256K -f 4) DDP_EPOCH=(--steps 15) DDP_SPEED=(--steps 15) TIME=0.02
  DDP_ROUNDS=${DDP_ROUNDS:-1}
else
  BIG=(-b 1M -e 64M -f 4) DDP_EPOCH=(--epochs 1) DDP_SPEED=(--steps 60) TIME=0.3
  DDP_ROUNDS=${DDP_ROUNDS:-2}
fi
failed=0
run() {  # run LOG COMMAND...: the command's output to LOG and the terminal; notes a failure
  local log=$1
  shift
  echo "\$ $*" | tee "${OUT}/${log}"
  if ! "$@" 2>&1 | tee -a "${OUT}/${log}"; then
    echo "torch-bench: FAILED: $*" >&2
    failed=1
  fi
}

for n in ${RANKS}; do
  run "torch_all_reduce_n${n}.log" ${PYTHON} bench/torch_perf.py --nproc "${n}" -c all_reduce \
    "${BIG[@]}" --time "${TIME}" -r 3 --jobs 2 --backends collectives:auto,collectives:ring,gloo \
    --csv "${OUT}/torch_all_reduce_n${n}.csv"
  run "torch_latency_n${n}.log" ${PYTHON} bench/torch_perf.py --nproc "${n}" -c all_reduce \
    -b 8 -e 8 --time "${TIME}" --max-iters 5000 -r 3 --jobs 2 \
    --backends collectives:auto,collectives:ring,gloo --csv "${OUT}/torch_latency_n${n}.csv"
  for impl in auto ring; do
    run "cpp_${impl}_n${n}.log" "${PERF}" --local "${n}" --impl "${impl}" -c all_reduce \
      "${BIG[@]}" -r 3 --inplace --check --csv "${OUT}/cpp_${impl}_n${n}.csv"
    run "cpp_latency_${impl}_n${n}.log" "${PERF}" --local "${n}" --impl "${impl}" -c all_reduce \
      -b 8 -e 8 -n 1000 -r 3 --inplace --check --csv "${OUT}/cpp_latency_${impl}_n${n}.csv"
  done
  for backend in collectives gloo; do
    run "ddp_${backend}_n${n}.log" ${PYTHON} examples/python/ddp_fashion_mnist.py --nproc "${n}" \
      --backend "${backend}" "${DDP_EPOCH[@]}" --json "${OUT}/ddp_${backend}_n${n}.json"
  done
done
# Throughput: short runs, the three variants interleaved so that they share the machine's state.
for n in ${RANKS}; do
  for round in $(seq "${DDP_ROUNDS}"); do
    for variant in collectives gloo nosync; do
      flags=(--backend "${variant}")
      if [[ ${variant} == nosync ]]; then flags=(--backend collectives --no-sync); fi
      run "ddp_speed_${variant}_n${n}_r${round}.log" ${PYTHON} examples/python/ddp_fashion_mnist.py \
        --nproc "${n}" "${flags[@]}" "${DDP_SPEED[@]}" \
        --json "${OUT}/ddp_speed_${variant}_n${n}_r${round}.json"
    done
  done
done

{
  echo "## PyTorch backend"
  echo
  echo "Measured $(date -u '+%Y-%m-%d %H:%M UTC') on $(hostname), $(nproc) cores,"\
    "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown);"\
    "torch $(${PYTHON} -c 'import torch; print(torch.__version__)'),"\
    "$(${PYTHON} --version)$([[ ${QUICK} == 1 ]] && echo '; BENCH_QUICK=1: the figures mean nothing')."
  echo
  ${PYTHON} - "${OUT}" "${RANKS}" <<'EOF'
import csv, json, os, sys
out, ranks = sys.argv[1], [int(n) for n in sys.argv[2].split()]

def rows(name):
    path = os.path.join(out, name)
    return list(csv.DictReader(open(path))) if os.path.exists(path) else []

def busbw(table, size, backend=None):
    for r in table:
        if int(r["size_bytes"]) == size and (backend is None or r["backend"] == backend) \
                and r.get("busbw_gbps"):
            return float(r["busbw_gbps"]), float(r["time_us"])
    return None, None

def f(x, spec):
    return format(x, spec) if x is not None else "n/a"

def ratio(a, b):
    return a / b if a is not None and b else None

print("all_reduce, float32 sum, busbw in GB/s (time: the slowest rank's). torch: "
      "`bench/torch_perf.py`, each backend in its own job; C++: `collectives_perf --local N` "
      "(the same library without torch). AUTO/Gloo and RING/Gloo: busbw ratios (> 1: faster "
      "than Gloo); torch/C++: the backend's busbw over the C++ library's (1: no overhead).")
print()
print("| procs | size | torch AUTO | torch RING | Gloo | AUTO/Gloo | RING/Gloo | C++ AUTO | "
      "C++ RING | torch/C++ AUTO | torch/C++ RING |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for n in ranks:
    t = rows(f"torch_all_reduce_n{n}.csv")
    ca, cr = rows(f"cpp_auto_n{n}.csv"), rows(f"cpp_ring_n{n}.csv")
    for size in sorted({int(r["size_bytes"]) for r in t}):
        a, _ = busbw(t, size, "collectives:auto")
        r, _ = busbw(t, size, "collectives:ring")
        g, _ = busbw(t, size, "gloo")
        xa, _ = busbw(ca, size)
        xr, _ = busbw(cr, size)
        print(f"| {n} | {size >> 20 if size >= 1 << 20 else size} {'MiB' if size >= 1 << 20 else 'B'} "
              f"| {f(a, '.3f')} | {f(r, '.3f')} | {f(g, '.3f')} | {f(ratio(a, g), '.2f')} "
              f"| {f(ratio(r, g), '.2f')} | {f(xa, '.3f')} | {f(xr, '.3f')} "
              f"| {f(ratio(a, xa), '.2f')} | {f(ratio(r, xr), '.2f')} |")
print()
print("8-byte all_reduce latency in µs (the slowest rank's mean); Gloo/ours: how many times "
      "faster than Gloo.")
print()
print("| procs | torch AUTO | torch RING | Gloo | Gloo/AUTO | Gloo/RING | C++ AUTO | C++ RING |")
print("|---|---|---|---|---|---|---|---|")
for n in ranks:
    t = rows(f"torch_latency_n{n}.csv")
    _, a = busbw(t, 8, "collectives:auto")
    _, r = busbw(t, 8, "collectives:ring")
    _, g = busbw(t, 8, "gloo")
    _, xa = busbw(rows(f"cpp_latency_auto_n{n}.csv"), 8)
    _, xr = busbw(rows(f"cpp_latency_ring_n{n}.csv"), 8)
    print(f"| {n} | {f(a, '.1f')} | {f(r, '.1f')} | {f(g, '.1f')} | {f(ratio(g, a), '.2f')} "
          f"| {f(ratio(g, r), '.2f')} | {f(xa, '.1f')} | {f(xr, '.1f')} |")
print()
def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None

print("DDP on Fashion-MNIST (`examples/python/ddp_fashion_mnist.py`: MLP 784-256-256-10, Adam "
      "1e-3, global batch 256, one thread per process). Throughput: samples/s over the steps "
      "after the first 10, the best of the interleaved rounds; no sync: DDP's no_sync(), the "
      "bound without gradient synchronisation.")
print()
print("| procs | run | samples/s | of no sync | of gloo | runs |")
print("|---|---|---|---|---|---|")
for n in ranks:
    best = {}
    for variant in ("collectives", "gloo", "nosync"):
        speeds = [r["samples_per_second"] for k in range(1, 100)
                  for r in [load(f"ddp_speed_{variant}_n{n}_r{k}.json")] if r]
        best[variant] = (max(speeds) if speeds else None, len(speeds),
                         (load(f"ddp_speed_{variant}_n{n}_r1.json") or {}).get("steps"))
    for variant, label in (("collectives", "collectives"), ("gloo", "gloo"), ("nosync", "no sync")):
        v, count, steps = best[variant]
        print(f"| {n} | {label} | {f(v, '.0f')} | {f(ratio(v, best['nosync'][0]), '.2f')} "
              f"| {f(ratio(v, best['gloo'][0]), '.2f')} | {count} x {steps} steps |")
print()
print("Test accuracy after training (10000 test examples), the weights compared bit for bit "
      "over every rank.")
print()
print("| procs | backend | steps | test accuracy | weights identical |")
print("|---|---|---|---|---|")
for n in ranks:
    for backend in ("collectives", "gloo"):
        r = load(f"ddp_{backend}_n{n}.json")
        if r is None:
            print(f"| {n} | {backend} | failed | | |")
            continue
        print(f"| {n} | {backend} | {r['steps']} | {r['test_accuracy']:.4f} "
              f"| {'yes' if r['weights_identical'] else 'NO'} |")
EOF
  echo
  echo "Commands (RANKS=\"${RANKS}\"): \`scripts/torch-bench.sh\`, which runs, per process count N:"
  echo
  echo '```'
  grep -h '^\$ ' "${OUT}"/*.log | sed "s|${BUILD_DIR}/|build/|g; s|${OUT}/|OUT/|g" | awk '!seen[$0]++'
  echo '```'
} > "${OUT}/benchmarks-torch.md"
cat "${OUT}/benchmarks-torch.md"
if grep -q "^torch_perf: FAIL" "${OUT}"/*.log; then failed=1; fi
exit "${failed}"
