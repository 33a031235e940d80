#!/usr/bin/env bash
# The one-command check of the GPU paths on a machine with an NVIDIA GPU (at most about 8 minutes
# on one GPU): builds with CUDA and NCCL, runs every test labelled `gpu` on the real device
# (COLLECTIVES_REQUIRE_GPU=1: a test that finds no device fails rather than skips), runs the NCCL
# all-reduce sweep beside raw NCCL (--baseline nccl; busbw ratio at 64 MiB and above, target
# within 5%), the staged RING and AUTO sweeps with --check, and the training demo on GPU
# replicas (--device gpu: two replicas when there are two GPUs, one otherwise; 300 steps, test
# accuracy at least 0.75, identical weights on the replicas); then prints a summary.
#
# Exit status: 0 every step passed; 1 a step failed (the summary names it); 77 no usable GPU here
# (no nvidia-smi, or it lists no device): nothing was run.
#
# Environment: COLLECTIVES_BUILD_DIR (default build-gpu), CUDA_HOME (default /usr/local/cuda),
# JOBS (default: the cores), COLLECTIVES_GPU_CHECK_LOG (default $COLLECTIVES_BUILD_DIR/gpu-check),
# COLLECTIVES_NVIDIA_SMI (default nvidia-smi: the command that lists the GPUs). Extra arguments
# go to CMake. Each step has a time cap; the build and the steps take a few minutes on one GPU.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

readonly kNoGpu=77
smi=${COLLECTIVES_NVIDIA_SMI:-nvidia-smi}
if ! command -v "$smi" >/dev/null 2>&1; then
  echo "gpu-check: no $smi on PATH: this machine has no usable NVIDIA driver; nothing run (exit $kNoGpu)"
  exit "$kNoGpu"
fi
gpus=$("$smi" --query-gpu=name --format=csv,noheader 2>/dev/null | grep -c . || true)
if [[ "${gpus:-0}" -lt 1 ]]; then
  echo "gpu-check: $smi lists no GPU: nothing run (exit $kNoGpu)"
  exit "$kNoGpu"
fi

build=${COLLECTIVES_BUILD_DIR:-build-gpu}
cuda=${CUDA_HOME:-/usr/local/cuda}
jobs=${JOBS:-$(nproc)}
log=${COLLECTIVES_GPU_CHECK_LOG:-$build/gpu-check}
mkdir -p "$log"
export LD_LIBRARY_PATH="$cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export COLLECTIVES_REQUIRE_GPU=1

declare -a summary=()
failed=0
note() { summary+=("$1"); echo "gpu-check: $1"; }
pass() { note "PASS  $1"; }
fail() { note "FAIL  $1"; failed=1; }
skip() { note "SKIP  $1"; }
# Why the last command failed, from its exit status: timeout's 124 is a passed time cap.
why() { if [[ $1 -eq 124 ]]; then echo "timed out"; else echo "exit status $1"; fi; }
started=$(date +%s)

echo "gpu-check: $gpus GPU(s):"
"$smi" --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | sed 's/^/  /'

# ---- Build ----
if cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCOLLECTIVES_WITH_NCCL=ON \
     -DCUDAToolkit_ROOT="$cuda" -DCOLLECTIVES_BUILD_TESTS=ON -DCOLLECTIVES_BUILD_BENCHMARKS=ON \
     -DCOLLECTIVES_BUILD_PYTHON=OFF -DCOLLECTIVES_BUILD_TORCH=OFF "$@" >"$log/configure.txt" 2>&1 &&
   cmake --build "$build" -j"$jobs" --target nccl_test staged_test c_api_cuda_test gpu_strategy_test collectives_perf \
     >"$log/build.txt" 2>&1; then
  pass "build with NCCL ($build; $(grep -o 'loaded at run time from [^)]*' "$log/configure.txt" | head -1))"
else
  fail "build with NCCL (see $log/configure.txt, $log/build.txt)"
  printf '\ngpu-check summary\n'; printf '  %s\n' "${summary[@]}"
  exit 1
fi
perf="$build/bench/collectives_perf"

# ---- Every GPU-labelled test on the real device (not the fake's entries) ----
if (cd "$build" && timeout 180 ctest -L gpu -LE fake_nccl --output-on-failure -j1 \
      --timeout 120) >"$log/ctest-gpu.txt" 2>&1; then
  pass "ctest -L gpu: $(grep -Eo '[0-9]+% tests passed, [0-9]+ tests failed out of [0-9]+' "$log/ctest-gpu.txt")"
else
  fail "ctest -L gpu (see $log/ctest-gpu.txt): $(grep -Eo '[0-9]+ tests failed out of [0-9]+' "$log/ctest-gpu.txt")"
fi

# ---- NCCL beside raw NCCL: all-reduce busbw at 64 MiB and above ----
# One rank per GPU. busbw = bytes / time x 2(n-1)/n for both, so their ratio is the inverse
# ratio of the times; on one GPU busbw is 0 by definition and the time ratio stands in.
if timeout 120 "$perf" --local "$gpus" --impl nccl --device cuda --baseline nccl -c all_reduce \
     -b 64M -e 512M -f 2 -n 20 -w 5 -r 3 --check --timeout 120 --csv "$log/nccl.csv" \
     >"$log/nccl.txt" 2>&1; then
  worst=$(awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
    $(col["size_bytes"]) >= 67108864 && $(col["nccl_time_us"]) != "" {
      r = $(col["nccl_time_us"]) / $(col["time_us"]); if (min == "" || r < min) min = r }
    END { if (min == "") print "none"; else printf "%.3f", min }' "$log/nccl.csv")
  if [[ "$worst" == "none" ]]; then
    fail "NCCL sweep: no rows of 64 MiB and above with a baseline (see $log/nccl.txt)"
  elif awk -v r="$worst" 'BEGIN { exit !(r >= 0.95) }'; then
    pass "NCCL all_reduce vs raw NCCL, 64-512 MiB on $gpus GPU(s): worst busbw ratio $worst (target >= 0.95)"
  else
    fail "NCCL all_reduce vs raw NCCL, 64-512 MiB on $gpus GPU(s): worst busbw ratio $worst (target >= 0.95; see $log/nccl.txt)"
  fi
else
  fail "NCCL sweep beside --baseline nccl: $(why $?) (see $log/nccl.txt)"
fi

# ---- The staged RING (and AUTO) on CUDA tensors, checked at every size ----
# Two ranks share the first GPU when there is one (the staged ring allows it; NCCL does not, so
# AUTO stages them there too; with a GPU per rank AUTO runs NCCL inside the host).
ranks=$(( gpus >= 2 ? gpus : 2 ))
if timeout 200 "$perf" --local "$ranks" --impl ring --device cuda -c all -d all -o sum,avg \
     -b 1 -e 64M -f 4 -n 3 -w 1 --check --timeout 120 --csv "$log/ring.csv" \
     >"$log/ring.txt" 2>&1; then
  pass "staged RING sweep on CUDA tensors, $ranks ranks, 1 B - 64 MiB, every collective and dtype: checked, no wrong elements; $(grep -Eo 'average busbw: .*' "$log/ring.txt")"
else
  fail "staged RING sweep: $(why $?) (see $log/ring.txt)"
fi
if timeout 60 "$perf" --local "$ranks" --impl auto --device cuda --inplace -c all -d f32,bf16 \
     -b 1K -e 16M -f 8 -n 3 -w 1 --check --timeout 60 >"$log/auto.txt" 2>&1; then
  pass "AUTO sweep on CUDA tensors (in place), $ranks ranks: checked, no wrong elements"
else
  fail "AUTO sweep: $(why $?) (see $log/auto.txt)"
fi

# ---- The demo on GPU replicas: two when there are two GPUs, one otherwise ----
# MirroredStrategy over CUDA devices (NCCL between the replicas, cuBLAS for the products), the
# short run of ctest train_short_run_accuracy: 300 steps of global batch 128 must reach a test
# accuracy of at least 0.75 on 2000 test examples, with identical weights on the replicas.
replicas=$(( gpus >= 2 ? 2 : 1 ))
demo="$build/examples/train/train"
if cmake --build "$build" -j"$jobs" --target train >"$log/build-demo.txt" 2>&1 && [[ -x "$demo" ]]; then
  timeout 180 "$demo" --strategy mirrored --device gpu --replicas "$replicas" \
    --global-batch 128 --epochs 1 --max-steps-per-epoch 300 --test-limit 2000 \
    --quiet-progress >"$log/demo.txt" 2>&1
  rc=$?
  if [[ $rc -eq 0 ]]; then
    accuracy=$(sed -n 's/^test loss: [0-9.]* - test accuracy: \([0-9.]*\) .*/\1/p' "$log/demo.txt")
    speed=$(grep -Eo '^throughput: [0-9]+ samples/s' "$log/demo.txt" | head -1)
    if [[ -z "$accuracy" ]]; then
      fail "demo on $replicas GPU replica(s): no test accuracy in its output (see $log/demo.txt)"
    elif ! awk -v a="$accuracy" 'BEGIN { exit !(a >= 0.75) }'; then
      fail "demo on $replicas GPU replica(s): test accuracy $accuracy after 300 steps, below 0.75 (see $log/demo.txt)"
    elif [[ $replicas -gt 1 ]] &&
         ! grep -q "^weights: identical on all $replicas replicas" "$log/demo.txt"; then
      fail "demo on $replicas GPU replicas: the replicas' weights differ (see $log/demo.txt)"
    elif [[ $replicas -gt 1 ]] && ! grep -q "cross-device ops nccl" "$log/demo.txt"; then
      fail "demo on $replicas GPU replicas: not reduced with cross-device ops nccl (see $log/demo.txt)"
    else
      pass "demo on $replicas GPU replica(s): test accuracy $accuracy after 300 steps (>= 0.75)${speed:+, $speed}"
    fi
  elif grep -q 'fashion_mnist: ' "$log/demo.txt"; then
    skip "demo: no Fashion-MNIST data here ($(grep -m1 -o 'fashion_mnist: .*' "$log/demo.txt"))"
  else
    fail "demo on $replicas GPU replica(s): $(why $rc) (see $log/demo.txt)"
  fi
else
  skip "demo: not built here (see $log/build-demo.txt)"
fi

elapsed=$(( $(date +%s) - started ))
printf '\ngpu-check summary (%d GPU(s), %d s, logs in %s)\n' "$gpus" "$elapsed" "$log"
printf '  %s\n' "${summary[@]}"
exit "$failed"
