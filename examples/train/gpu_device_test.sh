#!/usr/bin/env bash
# ctest fake_nccl:train_gpu_replicas_match_cpu*: one short epoch of the demo on CPU replicas and
# on GPU replicas (--device gpu), the same replicas, batch and seed, then
#   - the GPU run reports its replicas in sync with cross-device ops nccl, and ends with
#     identical weights on every replica, and
#   - the saved weights agree with the CPU run's within 1e-4 relative + 1e-6 absolute
#     (compare_weights.py, Debian's python3 with numpy): cuBLAS sums the products in another
#     order than Eigen, so the bits differ, by about 1e-7 after 20 steps.
# Run with LD_LIBRARY_PATH naming the CPU stand-in of tests/nccl/fake (or on a GPU machine).
#
#   gpu_device_test.sh TRAIN REPLICAS [ARGS...]
#
# ARGS go to both runs; GPU_DEVICE_TEST_EXTRA (words) to the GPU run only, to check that a real
# difference fails. Exit status: 0 when both hold, 1 otherwise (saying which), 2 on a bad
# command line.
set -u
if [[ $# -lt 2 ]]; then
  echo "usage: gpu_device_test.sh TRAIN REPLICAS [ARGS...]" >&2
  exit 2
fi
train=$1
replicas=$2
shift 2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "${work}"' EXIT
read -r -a extra <<<"${GPU_DEVICE_TEST_EXTRA:-}"

run() {
  env -u TF_CONFIG -u RANK -u WORLD_SIZE -u OMPI_COMM_WORLD_SIZE "${train}" \
    --strategy mirrored --replicas "${replicas}" "$@"
}
cpu=$(run "$@" --save-weights "${work}/cpu.bin" 2>&1)
rc=$?
printf '%s\n' "${cpu}"
if [[ ${rc} -ne 0 ]]; then
  echo "FAIL: the CPU run exited with ${rc}"
  exit 1
fi
gpu=$(run --device gpu "$@" "${extra[@]}" --save-weights "${work}/gpu.bin" 2>&1)
rc=$?
printf '%s\n' "${gpu}"
if [[ ${rc} -ne 0 ]]; then
  echo "FAIL: the GPU run exited with ${rc}"
  exit 1
fi
if ! grep -q "^strategy: mirrored, ${replicas} replicas in sync .*cross-device ops nccl" <<<"${gpu}"; then
  echo "FAIL: the GPU run does not report ${replicas} replicas in sync with cross-device ops nccl"
  exit 1
fi
if ! grep -q "^weights: identical on all ${replicas} replicas" <<<"${gpu}"; then
  echo "FAIL: the GPU replicas do not end with identical weights"
  exit 1
fi
/usr/bin/python3 "${here}/compare_weights.py" "${work}/cpu.bin" "${work}/gpu.bin" \
  --rtol 1e-4 --atol 1e-6 || exit 1
echo "ok: ${replicas} GPU replicas and ${replicas} CPU replicas agree"
