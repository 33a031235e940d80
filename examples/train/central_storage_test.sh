#!/usr/bin/env bash
# ctest train_central_storage_matches_mirrored*: one short epoch of the demo with
# CentralStorageStrategy and with MirroredStrategy, the same replicas and global batch, then
#   - central_storage reports num_replicas_in_sync = the local replica count (one worker), and
#   - the saved weights agree within 1e-5 relative (+ 1e-7 absolute), compared by
#     compare_weights.py (Debian's python3 with numpy).
#
#   central_storage_test.sh TRAIN REPLICAS [ARGS...]
#
# ARGS go to both runs; CENTRAL_STORAGE_TEST_EXTRA (words) to the central_storage run only,
# to check that a real difference fails. Exit status: 0 when both hold, 1 otherwise (saying which),
# 2 on a bad command line.
set -u
if [[ $# -lt 2 ]]; then
  echo "usage: central_storage_test.sh TRAIN REPLICAS [ARGS...]" >&2
  exit 2
fi
train=$1
replicas=$2
shift 2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "${work}"' EXIT
read -r -a extra <<<"${CENTRAL_STORAGE_TEST_EXTRA:-}"

# `env -u`: the runs are one worker each, whatever the caller's environment says.
run() {
  env -u TF_CONFIG -u RANK -u WORLD_SIZE -u OMPI_COMM_WORLD_SIZE "${train}" "$@"
}
central=$(run --strategy central_storage --replicas "${replicas}" "$@" "${extra[@]}" \
  --save-weights "${work}/central.bin" 2>&1)
rc=$?
printf '%s\n' "${central}"
if [[ ${rc} -ne 0 ]]; then
  echo "FAIL: central_storage exited with ${rc}"
  exit 1
fi
mirrored=$(run --strategy mirrored --replicas "${replicas}" "$@" \
  --save-weights "${work}/mirrored.bin" 2>&1)
rc=$?
printf '%s\n' "${mirrored}"
if [[ ${rc} -ne 0 ]]; then
  echo "FAIL: mirrored exited with ${rc}"
  exit 1
fi
want="strategy: central_storage, ${replicas} replica"
if ! grep -q "^${want}s\? in sync (${replicas} local x 1 worker)" <<<"${central}"; then
  echo "FAIL: central_storage does not report ${replicas} replicas in sync on 1 worker"
  exit 1
fi
/usr/bin/python3 "${here}/compare_weights.py" "${work}/central.bin" "${work}/mirrored.bin" || exit 1
echo "ok: central_storage and mirrored agree, ${replicas} replicas in sync"
