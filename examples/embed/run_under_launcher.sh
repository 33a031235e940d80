#!/usr/bin/env bash
# Runs a program built on the library as a job of RANKS processes started by a real launcher,
# with none of our variables exported (no MASTER_ADDR, MASTER_PORT, RANK, TF_CONFIG, job id or
# token): the program must find its peers from what the launcher sets alone.
#
#   run_under_launcher.sh LAUNCHER RANKS [--expect TEXT] -- COMMAND [ARGS...]
#
#   LAUNCHER  mpirun    Open MPI's mpirun (the ranks meet through its PMIx server)
#             torchrun  python3 -m torch.distributed.run --standalone --no_python (Debian's
#                       interpreter; RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK, ...)
#             srun      the variables Slurm's srun gives each task of a job step (SLURM_PROCID,
#                       SLURM_NTASKS, SLURM_STEP_ID, SLURM_JOB_ID, a compressed
#                       SLURM_STEP_NODELIST), for machines without a Slurm controller; the job id
#                       is picked so that the port derived from it is free
#
# Passes (exit 0) when every rank exits 0 within TIME_LIMIT seconds (default 120), the output
# holds TEXT when given, and every "final weights checksum X" line the ranks print (the embed
# examples) shows the same X, one per rank. Otherwise exit 1, saying why; 2 on a bad command line.
set -u
usage() {
  echo "usage: $0 mpirun|torchrun|srun RANKS [--expect TEXT] -- COMMAND [ARGS...]" >&2
  exit 2
}
[ $# -ge 4 ] || usage
launcher=$1
ranks=$2
shift 2
expect=""
if [ "$1" = "--expect" ]; then
  [ $# -ge 2 ] || usage
  expect=$2
  shift 2
fi
[ "$1" = "--" ] || usage
shift
[ $# -ge 1 ] || usage
case $ranks in
  '' | *[!0-9]* | 0) usage ;;
esac
limit=${TIME_LIMIT:-120}
python=/usr/bin/python3  # Debian's, which has torch; not a pyenv python3 first on PATH

clean=(env -u TF_CONFIG -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT
  -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE -u COLLECTIVES_JOB_ID -u COLLECTIVES_JOB_TOKEN
  -u SLURM_PROCID -u SLURM_NTASKS -u SLURM_STEP_ID -u SLURM_JOB_ID -u SLURM_STEP_NODELIST)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
stop_all() {
  local running
  running=$(jobs -p)
  if [ -n "$running" ]; then kill -TERM $running 2>/dev/null; fi
  return 0
}
trap 'stop_all; exit 130' INT
trap 'stop_all; exit 143' TERM

status=0
case $launcher in
  mpirun)
    "${clean[@]}" timeout "$limit" mpirun --allow-run-as-root --oversubscribe -np "$ranks" \
      "$@" >"$work/out" 2>&1 &
    wait $! || status=$?
    ;;
  torchrun)
    "${clean[@]}" timeout "$limit" "$python" -m torch.distributed.run --standalone \
      --nproc_per_node "$ranks" --no_python --redirects 1 --tee 1 "$@" >"$work/out" 2>&1 &
    wait $! || status=$?
    ;;
  srun)
    # A free port p; the job and step ids that give it (20000 + 4 * (job % 10000) + step).
    port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    while [ "$port" -lt 20000 ] || [ "$port" -gt 59999 ]; do
      port=$("$python" -c 'import random, socket; p = random.randint(20000, 59999); s = socket.socket(); s.bind(("127.0.0.1", p)); print(p)' 2>/dev/null || echo 0)
    done
    job=$((90000 + (port - 20000) / 4))
    step=$(((port - 20000) % 4))
    pids=()
    for ((r = ranks - 1; r >= 0; r--)); do
      "${clean[@]}" SLURM_PROCID=$r SLURM_NTASKS="$ranks" SLURM_STEP_NUM_TASKS="$ranks" \
        SLURM_STEP_ID=$step SLURM_JOB_ID=$job SLURM_STEP_NODELIST='127.0.0.[1-2]' \
        SLURM_LOCALID=$r timeout "$limit" "$@" >"$work/out.$r" 2>&1 &
      pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
    cat "$work"/out.* >"$work/out"
    ;;
  *) usage ;;
esac

cat "$work/out"
result=0
if [ "$status" -ne 0 ]; then
  echo "FAIL: $launcher: a rank exited with status $status (124: timed out after $limit s)"
  result=1
fi
if [ -n "$expect" ] && ! grep -qF -- "$expect" "$work/out"; then
  echo "FAIL: the output lacks '$expect'"
  result=1
fi
sums=$(sed -n 's/.*final weights checksum \([0-9a-f]*\).*/\1/p' "$work/out")
if [ -n "$sums" ]; then
  count=$(wc -l <<<"$sums")
  distinct=$(sort -u <<<"$sums" | wc -l)
  if [ "$count" -ne "$ranks" ] || [ "$distinct" -ne 1 ]; then
    echo "FAIL: $count checksums from $ranks ranks, $distinct distinct"
    result=1
  fi
fi
[ "$result" -eq 0 ] && echo "PASS: $launcher, $ranks ranks, nothing exported"
exit $result
