#!/usr/bin/env bash
# Runs the training demo (Fashion-MNIST, examples/train): builds it first (scripts/build.sh,
# target `train`), then
#
#   scripts/train.sh [ARGS...]                  one process: train ARGS
#       e.g. scripts/train.sh --strategy mirrored --replicas 4 --epochs 5
#            scripts/train.sh --strategy central_storage --replicas 4 --epochs 5
#   scripts/train.sh --workers N [ARGS...]      N worker processes on this host, found through
#                                               RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (a
#                                               free port), each `train --strategy multi_worker ARGS`;
#                                               worker 0 (the chief) prints, the others log to files
#       e.g. scripts/train.sh --workers 2 --replicas 2 --epochs 1 --global-batch 256
#   scripts/train.sh --throughput [ARGS...]     samples per second, 1 epoch at global batch 256
#                                               each: one_device vs mirrored with 2 replicas, and
#                                               1 worker vs 2 workers; prints the two ratios
#   scripts/train.sh --table [ARGS...]          every strategy x model (mlp, cnn), 5 epochs each
#                                               at one global batch: a markdown table of test
#                                               accuracy and samples/s (scripts/train-table.sh)
#
# Under mpirun instead (nothing to export): mpirun -np 2 build/examples/train/train --strategy multi_worker
# Environment: COLLECTIVES_BUILD_DIR (default build); TRAIN_NO_BUILD=1 skips the build;
# TRAIN_TIME_LIMIT (seconds, default 3600) bounds every process. The processes run in the
# caller's folder, so paths in ARGS (--save-weights, --checkpoint-dir) are the caller's.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

BUILD_DIR=${COLLECTIVES_BUILD_DIR:-build}
[[ ${BUILD_DIR} == /* ]] || BUILD_DIR="${ROOT}/${BUILD_DIR}"  # as for scripts/build.sh
TRAIN="${BUILD_DIR}/examples/train/train"
LIMIT=${TRAIN_TIME_LIMIT:-3600}

if [[ ${TRAIN_NO_BUILD:-0} != 1 ]]; then
  COLLECTIVES_BUILD_TARGETS=${COLLECTIVES_BUILD_TARGETS:-train} "${ROOT}/scripts/build.sh" >&2
fi
if [[ ! -x ${TRAIN} ]]; then
  echo "train.sh: ${TRAIN} was not built (Eigen, zlib and CLI11 are needed)" >&2
  exit 1
fi

# timeout(1) runs its command in a process group of its own, which a Ctrl-C at the terminal does
# not reach: every command here therefore runs in the background, the script waits for it with
# `wait` (which a trapped signal interrupts at once), and on INT or TERM the trap sends TERM to
# every one still running (timeout hands it on to train) and removes run_workers' folder of
# worker logs before the script exits.
limited=()
work=""
stop_limited() {
  if [[ ${#limited[@]} -gt 0 ]]; then kill -TERM "${limited[@]}" 2>/dev/null; fi
  if [[ -n ${work} ]]; then rm -rf "${work}"; fi
  return 0
}
# set_stop_traps: the traps, set by each function that starts something (and again each time: a
# subshell, as the --throughput runs are, starts without them).
set_stop_traps() {
  trap 'stop_limited; exit 130' INT
  trap 'stop_limited; exit 143' TERM
}
# start_limited ARGS...: `timeout $LIMIT ARGS` in the background, its pid in $! and in limited.
start_limited() {
  set_stop_traps
  timeout "$LIMIT" "$@" &
  limited+=($!)
}
# run_limited ARGS...: the same, waited for; returns its status.
run_limited() {
  local rc=0
  start_limited "$@"
  wait $! || rc=$?
  limited=()
  return $rc
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# run_workers N ARGS...: N processes of `train --strategy multi_worker ARGS` on loopback. The
# chief's output goes to stdout, the others' to $work/worker<i>.log (printed if they fail).
# Returns non-zero if any worker fails.
run_workers() {
  local n=$1
  shift
  local port pids=() rc=0 i
  set_stop_traps  # before the folder exists
  port=$(free_port)
  work=$(mktemp -d)
  # A fresh job token unless one is given: every connection of the job proves it.
  export COLLECTIVES_JOB_TOKEN=${COLLECTIVES_JOB_TOKEN:-$(python3 -c 'import secrets; print(secrets.token_hex(16))')}
  for ((i = 1; i < n; ++i)); do
    start_limited env -u TF_CONFIG -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE \
      RANK=$i WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      "$TRAIN" --strategy multi_worker "$@" >"$work/worker$i.log" 2>&1
    pids+=($!)
  done
  start_limited env -u TF_CONFIG -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE \
    RANK=0 WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    "$TRAIN" --strategy multi_worker "$@"
  wait $! || rc=$?
  for ((i = 1; i < n; ++i)); do
    if ! wait "${pids[i - 1]}"; then
      echo "train.sh: worker $i failed:" >&2
      cat "$work/worker$i.log" >&2
      rc=1
    fi
  done
  limited=()
  rm -rf "$work"
  work=""
  return $rc
}

# throughput LABEL COMMAND...: runs it, echoes its output, and sets $samples_per_s.
samples_per_s=0
throughput() {
  local label=$1 out
  shift
  echo "== ${label} =="
  out=$("$@" | tee /dev/stderr)
  samples_per_s=$(sed -n 's/^throughput: \([0-9.]*\) samples\/s.*/\1/p' <<<"$out" | tail -1)
  if [[ -z ${samples_per_s} ]]; then
    echo "train.sh: no throughput line from ${label}" >&2
    exit 1
  fi
}

case "${1:-}" in
  --workers)
    n=${2:-}
    # Checked here: bash's arithmetic below would read any other text as an expression.
    if [[ ! ${n} =~ ^[1-9][0-9]{0,3}$ ]]; then
      echo "train.sh: --workers needs a number of workers (1 to 9999), got '${n}'" >&2
      exit 2
    fi
    shift 2
    run_workers "$n" "$@"
    ;;
  --throughput)
    shift
    common=(--epochs 1 --global-batch 256 --quiet-progress "$@")
    throughput "one_device" run_limited "$TRAIN" --strategy one_device "${common[@]}" 2>&1
    one_device=$samples_per_s
    throughput "mirrored, 2 replicas" run_limited "$TRAIN" --strategy mirrored --replicas 2 \
      "${common[@]}" 2>&1
    mirrored=$samples_per_s
    throughput "multi_worker, 1 worker" run_workers 1 "${common[@]}" 2>&1
    one_worker=$samples_per_s
    throughput "multi_worker, 2 workers" run_workers 2 "${common[@]}" 2>&1
    two_workers=$samples_per_s
    # Other work on the machine takes cores from the 2-replica runs first: say how busy it was.
    echo "== throughput (samples/s, global batch 256, 1 epoch, $(nproc) cores," \
      "load average $(cut -d' ' -f1-3 /proc/loadavg)) =="
    printf '%-28s %10.0f\n' "one_device" "$one_device" "mirrored, 2 replicas" "$mirrored" \
      "multi_worker, 1 worker" "$one_worker" "multi_worker, 2 workers" "$two_workers"
    awk -v a="$mirrored" -v b="$one_device" -v c="$two_workers" -v d="$one_worker" 'BEGIN {
      printf "ratio mirrored 2 replicas / one_device: %.2fx\n", a / b
      printf "ratio 2 workers / 1 worker:             %.2fx\n", c / d }'
    ;;
  --table)
    shift
    # Not under one time limit: each of its runs has TRAIN_TIME_LIMIT. A TERM stops it and its run.
    set_stop_traps
    bash "${ROOT}/scripts/train-table.sh" "$@" &
    limited+=($!)
    wait $!
    ;;
  *)
    run_limited "$TRAIN" "$@"
    ;;
esac
